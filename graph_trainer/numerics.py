"""Record every op's output of one training step, keyed so two runs can be matched op by op.

``--debug.record_numerics DIR``: step 1 writes ``DIR/rank<r>.pt``, each executed op's key and a :class:`Record` of its
output in execution order, plus ``"loss"`` and ``"grad:<FQN>"``. A key is ``(phase, module FQN, op, occurrence)``
(docs/design.md, "Checkpoints and determinism"): the traced graph is keyed before any pass (:func:`assign_keys`), eager
in execution order by :class:`EagerRecorder`. Unmatched: nodes passes create, ops inside compiled regions,
recomputation."""

import contextlib
import operator
import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch.distributed.tensor import DTensor, Replicate

from graph_trainer import MODULE_FQN_KEY, NUMERICS_KEY, PHASE_KEY
from graph_trainer.metrics import keep_previous
from graph_trainer.trace import annotate_module_fqns

#: Tensors with at most this many elements are kept whole; larger ones as a strided sample.
FULL_NUMEL = 1 << 20
#: Elements kept of a larger tensor (evenly strided over its flattened values).
SAMPLE_NUMEL = 1 << 16


@dataclass
class Record:
    """One op output: shape, dtype, :func:`fingerprint`, ``values`` on the CPU (a strided sample past
    :data:`FULL_NUMEL`: ``sampled``) and the number of NaN / inf elements."""

    shape: tuple
    dtype: str
    fingerprint: int
    values: torch.Tensor
    sampled: bool
    nonfinite: int


_CHUNK = 1 << 24
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(t: torch.Tensor) -> int:
    """A 64-bit hash of ``t``'s bits (any dtype and device; not cryptographic): the wrapping int64 sum of
    ``bits * (position mixed with large odd constants)``; unequal tensors collide with p ~2**-64."""
    x = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    if x.dtype == torch.bool:
        x = x.to(torch.uint8)
    if x.is_complex():
        x = torch.view_as_real(x).reshape(-1)
    ints = x.view(_INT_VIEW[x.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=x.device)
    for start in range(0, ints.numel(), _CHUNK):  # bounded temporaries on large tensors
        bits = ints[start : start + _CHUNK].to(torch.int64)
        pos = torch.arange(start, start + bits.numel(), device=x.device, dtype=torch.int64)
        weights = pos * 0x1E3779B97F4A7C15 + (pos >> 7) * 0x21C8864680B583EB + 1  # wraps in int64
        total += (bits * weights).sum()
    return int(total)


def record(t: torch.Tensor) -> Record:
    """The :class:`Record` of tensor ``t`` (moved to the CPU; of a DTensor, this rank's local tensor as it is)."""
    t = (t.to_local() if isinstance(t, DTensor) else t).detach().resolve_conj().resolve_neg()
    flat = values = t.reshape(-1)
    if sampled := flat.numel() > FULL_NUMEL:  # integer positions: a float linspace rounds past the end
        values = flat[torch.arange(SAMPLE_NUMEL, device=flat.device) * (flat.numel() - 1) // (SAMPLE_NUMEL - 1)]
    if values.is_complex():
        values = torch.view_as_real(values)
    nonfinite = int((~torch.isfinite(flat)).sum()) if flat.is_floating_point() else 0
    return Record(tuple(t.shape), str(t.dtype).replace("torch.", ""), fingerprint(t), values.cpu().clone(), sampled,
                  nonfinite)


def _add(records: dict, key: tuple, out: Any, per_output: bool = True) -> None:
    """Record an op's tensor outputs under ``key`` (``per_output``: :func:`output_key`), first occurrence only."""
    if key[2].startswith("_c10d_functional.") and "wait_tensor" not in key[2]:  # written by its wait_tensor
        return
    outs = [out] if isinstance(out, torch.Tensor) else out if isinstance(out, (tuple, list)) else []
    for i, t in enumerate(outs):
        k = output_key(key, i) if per_output else key
        if isinstance(t, torch.Tensor) and k not in records:
            records[k] = record(t)


def output_key(key: tuple, index: int) -> tuple:
    """The key of output ``index`` of a multi-output op: the op's own key for output 0,
    ``op[index]`` in place of the op name otherwise."""
    return key if index == 0 else (key[0], key[1], f"{key[2]}[{index}]", key[3])


def op_name(target: Any) -> str:
    """``aten.mm.default`` for an OpOverload, the name otherwise."""
    return str(target) if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target))


def assign_keys(gm: torch.fx.GraphModule) -> int:
    """Write each ``call_function`` node's key ``(phase, fqn, op, occurrence)`` into
    ``node.meta["numerics_key"]`` (on the graph as traced); returns the number of keyed nodes."""
    seen: dict[tuple, int] = defaultdict(int)
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        custom = node.meta.get("custom") or {}
        base = (custom.get(PHASE_KEY, ""), custom.get(MODULE_FQN_KEY, ""), op_name(node.target))
        node.meta[NUMERICS_KEY] = (*base, seen[base])
        seen[base] += 1
    return sum(seen.values())


def key_text(key: Any) -> str:
    """``backward layers.0.attention_norm aten.mul.Tensor #3`` for a key, the string itself otherwise."""
    if isinstance(key, tuple) and len(key) == 4:
        phase, fqn, op, occ = key
        return f"{phase or '-'} {fqn or '(no module)'} {op} #{occ}"
    return str(key)


class GraphRecorder(torch.fx.Interpreter):
    """Run a traced step graph node by node, recording the outputs of each keyed node (a region's
    getitem outputs under the key they carry) into ``records``, in execution order."""

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__(gm, garbage_collect_values=True)
        self.records: dict[Any, Record] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        if (key := n.meta.get(NUMERICS_KEY)) is not None:
            _add(self.records, key, out, per_output=n.target is not operator.getitem)
        return out


class EagerRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Record the ATen ops of an eager forward + backward with the keys of :func:`assign_keys` (backward:
    the forward op's FQN by ``seq_nr``). Set :attr:`phase` to ``"backward"`` before ``backward()``."""

    def __init__(self):
        super().__init__()
        self.records: dict[Any, Record] = {}
        self.phase = "forward"
        self._seen: dict[tuple, int] = defaultdict(int)
        self._fqn_of_seq: dict[int, str] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.phase == "forward":
            fqn = (fx_traceback.current_meta.get("custom") or {}).get(MODULE_FQN_KEY, "")
            self._fqn_of_seq.setdefault(torch._C._autograd._get_sequence_nr() - 1, fqn)
        else:
            node = torch._C._current_autograd_node()
            fqn = self._fqn_of_seq.get(node._sequence_nr(), "") if node is not None else ""
        base = (self.phase, fqn, op_name(func))
        _add(self.records, (*base, self._seen[base]), out)
        self._seen[base] += 1
        return out


@contextlib.contextmanager
def record_eager_forward(model: torch.nn.Module, recorder: EagerRecorder):
    """Module-FQN annotation (as tracing does) and ``recorder`` active around the forward."""
    with fx_traceback.preserve_node_meta(), annotate_module_fqns(model), recorder:
        yield


def add_step_outputs(records: dict, loss: torch.Tensor, named_grads: list[tuple[str, torch.Tensor | None]]) -> None:
    """Record ``loss`` and each ``grad:<fqn>`` (local shards under FSDP / TP, a partial one summed) into ``records``."""
    records["loss"] = record(loss.full_tensor() if isinstance(loss, DTensor) else loss)
    for name, g in named_grads:
        if g is not None:
            if any(p.is_partial() for p in getattr(g, "placements", ())):  # eager TP's unreduced gradient: its sum
                g = g.redistribute(placements=[Replicate() if p.is_partial() else p for p in g.placements])
            name = name.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", "")
            records[f"grad:{name}"] = record(g)


def save(folder: str, rank: int, records: dict, meta: dict) -> str:
    """Write ``records`` (in order) and ``meta`` to ``<folder>/rank<rank>.pt``; returns the path.
    Nothing is overwritten: an existing file is kept as ``rank<rank>.<N>.pt``."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"rank{rank}.pt")
    keep_previous(path)
    torch.save({"meta": meta, "keys": list(records), "records": [vars(r) for r in records.values()]}, path)
    return path


def load(path: str) -> tuple[dict[Any, Record], dict]:
    """Read a file written by :func:`save`: ``({key: Record} in execution order, meta)``. Raises ValueError: not a
    numerics record file."""
    try:
        data = torch.load(path, weights_only=False)
        recs = {k: Record(**r) for k, r in zip(data["keys"], data["records"])}
    except Exception as e:  # a truncated or foreign file
        raise ValueError(f"{path}: not a numerics record ({type(e).__name__}: {e})") from None
    return recs, data.get("meta", {})
