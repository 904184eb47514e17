"""Probe (GPU): which regional Inductor compiles are slow, and where their time goes.

Runs ``graph_trainer.train`` with the given flags; every ``torch._inductor.standalone_compile``
call (one per distinct region) runs under cProfile. A call over ``PROBE_SLOW_S`` seconds
(default 5) prints the region's code, its inputs' shape / stride / dtype / device, and the
profile's top functions by cumulative time. Usage (from the repository root):

    python3 scripts/gpu/probe_region_compiles.py --job.config_file train_configs/llama3_8b.toml \
        --comm.mode fake_collectives --parallelism.tensor_parallel_degree 2 ... --training.steps 1
"""
import cProfile
import io
import os
import pstats
import runpy
import sys
import time

import torch
import torch._inductor as inductor

SLOW_S = float(os.environ.get("PROBE_SLOW_S", "5"))
_orig = inductor.standalone_compile


def probed(gm, example_inputs, *args, **kwargs):
    prof, t0 = cProfile.Profile(), time.perf_counter()
    out = prof.runcall(_orig, gm, example_inputs, *args, **kwargs)
    dt = time.perf_counter() - t0
    if dt > SLOW_S:
        print(f"=== slow region compile: {dt:.1f} s", flush=True)
        print(gm.code.strip())
        for v in example_inputs:
            if isinstance(v, torch.Tensor):
                print(f"  input {v.dtype} {list(v.shape)} stride {v.stride()} device {v.device} "
                      f"storage offset {v.storage_offset()} {type(v).__name__}")
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(35)
        print("\n".join(line[:220] for line in s.getvalue().splitlines() if line.strip()), flush=True)
    return out


inductor.standalone_compile = probed
sys.argv = ["graph_trainer.train", *sys.argv[1:]]
runpy.run_module("graph_trainer.train", run_name="__main__")
