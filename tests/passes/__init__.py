"""Tests of graph_trainer.compiler.passes: one ``test_<pass>.py`` per pass (a package, so that the
test modules import the shared helpers of ``conftest.py`` relatively)."""
