#!/usr/bin/env python3
"""Compare tps / TFLOPS / MFU / memory between two branches or flag sets.

A thin wrapper around :mod:`graph_trainer.tools.compare_mfu` (also installed as
``graph-trainer-compare``); ``scripts/compare_mfu.py --help`` lists the options.

    scripts/compare_mfu.py --a main --b HEAD --repeats 3 -- --compile.mode aot_fx_trace
    scripts/compare_mfu.py --a-flags "" --b-flags "--compile.numerics_changing_optim"
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graph_trainer.tools.compare_mfu import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
