"""The first-divergence finder: per-op records of step 1 and their comparison."""

import json
import os

import torch

from graph_trainer import NUMERICS_KEY
from graph_trainer.model import build_model, loss_fn, model_args
from graph_trainer.numerics import (EagerRecorder, GraphRecorder, assign_keys, fingerprint, key_text, load, record,
                                    record_eager_forward, save)
from graph_trainer.tools.numerics_diff import compare, main
from graph_trainer.trace import trace_train_step

import _early  # tests/ is on sys.path
from _launch import run_script
from _runs import SMALL


def _record_graph(gm, flat):
    rec = GraphRecorder(gm)
    with torch.no_grad():
        rec.run(*flat)
    return rec.records


def _brute_force_first(a, b):
    return next((k for k, ra in a.items()
                 if k in b and not (ra.shape == b[k].shape and torch.equal(ra.values, b[k].values))), None)


def test_fingerprint_is_bitwise():
    x = torch.randn(1000)
    y = x.clone()
    assert fingerprint(x) == fingerprint(y)
    y[537] = torch.nextafter(y[537], torch.tensor(float("inf")))
    assert fingerprint(x) != fingerprint(y)
    assert fingerprint(torch.tensor([0.0])) != fingerprint(torch.tensor([-0.0]))  # bits, not values
    for t in (torch.arange(6, dtype=torch.int64), torch.ones(3, dtype=torch.bool), torch.randn(4).to(torch.bfloat16)):
        assert fingerprint(t) == fingerprint(t.clone())
    assert (big := record(torch.randn(3 << 20))).sampled and big.values.numel() == 1 << 16


def test_save_load_and_bad_input(tmp_path, capsys):
    recs = {("forward", "x", "aten.mm.default", 0): record(torch.ones(3)), "loss": record(torch.tensor(1.0))}
    path = save(str(tmp_path / "a"), 0, recs, {"mode": "test"})
    assert save(str(tmp_path / "a"), 0, recs, {"mode": "test"}) == path  # the earlier record is kept aside
    assert os.path.exists(tmp_path / "a" / "rank0.1.pt")
    loaded, meta = load(path)
    assert list(loaded) == list(recs) and meta == {"mode": "test"}
    save(str(tmp_path / "b"), 0, {**recs, "loss": record(torch.tensor(2.0))}, {})
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert main(["--records", a, a]) == 0 and main(["--records", a, b]) == 1
    assert "first difference: loss" in capsys.readouterr().out
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "rank0.pt").write_text("not a record")
    for args, needle in ((["--records", a, str(tmp_path / "nothing")], "no rank<r>.pt record"),
                         (["--records", a, b, "--rtol", "-1"], "--rtol must be"),
                         (["--records", a, str(tmp_path / "c")], "not a numerics record")):
        assert main(args) == 2
        assert needle in (err := capsys.readouterr().err) and "Traceback" not in err


def test_replays_and_eager_agree_and_a_perturbed_op_is_named_first():
    """Replays and eager agree op by op; 1 ulp added to one backward matmul is named first, 1e-5 accepts it."""
    model = build_model(model_args("debugmodel", n_layers=2, vocab_size=64), seed=0)
    g = torch.Generator().manual_seed(1)
    tokens, labels = torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)
    traced = trace_train_step(model, loss_fn, tokens, labels)
    assign_keys(traced.gm)
    flat = [*model.parameters(), *model.buffers(), tokens, labels]
    a = _record_graph(traced.gm, flat)
    assert (cmp := compare(a, _record_graph(traced.gm, flat))).matched == len(a) > 300 and not cmp.divergent
    rec = EagerRecorder()
    with record_eager_forward(model, rec):
        loss = loss_fn(model(tokens), labels)
    rec.phase = "backward"
    with rec:
        loss.backward()
    cmp = compare(a, rec.records)
    assert not cmp.divergent and cmp.matched > 0.9 * len(a)  # forward and backward ops matched by key
    assert {k[0] for k in a if k in rec.records} == {"forward", "backward"}
    assert "layers.1.feed_forward.w2" in {k[1] for k in a if k in rec.records}

    chosen = [n for n in traced.gm.graph.nodes if n.target == torch.ops.aten.mm.default
              and n.meta.get(NUMERICS_KEY, ())[:2] == ("backward", "layers.1.feed_forward.w1")][0]
    key = chosen.meta[NUMERICS_KEY]
    chosen.target = lambda x, y: torch.nextafter(out := torch.mm(x, y), torch.full_like(out, float("inf")))  # + 1 ulp
    traced.gm.recompile()
    b = _record_graph(traced.gm, flat)
    assert (cmp := compare(a, b)).divergent[0].key == key == _brute_force_first(a, b)
    assert cmp.divergent[0].max_abs > 0 and cmp.divergent[0].max_rel < 1e-6
    assert key not in {d.key for d in compare(a, b, rtol=1e-5).divergent}


def _cli(tmp, env, a_flags: str, b_flags: str, *extra: str):
    """``(out folder, result)`` of scripts/numerics_diff.py at :data:`SMALL` shapes, forked (its imports done)."""
    out = tmp / "nd"
    return out, run_script(["scripts/numerics_diff.py", "--a-flags", a_flags, "--b-flags", b_flags, "--out", str(out),
                            "--", *SMALL, *extra], env=env, timeout=900)


_early.job("numerics_diff_cli", lambda tmp, env: _cli(tmp, env, "", "--compile.numerics_changing_optim"))


@_early.uses("numerics_diff_cli")
def test_cli_names_the_rmsnorm_node():
    out, r = _early.result("numerics_diff_cli")
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    first = json.loads((out / "numerics_diff.json").read_text())["ranks"]["0"]["divergent"][0]
    assert first["key"].split()[1].endswith("norm"), first
    assert f"first difference: {first['key']}" in r.stdout
    a, b = (load(str(out / side / "numerics" / "rank0.pt"))[0] for side in "ab")
    assert key_text(_brute_force_first(a, b)) == first["key"]


_early.job("numerics_diff_tp2", lambda tmp, env: _cli(
    tmp, {**env, "NGPU": "2"}, "--compile.mode eager", "", "--parallelism.data_parallel_shard_degree", "1",
    "--parallelism.tensor_parallel_degree", "2", "--debug.deterministic"))


@_early.uses("numerics_diff_tp2")
def test_cli_eager_and_traced_agree_op_by_op_at_tp2():
    """At TP2 on gloo no op, loss or gradient of step 1 differs between eager (DTensors, partial grads) and traced."""
    out, r = _early.result("numerics_diff_tp2")
    assert r.returncode == 0 and r.stdout.count("no difference") == 2, r.stdout[-3000:] + r.stderr[-3000:]
