"""Imported once by tests/_launch.py's fork server (not a test module): the trainer and the modules
it imports lazily, so a forked rank starts without importing them."""

import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository

for _name in ("torch", "torch._inductor.compile_fx", "torch.distributed.checkpoint", "torch.distributed.fsdp",
              "torch.distributed.tensor.parallel", "torchtitan.components.checkpoint",
              "torchtitan.components.lr_scheduler", "torchtitan.components.optimizer",
              "torchtitan.hf_datasets.text_datasets", "torchtitan.models.llama3.infra.parallelize",
              "graph_trainer.checkpoint", "graph_trainer.config", "graph_trainer.data", "graph_trainer.metrics",
              "graph_trainer.model", "graph_trainer.distributed.parallelize", "graph_trainer.compiler.passes",
              "graph_trainer.step", "graph_trainer.train"):
    importlib.import_module(_name)
