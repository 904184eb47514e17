#!/usr/bin/env python3
"""The bench command: a workload's named variants in alternating rounds, a table, a record.

A thin wrapper around :mod:`graph_trainer.tools.bench`; ``scripts/bench.py --help`` lists the options.

    NGPU=2 CONFIG=graph_trainer_llama3_1b scripts/bench.py --variant jit="--compile.mode jit" --variant plain="" \\
        -- --parallelism.data_parallel_shard_degree 2
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graph_trainer.tools.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
