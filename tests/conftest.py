"""Shared fixtures."""

import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def fsdp_step():
    """A traced FSDP training step of a 2-layer debug Llama on a 1-rank gloo group (the
    collectives really run): ``(TracedStep, flat inputs, number of parameters)``."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        from graph_trainer import fsdp
        from graph_trainer.llama3 import Transformer, llama3_args
        from graph_trainer.trace import trace_train_step
        from graph_trainer.train import loss_fn

        torch.manual_seed(0)
        args = llama3_args["debugmodel"]
        args = type(args)(**{**args.__dict__, "n_layers": 2})
        model = Transformer(args)
        with torch.no_grad():
            model.init_weights()
        tokens = torch.randint(0, 2048, (2, 16))
        labels = torch.randint(0, 2048, (2, 16))
        bufs = list(model.buffers())
        group = dist.group.WORLD
        specs, shards = fsdp.shard_parameters(model, group)
        traced = trace_train_step(
            model, loss_fn, tokens, labels, params=shards, param_names=[s.name for s in specs],
            materialize=lambda ps: [fsdp.all_gather_param(p, s, group) for p, s in zip(ps, specs)],
        )
        yield traced, (*shards, *bufs, tokens, labels), len(specs)
    finally:
        dist.destroy_process_group()


