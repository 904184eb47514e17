"""Imported once by tests/_launch.py's fork server (not a test module): the trainer and the
modules it imports lazily, so a forked rank starts without importing them."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository

import torch  # noqa: E402, F401
import torch._inductor.compile_fx  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.tensor.parallel  # noqa: F401
import torchtitan.components.checkpoint  # noqa: F401
import torchtitan.components.lr_scheduler  # noqa: F401
import torchtitan.components.optimizer  # noqa: F401
import torchtitan.hf_datasets.text_datasets  # noqa: F401
import torchtitan.models.llama3.infra.parallelize  # noqa: F401

import graph_trainer.checkpoint  # noqa: F401
import graph_trainer.config  # noqa: F401
import graph_trainer.data  # noqa: F401
import graph_trainer.metrics  # noqa: F401
import graph_trainer.model  # noqa: F401
import graph_trainer.distributed.parallelize  # noqa: F401
import graph_trainer.compiler.passes  # noqa: F401
import graph_trainer.step  # noqa: F401
import graph_trainer.train  # noqa: F401
