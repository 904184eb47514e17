"""pin_collectives: overlap_collectives' schedule survives full-graph Inductor (1-rank gloo FSDP step)."""

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from graph_trainer.compiler.collectives import is_wait
from graph_trainer.compiler.passes.full_inductor import full_inductor_pass
from graph_trainer.compiler.passes.overlap_collectives import overlap_collectives_pass
from graph_trainer.compiler.ops import packet_name
from graph_trainer.compiler.pin_collectives import _ANCHORS, collective_pin_deps

from .conftest import run_no_grad

_ISSUE = re.compile(r"(\w+) = torch\.ops\._c10d_functional\.(all_gather_into_tensor|reduce_scatter_tensor)")
_WAIT = re.compile(r"_c10d_functional\.wait_tensor\.default\((\w+)")
_MM = re.compile(r"extern_kernels\.(mm|addmm|bmm)\(|aten\.mm\.default\(")


def _schedule(code):
    """Generated code: per collective kind the most in flight at once; how many waits follow a matmul since issue."""
    pending, kind_of, worst, overlapped, mm_seen = {}, {}, {}, 0, 0
    for line in code.splitlines():
        if m := _ISSUE.search(line):
            buf, kind = m.groups()
            pending[buf], kind_of[buf] = mm_seen, kind
            worst[kind] = max(worst.get(kind, 0), sum(kind_of[p] == kind for p in pending))
        elif m := _WAIT.search(line):
            if m.group(1) in pending:
                overlapped += mm_seen > pending.pop(m.group(1))
        elif _MM.search(line):
            mm_seen += 1
    return worst, overlapped


def test_pin_deps_point_forward_and_bracket_each_overlapped_collective(fsdp_step):
    traced, _, n_params = fsdp_step
    gm = overlap_collectives_pass(traced.gm, None, cpu_async=True, ag_window=2)
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    deps = collective_pin_deps(gm.graph)
    assert deps and all(pos[d] < pos[n] for n, ds in deps.items() for d in ds)  # acyclic: forward only
    anchors = [pos[n] for n in nodes if packet_name(n) in _ANCHORS]
    pinned = 0
    for w in filter(is_wait, nodes):
        c = w.args[0]
        inside = [a for a in anchors if pos[c] < a < pos[w]]
        if inside:
            assert c in deps[nodes[inside[0]]] and nodes[inside[-1]] in deps[w]
            pinned += 1
        else:
            assert w not in deps
    assert pinned > n_params and list(gm.graph.nodes) == list(pos)  # most overlap a matmul; the graph is unchanged


@pytest.mark.slow
def test_full_inductor_keeps_the_overlap_schedule(fsdp_step):
    """Pinned, the compiled code keeps the FX schedule's overlap, no more in flight; same values."""
    traced, inputs, _ = fsdp_step
    ref = run_no_grad(traced.gm, inputs)
    gm = overlap_collectives_pass(traced.gm, None, cpu_async=True, ag_window=2)
    fx_worst, fx_overlapped = _schedule(gm.code)
    assert fx_overlapped > 0
    with torch._inductor.config.patch(fx_graph_cache=False):
        out, codes = run_and_get_code(lambda: full_inductor_pass(gm, list(inputs), pin_collectives=True)(*inputs))
    worst, overlapped = _schedule("\n".join(codes))
    assert overlapped == fx_overlapped
    assert all(n <= fx_worst[kind] for kind, n in worst.items()), (worst, fx_worst)
    torch.testing.assert_close(list(out), list(ref), rtol=1e-4, atol=1e-6)
