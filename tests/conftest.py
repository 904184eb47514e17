"""Shared fixtures: tiny models, the runs of tests/_early.py that several files read; one OpenMP thread per process."""

import contextlib
import logging
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported: this process too

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import _early  # noqa: E402  tests/ is on sys.path
from _launch import fork_call  # noqa: E402
from _runs import FINISHED, bitwise_runs, dry_run_8b_8_ranks, run_debug  # noqa: E402


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects
def pytest_collection_modifyitems(config, items):
    no_cuda = pytest.mark.skip(reason="needs CUDA") if not torch.cuda.is_available() else None
    for item in items:
        if _early.is_slow(item):
            item.add_marker(pytest.mark.slow)
        if no_cuda and item.get_closest_marker("gpu"):  # `pytest -m gpu` on a GPU host: the one-GPU tests alone
            item.add_marker(no_cuda)


def pytest_configure(config):
    config.addinivalue_line("markers", f"{_early.MARK}(name): reads tests/_early.py's run ``name``")


def pytest_collection_finish(session):
    """The runs of tests/_early.py that the selected tests read are queued; the first starts now."""
    if not session.config.option.collectonly:
        _early.start(session.items, session.config._tmp_path_factory)


def pytest_runtest_logfinish(nodeid, location):
    _early.advance()  # the next run of tests/_early.py, if the last one is done


def pytest_sessionfinish(session):
    _early.stop()


@pytest.fixture(scope="session")
def tiny_llama():
    """``tiny_llama(n_layers, seed=0)``: a seeded debug Llama3 in train mode: dim 32, 2 heads, vocab 64, seq <= 32."""
    from graph_trainer.model import build_model, model_args

    tiny = dict(dim=32, n_heads=2, vocab_size=64, max_seq_len=32)
    return lambda n_layers, seed=0: build_model(model_args("debugmodel", n_layers=n_layers, **tiny), seed=seed)


@pytest.fixture
def gloo1():
    """This process is the one rank of a gloo group until the test ends."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def fsdp_trace(gloo1):
    """``fsdp_trace(param_dtype=None)``: a traced FSDP step on a 1-rank gloo group: ``(traced, inputs, n_params)``."""

    def trace(param_dtype=None):
        from graph_trainer.distributed import fsdp
        from graph_trainer.model import build_model, loss_fn, model_args
        from graph_trainer.trace import trace_train_step

        model = build_model(model_args("debugmodel", n_layers=2), seed=0)
        tokens, labels = torch.randint(0, 2048, (2, 16)), torch.randint(0, 2048, (2, 16))
        names, params = zip(*model.named_parameters())
        specs, shards = fsdp.shard_tensors(list(names), list(params), dist.group.WORLD)
        fsdp.free_parameters(model, names)
        traced = trace_train_step(model, loss_fn, tokens, labels, params=shards, param_names=[s.name for s in specs],
                                  materialize=lambda ps: [fsdp.all_gather_param(p, s, dist.group.WORLD, param_dtype)
                                                          for p, s in zip(ps, specs)])
        return traced, (*shards, *model.buffers(), tokens, labels), len(specs)

    return trace


@pytest.fixture
def fake_group():
    """``fake_group(world)``: this process is rank 0 of ``world`` on the fake backend until the test ends."""
    from torch.testing._internal.distributed import fake_pg  # noqa: F401  registers the "fake" backend

    yield lambda world: dist.init_process_group("fake", rank=0, world_size=world)
    dist.destroy_process_group()


@pytest.fixture
def fsdp_step(fsdp_trace):
    """:func:`fsdp_trace` with parameters all-gathered as stored (fp32)."""
    return fsdp_trace()


@_early.job("finished_run")
def _finished_run(tmp, env):
    """The dump folder of a finished forked run (``_runs.FINISHED``); copy it before changing it."""
    dump = tmp / "run"
    r = run_debug(dump, FINISHED, steps=4, forked=True, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return dump


# _runs.bitwise_runs, 4 steps, on 1 rank and on 2 gloo ranks (FSDP2): (a, b, b's resume)
_early.job("bitwise_1rank", lambda tmp, env: bitwise_runs(tmp, 1, 4, env=env))  # tests/test_determinism.py
_early.job("bitwise_gloo2", lambda tmp, env: bitwise_runs(tmp, 2, 4, env=env))  # and tests/test_multinode.py


@contextlib.contextmanager
def graph_trainer_logs():
    """graph_trainer's log messages (INFO and up) while the context is open, in the yielded list."""
    messages, handler, log = [], logging.Handler(), logging.getLogger("graph_trainer")
    handler.emit = lambda record: messages.append(record.getMessage())
    old_level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield messages
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)


@pytest.fixture
def log_lines():
    """graph_trainer's log messages during the test."""
    with graph_trainer_logs() as lines:
        yield lines


@_early.job("dry_runs_8b")
def _dry_runs_8b(tmp, env):
    """The 8B dry runs on 8 fake ranks, side by side: ``{"fsdp4_tp2": (summary, logs), "fsdp8": summary}``."""
    fsdp8 = fork_call(dry_run_8b_8_ranks, "--compile.sac.save", "recompute", "--compile.fsdp.keep_last_blocks", "0",
                      "--compile.memory_budget_gib", "71")
    with graph_trainer_logs() as messages:
        summary = dry_run_8b_8_ranks("--parallelism.data_parallel_shard_degree", "4",
                                     "--parallelism.tensor_parallel_degree", "2", "--compile.passes", "async_tp",
                                     "--compile.numerics_changing_optim")
    return {"fsdp4_tp2": (summary, messages), "fsdp8": fsdp8()}
