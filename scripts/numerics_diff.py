#!/usr/bin/env python3
"""Name the first op whose output differs between two runs' step 1 (per rank).

A thin wrapper around :mod:`graph_trainer.tools.numerics_diff` (also installed as
``graph-trainer-numerics-diff``); ``scripts/numerics_diff.py --help`` lists the options.

    scripts/numerics_diff.py --a-flags "" --b-flags "--compile.numerics_changing_optim"
    scripts/numerics_diff.py --a-flags "--compile.mode eager" --b-flags ""
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graph_trainer.tools.numerics_diff import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
