"""Shared fixtures: the tiny models of the tests, built with :mod:`graph_trainer.model`, and
the runs that several test modules start from or check: a finished 1-rank run with
checkpoints (``finished_run``), a 4-rank FSDP run through run_train.sh (``fsdp4_run``) and
the 8B dry run of the seed layout (``dry_run_8b_fsdp4_tp2``).

Tiers: ``pytest -m "not slow" tests`` is the inner loop. Tests that start training runs in
subprocesses, dry-run the 8B or compile with Inductor for long are marked ``slow``; so is,
by :func:`pytest_collection_modifyitems`, every test that uses a fixture of
:data:`SLOW_FIXTURES` (a session run: its cost would otherwise land in the fast tier).

Every process of the tests runs one OpenMP thread (``OMP_NUM_THREADS=1``, unless set
already; torchrun's own default for several ranks): the tests start several CPU-bound
processes at once on a machine of a few cores, where threads that wait for each other's
cores made single ops up to 20x slower. Runs whose numbers a test compares all use one thread.
"""

import os
import subprocess

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported: this process too

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: The tiny Llama3 of the pass tests: the debug flavor shrunk to dim 32, 2 heads,
#: vocabulary 64 and sequences of up to 32 tokens.
TINY_LLAMA = dict(dim=32, n_heads=2, vocab_size=64, max_seq_len=32)

#: Session fixtures that start training runs or dry-run the 8B: their tests are slow.
SLOW_FIXTURES = frozenset({"finished_run", "fsdp4_run", "dry_run_8b_fsdp4_tp2"})


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects
def pytest_collection_modifyitems(config, items):
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


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
        from graph_trainer.distributed import fsdp
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


@pytest.fixture(scope="session")
def fsdp4_run(tmp_path_factory):
    """``NGPU=4 ./run_train.sh`` on the debug model, FSDP4 (seq 64, batch 2, 2 steps; CPU
    only, no launcher variables inherited): ``(stdout, losses, grad norms)``. The one-host
    reference of tests/test_multinode.py and the traced FSDP4 run of
    tests/test_parallel_layouts.py."""
    from _runs import fsdp4_flags, launch_env
    from graph_trainer.metrics import read_metrics

    dump = tmp_path_factory.mktemp("fsdp4_run") / "out"
    r = subprocess.run(["bash", "run_train.sh", *fsdp4_flags(), "--job.dump_folder", str(dump)], cwd=REPO,
                       env=launch_env(NGPU="4"), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows, summary = read_metrics(os.path.join(dump, "metrics.jsonl"))
    assert summary["final_loss"] > 0  # the README's multi-process command on CPU: torchrun + gloo, data parallel
    return r.stdout, [x["loss"] for x in rows], [x["grad_norm"] for x in rows]


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory):
    """The dump folder of a finished run: the debug model, 4 steps, flags ``_runs.FINISHED``
    (full checkpoints at steps 2 and 4), the trainer's entry point forked from
    tests/_launch.py's server. Tests copy it (``shutil.copytree``) before they change
    anything: tests/test_resume.py, tests/test_records.py, tests/test_determinism.py."""
    from _runs import FINISHED, run_debug

    dump = tmp_path_factory.mktemp("finished_run") / "run"
    r = run_debug(dump, FINISHED, steps=4, forked=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return dump


@pytest.fixture(scope="session")
def dry_run_8b_fsdp4_tp2():
    """The seed layout's dry run, once per session: Llama3 8B, FSDP4 x TP2 on 8 fake ranks
    (``COMM_MODE=fake_backend NGPU=8``), with ``--compile.passes async_tp``, in this process.
    ``(summary, log messages of graph_trainer)``; the summary's collective counts are those
    of the traced graph (before any pass). Used by tests/test_fsdp.py and
    tests/passes/test_async_tp.py."""
    import logging

    from _runs import dry_run_8b_8_ranks

    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    log = logging.getLogger("graph_trainer")
    old_level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        summary = dry_run_8b_8_ranks("--parallelism.data_parallel_shard_degree", "4",
                                     "--parallelism.tensor_parallel_degree", "2", "--compile.passes", "async_tp")
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
    return summary, messages
