"""Comparison tools that launch training runs; not imported by training itself.

* :mod:`~graph_trainer.tools.compare_mfu`: tps / TFLOPS / MFU / memory of two sides
  (``scripts/compare_mfu.py``, ``graph-trainer-compare``).
* :mod:`~graph_trainer.tools.loss_compare`: per-step loss and final-state hashes of two
  runs, bit for bit (``scripts/loss_compare.py``, ``graph-trainer-loss-compare``).
* :mod:`~graph_trainer.tools.numerics_diff`: the first op whose output differs between two
  runs' step 1 (``scripts/numerics_diff.py``, ``graph-trainer-numerics-diff``); it reads the
  records with torch, imported when it compares.

Shared parts: :mod:`~graph_trainer.tools.sides` (the two sides: git refs in temporary
worktrees, flags checked by the trainer's config parser, the CLI error handling),
:mod:`~graph_trainer.tools.runs` (one ``run_train.sh`` run: progress, timeout,
process-tree control, failure cause), :mod:`~graph_trainer.tools.stats` (statistics
and tables), :mod:`~graph_trainer.tools.plot` (tps per step) and
:mod:`~graph_trainer.tools.timeline` (a profiled step's timeline: the breakdown of its wall
time, which :mod:`~graph_trainer.tools.profiling` imports, and its picture; matplotlib
imported when drawing).

These modules import no torch at import time: they only launch ``run_train.sh`` and
read what it writes.
"""
