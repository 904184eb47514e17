"""What each pass of the pipeline did, in numbers (:func:`pass_record` from the :class:`GraphSnapshot` s before and
after it; :func:`format_pass_table`) and text (readable dumps, structured-trace artifacts)."""

import json
import operator
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._logging._internal import trace_log

from graph_trainer import logger
from graph_trainer.compiler.collectives import collective_kind, is_wait
from graph_trainer.compiler.memory_estimate import estimate_peak_memory
from graph_trainer.compiler.node_meta import inductor_tag, is_tagged_for_inductor
from graph_trainer.compiler.ops import fx_graph, op_namespace, packet_name, target_name

NODE_KINDS: tuple[str, ...] = ("compute", "collective", "wait", "view", "getitem", "region", "other")

#: aten view / reshape / alias op packets.
VIEW_OP_NAMES: frozenset[str] = frozenset({"view", "reshape", "alias", "expand", "permute", "transpose", "t",
                                           "slice", "select", "squeeze", "unsqueeze", "_unsafe_view", "as_strided"})

REGION_SUBMOD_PREFIX = "__marked_inductor_submod"


def is_region_call(node: torch.fx.Node) -> bool:
    """Whether ``node`` calls a scooped Inductor region module or the compiled callable that replaced it."""
    if node.op == "call_module":
        return str(node.target).startswith(REGION_SUBMOD_PREFIX)
    if node.op != "call_function" or isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return False
    return (getattr(node.target, "__module__", None) or "").startswith("torch._inductor")


def node_kind(node: torch.fx.Node) -> str:
    """The kind of ``node``, one of :data:`NODE_KINDS`, by the first rule that holds: placeholders, output and
    ``get_attr`` are ``other``; ``region``: tagged for Inductor or a region call; ``getitem``; ``collective`` (an
    issue op); ``wait``; ``view`` (:data:`VIEW_OP_NAMES`); ``compute`` (any other torch op); else ``other``."""
    if node.op in ("placeholder", "output", "get_attr"):
        return "other"
    if is_tagged_for_inductor(node) or is_region_call(node):
        return "region"
    if node.op != "call_function":
        return "other"
    if node.target is operator.getitem:
        return "getitem"
    if collective_kind(node) is not None:
        return "collective"
    if is_wait(node):
        return "wait"
    if op_namespace(node.target) == "aten" and packet_name(node) in VIEW_OP_NAMES:
        return "view"
    if isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)):
        return "compute"
    return "other"


def kind_counts(gm: Any) -> dict[str, int] | None:
    """``{kind: nodes}`` for every kind of :data:`NODE_KINDS` plus ``"total"``; None without an FX graph."""
    if (graph := fx_graph(gm)) is None:
        return None
    counts = Counter(node_kind(n) for n in graph.nodes)
    return {**{k: counts.get(k, 0) for k in NODE_KINDS}, "total": len(graph.nodes)}


def call_targets(gm: Any) -> Counter:
    """Counter of the ``target_name`` of ``gm``'s ``call_function`` nodes (empty without an FX graph)."""
    graph = fx_graph(gm)
    return Counter(target_name(n) for n in graph.nodes if n.op == "call_function") if graph else Counter()


def count_regions(gm: Any) -> int | None:
    """Number of Inductor regions of ``gm``: distinct ``inductor_region`` ids of the tagged nodes
    (those without an id count as one) plus one per region call; None without an FX graph."""
    if (graph := fx_graph(gm)) is None:
        return None
    regions: set[Any] = set()
    for n in graph.nodes:
        if is_region_call(n):
            regions.add(("call", n.name))
            continue
        tag = inductor_tag(n)
        if tag is None or n.op in ("placeholder", "output"):
            continue
        if n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node) and is_region_call(n.args[0]):
            continue  # a region call's output
        regions.add(("id", repr(tag.get("inductor_region")) if isinstance(tag, dict) else None))
    return len(regions)


def peak_memory_bytes(gm: Any) -> int | None:
    """``estimate_peak_memory`` of ``gm`` in bytes; None without an FX graph, fake values, or when it fails."""
    if (graph := fx_graph(gm)) is None or not any("val" in n.meta for n in graph.nodes if n.op != "placeholder"):
        return None
    try:
        return int(estimate_peak_memory(gm)[0])
    except Exception:
        return None


@dataclass
class GraphSnapshot:
    """The numbers of one graph state (``memory_bytes`` None when not taken)."""

    kinds: dict[str, int] | None
    targets: Counter = field(default_factory=Counter)
    regions: int | None = None
    memory_bytes: int | None = None


def snapshot(gm: Any, *, memory: bool = True) -> GraphSnapshot:
    """A :class:`GraphSnapshot` of ``gm``; ``memory=False`` skips the memory estimate."""
    peak = peak_memory_bytes(gm) if memory else None
    return GraphSnapshot(kind_counts(gm), call_targets(gm), count_regions(gm), peak)


def jsonable(obj: Any) -> Any:
    """``obj`` if ``json.dumps`` takes it, else converted item by item (keys to ``str``, other values to ``repr``)."""
    try:
        json.dumps(obj)
        return obj
    except (TypeError, ValueError):
        if isinstance(obj, dict):
            return {str(k): jsonable(v) for k, v in obj.items()}
        return [jsonable(v) for v in obj] if isinstance(obj, (list, tuple)) else repr(obj)


def pass_record(index: int, name: str, time_s: float, before: GraphSnapshot, after: GraphSnapshot, summary: str = "",
                stats: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON-able record of one pass from the snapshots of its input and output: ``index`` (1-based), ``pass``,
    ``time_s``, ``nodes_*``, ``kinds_*``, ``ops_added`` / ``ops_removed`` (``{op name: count}``), ``regions_*``,
    ``memory_*_bytes`` (static peak), ``summary`` and ``stats``; counts are None for a graph that is not FX."""
    return {
        "index": index, "pass": name, "time_s": round(time_s, 4),
        "nodes_before": before.kinds["total"] if before.kinds else None,
        "nodes_after": after.kinds["total"] if after.kinds else None,
        "kinds_before": before.kinds, "kinds_after": after.kinds,
        "ops_added": dict(sorted((after.targets - before.targets).items())),
        "ops_removed": dict(sorted((before.targets - after.targets).items())),
        "regions_before": before.regions, "regions_after": after.regions,
        "memory_before_bytes": before.memory_bytes, "memory_after_bytes": after.memory_bytes,
        "summary": summary, "stats": jsonable(stats or {}),
    }


def _count_cell(before: float | None, after: float | None, fmt: str = "{:g}") -> str:
    if after is None:
        return "n/a"
    cell = fmt.format(after)
    if before is not None and after != before:
        cell += " (" + ("+" if after > before else "-") + fmt.format(abs(after - before)) + ")"
    return cell


def _ops_cell(record: dict[str, Any], limit: int = 3) -> str:
    changes = sorted([(-n, f"+{n} {op}") for op, n in record.get("ops_added", {}).items()]
                     + [(-n, f"-{n} {op}") for op, n in record.get("ops_removed", {}).items()])
    cell = ", ".join(text for _, text in changes[:limit])
    return cell + (f", ... ({len(changes) - limit} more)" if len(changes) > limit else "")


def format_pass_table(records: Iterable[dict[str, Any]]) -> str:
    """A fixed-width markdown table of :func:`pass_record` s: a row ``(input)``, then one per pass with time (s),
    nodes (total and per kind, with changes), regions, peak MiB and the largest op changes; ``""`` for none."""
    records = list(records)
    if not records:
        return ""
    header = ["#", "pass", "time_s", "nodes", *NODE_KINDS, "regions", "peak_MiB", "ops (+added -removed)"]

    def mem(b):
        return None if b is None else b / 2.0**20

    first = records[0]
    graph_in = {"index": 0, "pass": "(input)", "nodes_after": first.get("nodes_before"),
                "kinds_after": first.get("kinds_before"), "regions_after": first.get("regions_before"),
                "memory_after_bytes": first.get("memory_before_bytes")}
    rows = []
    for r in [graph_in, *records]:
        kb, ka = r.get("kinds_before") or {}, r.get("kinds_after") or {}
        rows.append([
            str(r["index"]), r["pass"], f"{r['time_s']:.3f}" if "time_s" in r else "",
            _count_cell(r.get("nodes_before"), r.get("nodes_after")),
            *[_count_cell(kb.get(k), ka.get(k)) for k in NODE_KINDS],
            _count_cell(r.get("regions_before"), r.get("regions_after")),
            _count_cell(mem(r.get("memory_before_bytes")), mem(r.get("memory_after_bytes")), "{:.1f}"),
            _ops_cell(r),
        ])
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    left = {1, len(header) - 1}  # pass names and op changes left-aligned, numbers right-aligned

    def line(cells):
        return "| " + " | ".join(c.ljust(w) if i in left else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *(line(r) for r in rows)])


def readable_graph(gm: Any) -> str:
    """``gm.print_readable`` with every node's full ``meta["custom"]``; never raises (gives the reason)."""
    if not isinstance(gm, torch.fx.GraphModule):
        return f"# not an FX GraphModule: {type(gm).__qualname__}\n# {gm!r}\n"
    try:
        try:
            return gm.print_readable(print_output=False, additional_meta=["custom"])
        except TypeError:  # a torch without additional_meta: annotations as torch cuts them
            return gm.print_readable(print_output=False)
    except Exception as e:  # compiled callables that do not print
        try:
            return f"# print_readable failed: {e!r}\n{gm.code}"
        except Exception as e2:
            return f"# print_readable failed: {e!r}; gm.code failed: {e2!r}\n# {gm!r}\n"


def trace_enabled() -> bool:
    """Whether torch's structured trace has a handler (``TORCH_TRACE`` set when torch was imported)."""
    return any(getattr(h, "root_dir", "") is not None for h in trace_log.handlers)


def trace_artifact(name: str, payload_fn: Callable[[], Any], encoding: str = "string") -> None:
    """Emit an ``artifact`` record ``name`` into torch's structured trace; ``payload_fn`` (called only when the trace
    is on) returns text (``encoding="string"``) or a JSON-able object (``"json"``). Never raises (logs a warning)."""
    try:
        torch._logging.trace_structured("artifact", metadata_fn=lambda: {"name": name, "encoding": encoding},
                                        payload_fn=payload_fn, expect_trace_id=False)
    except Exception as e:
        logger.warning("structured trace artifact %s not written: %r", name, e)
