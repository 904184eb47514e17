#!/usr/bin/env python3
"""Compare per-step loss and final weight / gradient / optimizer hashes of two runs.

A thin wrapper around :mod:`graph_trainer.tools.loss_compare` (also installed as
``graph-trainer-loss-compare``); ``scripts/loss_compare.py --help`` lists the options.

    scripts/loss_compare.py --steps 10 --assert-equal                     # run-to-run
    scripts/loss_compare.py --a-flags "--compile.mode eager" --b-flags "" --assert-equal
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graph_trainer.tools.loss_compare import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
