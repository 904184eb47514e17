"""The first-divergence finder: per-op records of step 1 (graph_trainer.numerics) and their
comparison (graph_trainer.tools.numerics_diff, scripts/numerics_diff.py)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from graph_trainer import NUMERICS_KEY
from graph_trainer.model import build_model, loss_fn, model_args
from graph_trainer.numerics import (
    EagerRecorder,
    GraphRecorder,
    assign_keys,
    fingerprint,
    load,
    record,
    record_eager_forward,
    save,
)
from graph_trainer.tools.numerics_diff import compare, main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model():
    return build_model(model_args("debugmodel", n_layers=2, vocab_size=64), seed=0)


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)


def _traced(model, tokens, labels):
    from graph_trainer.trace import trace_train_step

    traced = trace_train_step(model, loss_fn, tokens, labels)
    assign_keys(traced.gm)
    flat = [p for p in model.parameters()] + list(model.buffers()) + [tokens, labels]
    return traced, flat


def _record_graph(gm, flat):
    rec = GraphRecorder(gm)
    with torch.no_grad():
        out = rec.run(*flat)
    return rec.records, out


def _brute_force_first(a, b):
    """The first key of A (in order) whose values differ from B's, by direct comparison."""
    for k, ra in a.items():
        if k in b and not (ra.shape == b[k].shape and torch.equal(ra.values, b[k].values)):
            return k
    return None


def test_fingerprint_is_bitwise():
    x = torch.randn(1000)
    y = x.clone()
    assert fingerprint(x) == fingerprint(y)
    y[537] = torch.nextafter(y[537], torch.tensor(float("inf")))
    assert fingerprint(x) != fingerprint(y)
    assert fingerprint(torch.tensor([0.0])) != fingerprint(torch.tensor([-0.0]))  # bits, not values
    for t in (torch.arange(6, dtype=torch.int64), torch.ones(3, dtype=torch.bool), torch.randn(4).to(torch.bfloat16)):
        assert fingerprint(t) == fingerprint(t.clone())
    big = record(torch.randn(3 << 20))
    assert big.sampled and big.values.numel() == 1 << 16


def test_run_to_run_and_trace_vs_eager_have_no_divergence():
    """fp32 on CPU: two replays of the traced step agree bitwise op by op, and the traced
    step agrees with eager autograd on every op both run (keys matched, not only outputs)."""
    model = _model()
    tokens, labels = _batch()
    traced, flat = _traced(model, tokens, labels)
    a, _ = _record_graph(traced.gm, flat)
    b, _ = _record_graph(traced.gm, flat)
    cmp = compare(a, b)
    assert cmp.matched == len(a) > 300 and not cmp.divergent

    rec = EagerRecorder()
    with record_eager_forward(model, rec):
        loss = loss_fn(model(tokens), labels)
    rec.phase = "backward"
    with rec:
        loss.backward()
    cmp = compare(a, rec.records)
    assert not cmp.divergent
    assert cmp.matched > 0.9 * len(a)  # forward and backward ops matched by key
    phases = {k[0] for k in a if k in rec.records}
    fqns = {k[1] for k in a if k in rec.records}
    assert phases == {"forward", "backward"} and "layers.1.feed_forward.w2" in fqns


def test_perturbed_op_is_named_first():
    """A test pass adds 1 ulp to one chosen op's output (the second block's FFN w1 matmul in
    the backward): the finder names exactly that op, and no earlier op differs."""
    model = _model()
    tokens, labels = _batch()
    traced, flat = _traced(model, tokens, labels)
    a, ref_out = _record_graph(traced.gm, flat)

    chosen = [n for n in traced.gm.graph.nodes
              if n.meta.get(NUMERICS_KEY, ("",))[0] == "backward" and n.target == torch.ops.aten.mm.default
              and n.meta[NUMERICS_KEY][1] == "layers.1.feed_forward.w1"][0]
    key = chosen.meta[NUMERICS_KEY]

    def mm_plus_ulp(x, y):
        out = torch.mm(x, y)
        return torch.nextafter(out, torch.full_like(out, float("inf")))

    chosen.target = mm_plus_ulp  # the node keeps its key (node.meta)
    traced.gm.recompile()
    b, out = _record_graph(traced.gm, flat)
    cmp = compare(a, b)
    assert cmp.divergent[0].key == key == _brute_force_first(a, b)
    assert cmp.divergent[0].max_abs > 0 and cmp.divergent[0].max_rel < 1e-6
    assert key not in {d.key for d in compare(a, b, rtol=1e-5).divergent}  # 1 ulp is within 1e-5


def test_save_load_and_bad_input(tmp_path, capsys):
    recs = {("forward", "x", "aten.mm.default", 0): record(torch.ones(3)), "loss": record(torch.tensor(1.0))}
    path = save(str(tmp_path / "a"), 0, recs, {"mode": "test"})
    again = save(str(tmp_path / "a"), 0, recs, {"mode": "test"})  # an earlier record is kept aside
    assert path == again and os.path.exists(tmp_path / "a" / "rank0.1.pt")
    loaded, meta = load(path)
    assert list(loaded) == list(recs) and meta == {"mode": "test"}
    save(str(tmp_path / "b"), 0, {**recs, "loss": record(torch.tensor(2.0))}, {})
    assert main(["--records", str(tmp_path / "a"), str(tmp_path / "a")]) == 0
    assert main(["--records", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    assert "first difference: loss" in capsys.readouterr().out
    assert main(["--records", str(tmp_path / "a"), str(tmp_path / "nothing")]) == 2
    assert main(["--records", str(tmp_path / "a"), str(tmp_path / "b"), "--rtol", "-1"]) == 2
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "rank0.pt").write_text("not a record")
    assert main(["--records", str(tmp_path / "a"), str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "not a numerics record" in err and "Traceback" not in err


@pytest.mark.slow
def test_cli_names_the_rmsnorm_node(tmp_path):
    """The default pipeline against --compile.numerics_changing_optim on the debug model
    (seq 64, batch 2): the first op that differs is an RMSNorm op (module FQN a norm), and no
    op before it in A's execution order differs (brute force over the records)."""
    out = tmp_path / "nd"
    r = subprocess.run([sys.executable, "scripts/numerics_diff.py", "--a-flags", "", "--b-flags",
                        "--compile.numerics_changing_optim", "--out", str(out),
                        "--", "--training.seq_len", "64", "--training.local_batch_size", "2"],
                       cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((out / "numerics_diff.json").read_text())
    first = result["ranks"]["0"]["divergent"][0]
    assert first["key"].split()[1].endswith("norm"), first
    assert f"first difference: {first['key']}" in r.stdout
    a, _ = load(str(out / "a" / "numerics" / "rank0.pt"))
    b, _ = load(str(out / "b" / "numerics" / "rank0.pt"))
    from graph_trainer.numerics import key_text

    assert key_text(_brute_force_first(a, b)) == first["key"]
