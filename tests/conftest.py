"""Shared fixtures: the tiny models of the tests, built with :mod:`graph_trainer.model`."""

import pytest
import torch
import torch.distributed as dist

#: The tiny Llama3 of the pass tests: the debug flavor shrunk to dim 32, 2 heads,
#: vocabulary 64 and sequences of up to 32 tokens.
TINY_LLAMA = dict(dim=32, n_heads=2, vocab_size=64, max_seq_len=32)


@pytest.fixture(scope="session")
def tiny_llama():
    """``tiny_llama(n_layers, seed=0)``: a new tiny Llama3 (:data:`TINY_LLAMA`, ``n_layers``
    blocks) from ``graph_trainer.model.build_model``: seeded, weights initialised, train mode."""
    from graph_trainer.model import build_model, model_args

    def build(n_layers: int, seed: int = 0):
        return build_model(model_args("debugmodel", n_layers=n_layers, **TINY_LLAMA), seed=seed)

    return build


@pytest.fixture
def fsdp_trace():
    """``fsdp_trace(param_dtype=None)``: a traced FSDP training step of a 2-layer debug Llama
    on a 1-rank gloo group (the collectives really run), all-gathering parameters in
    ``param_dtype`` (None: as stored): ``(TracedStep, flat inputs, number of parameters)``.
    The process group lives until the end of the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    def trace(param_dtype=None):
        from graph_trainer import fsdp
        from graph_trainer.model import build_model, loss_fn, model_args
        from graph_trainer.trace import trace_train_step

        model = build_model(model_args("debugmodel", n_layers=2), seed=0)
        tokens = torch.randint(0, 2048, (2, 16))
        labels = torch.randint(0, 2048, (2, 16))
        bufs = list(model.buffers())
        group = dist.group.WORLD
        specs, shards = fsdp.shard_parameters(model, group)
        traced = trace_train_step(
            model, loss_fn, tokens, labels, params=shards, param_names=[s.name for s in specs],
            materialize=lambda ps: [fsdp.all_gather_param(p, s, group, param_dtype=param_dtype)
                                    for p, s in zip(ps, specs)],
        )
        return traced, (*shards, *bufs, tokens, labels), len(specs)

    try:
        yield trace
    finally:
        dist.destroy_process_group()


@pytest.fixture
def fsdp_step(fsdp_trace):
    """:func:`fsdp_trace` with parameters all-gathered as stored (fp32)."""
    return fsdp_trace()
