"""--compile.graph_cache_dir: the key, the split, and warm runs that load and train bitwise like cold."""

import dataclasses
import functools
import os

import pytest
import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode

from graph_trainer.compiler import graph_cache
from graph_trainer.compiler.collectives import hold
from graph_trainer.compiler.graph_values import placeholder_vals
from graph_trainer.compiler.node_meta import add_process_setup
from graph_trainer.compiler.pipeline import build_pipeline
from graph_trainer.config import Compile, parse_args
from graph_trainer.llama3 import llama3_args

from _runs import DEBUG, train_debug  # tests/ is on sys.path


def _key(*flags, rank=0):
    return graph_cache.cache_key(parse_args(["--job.config_file", DEBUG, *flags]), rank, 1, torch.device("cpu"))


def test_key_follows_what_decides_the_graph():
    base = _key()
    assert base == _key("--job.dump_folder", "/elsewhere", "--training.steps", "99", "--compile.graph_cache_dir", "x")
    assert len({base, _key("--training.seq_len", "64"), _key("--compile.inductor_compilation", "full"),
                _key("--debug.deterministic"), _key(rank=1)}) == 5
    with torch._inductor.config.patch(max_autotune=True):  # e.g. TORCHINDUCTOR_MAX_AUTOTUNE=1
        assert _key() != base


def test_auto_is_on_with_full_inductor_in_inductors_cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    assert Compile().graph_cache_dir == "auto" and graph_cache.cache_dir("/some/where", "regional") == "/some/where"
    assert graph_cache.cache_dir("auto", "full") == str(tmp_path / "graph_trainer")
    assert graph_cache.cache_dir("auto", "regional") is None and graph_cache.cache_dir("auto", "none") is None
    assert graph_cache.cache_dir("off", "full") is None and graph_cache.cache_dir("", "full") is None


def test_split_before_the_first_compiling_pass():
    for kw, first in [({}, "regional_inductor"), ({"inductor_compilation": "full"}, "full_inductor"),
                      ({"passes": "cudagraph", "inductor_compilation": "none"}, "cudagraph")]:
        assert (steps := build_pipeline(Compile(**kw)))[graph_cache.compile_index(steps)].name == first
    assert graph_cache.compile_index(steps := build_pipeline(Compile(inductor_compilation="none"))) == len(steps)


@pytest.mark.slow  # five short trainings
def test_warm_run_loads_the_compiled_step_or_the_graph_and_trains_bitwise(tmp_path, caplog, monkeypatch):
    # the debug model at two blocks: every run traces or loads, and trains, a smaller graph
    monkeypatch.setitem(llama3_args, "debugmodel", dataclasses.replace(llama3_args["debugmodel"], n_layers=2))
    cache = tmp_path / "cache"
    flags = ("--compile.graph_cache_dir", str(cache), "--training.steps", "3", "--debug.deterministic")
    full = (*flags, "--compile.inductor_compilation", "full")
    cold, cold_summary = train_debug(tmp_path, "cold", *full)
    entry = next(cache.glob("*.pkl"))
    assert sorted(os.listdir(cache)) == sorted(entry.stem + s for s in (".pkl", ".inductor", ".constants"))

    def warm(name, reference, *run_flags):
        caplog.clear()
        with caplog.at_level("INFO", logger="graph_trainer"):
            records, summary = train_debug(tmp_path, name, *run_flags)
        assert [(r["loss"], r["grad_norm"]) for r in records] == [(r["loss"], r["grad_norm"]) for r in reference]
        return summary

    # the compiled step: no graph loaded, nothing traced or compiled
    summary = warm("compiled", cold, *full)
    assert "graph cache: loaded the compiled step" in caplog.text and "graph pass full_inductor" not in caplog.text
    assert summary["graph_cache"] == "compiled" and summary["trace_time_s"] == 0.0 and "graph_cache" not in cold_summary
    # the entry holds no graph: an unreadable compiled step makes a warning and a cold run, which saves it again
    entry.with_suffix(".inductor").write_bytes(b"not an artifact")
    warm("again", cold, *full)
    assert "not used" in caplog.text and "Tracing the training step" in caplog.text
    assert "graph cache: saved the compiled step" in caplog.text
    # a regional pipeline: the entry is the graph, loaded and compiled
    regional, _ = train_debug(tmp_path, "regional", *flags)
    summary = warm("graph", regional, *flags)
    assert "Tracing the training step" not in caplog.text and "graph pass regional_inductor" in caplog.text
    assert summary["graph_cache"] == "hit"


def test_own_functions_shape_env_and_process_setup_survive_the_cache(tmp_path, caplog):
    """``hold`` and the shape env survive save / load; the process setup is redone on load (raising: entry unused)."""
    x = (g := torch.fx.Graph()).placeholder("x")
    g.output(g.call_function(hold, (g.call_function(torch.ops.aten.add.Tensor, (x, x)), x)))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    with FakeTensorMode():
        x.meta["val"] = torch.empty(4)
    add_process_setup(gm, functools.partial(os.makedirs, str(tmp_path / "set_up")))  # as async_tp's symm_mem
    assert graph_cache.save(tmp_path / "e.pkl", gm, [], [], [], {}) and not (tmp_path / "set_up").exists()
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [torch.ops.aten.add.Tensor, hold]
    loaded = graph_cache.load(tmp_path / "e.pkl")["gm"]
    assert (tmp_path / "set_up").is_dir() and torch.equal(loaded(torch.ones(4)), torch.full((4,), 2.0))
    assert [n.target for n in loaded.graph.nodes if n.op == "call_function"] == [torch.ops.aten.add.Tensor, hold]
    assert detect_fake_mode(placeholder_vals(loaded)).shape_env is not None  # else Inductor bypasses its cache
    with caplog.at_level("WARNING", logger="graph_trainer"):  # the folder exists now: makedirs raises
        assert graph_cache.load(tmp_path / "e.pkl") is None
    assert "not used (FileExistsError" in caplog.text
