"""Node and graph metadata the passes read and write: pass summaries, per-process setup, phase, module FQN,
Inductor region tags, fusion groups and selective AC's recompute tags."""

import json
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from graph_trainer import COMPILE_WITH_INDUCTOR_KEY, MODULE_FQN_KEY, PHASE_KEY

SUMMARY_KEY = "graph_trainer_pass_summary"
STATS_KEY = "graph_trainer_pass_stats"
SETUP_KEY = "graph_trainer_process_setup"
#: ``node.meta["custom"]`` key of a fusion group: ``full_inductor`` fuses a node only with nodes of its group.
FUSION_GROUP_KEY = "inductor_fusion_group"
#: Node meta key Inductor's lowering reads to round a low-precision op's result as eager does.
BARRIER_KEY = "low_precision_pointwise_barrier"


def _meta(gm: Any) -> dict:
    """``gm.meta``, made a dict first where it is not one."""
    if not isinstance(getattr(gm, "meta", None), dict):
        gm.meta = {}
    return gm.meta


def set_pass_summary(gm: torch.nn.Module, summary: str, **stats: Any) -> None:
    """Record what a pass did on ``gm.meta``: ``summary`` (one short line) and numeric ``stats``."""
    _meta(gm).update({SUMMARY_KEY: summary, STATS_KEY: dict(stats)})


def pop_pass_summary(gm: Any) -> tuple[str, dict[str, Any]]:
    """Return and clear the summary/stats a pass left on ``gm`` ("" / {} if none)."""
    meta = getattr(gm, "meta", None)
    return (meta.pop(SUMMARY_KEY, ""), meta.pop(STATS_KEY, {})) if isinstance(meta, dict) else ("", {})


def add_process_setup(gm: torch.nn.Module, fn: Callable[[], Any]) -> None:
    """Record on ``gm.meta`` work every process must do before it runs ``gm`` (``async_tp``: symmetric memory),
    which the graph cache stores and calls on load. ``fn`` takes no argument and must pickle (a
    ``functools.partial`` of a module-level function and plain values)."""
    _meta(gm).setdefault(SETUP_KEY, []).append(fn)


def process_setup(gm: Any) -> list[Callable[[], Any]]:
    """The setup functions recorded on ``gm`` by :func:`add_process_setup`, in order ([] if none)."""
    meta = getattr(gm, "meta", None)
    return list(meta.get(SETUP_KEY, [])) if isinstance(meta, dict) else []


def custom_meta(node: torch.fx.Node) -> dict[str, Any]:
    """``node.meta["custom"]`` or ``{}`` (never None)."""
    custom = node.meta.get("custom")
    return custom if isinstance(custom, dict) else {}


def phase_of(node: torch.fx.Node) -> str | None:
    """The trace-time phase of ``node`` (``"forward"`` / ``"backward"``), or None."""
    return custom_meta(node).get(PHASE_KEY)


def module_fqn_of(node: torch.fx.Node) -> str | None:
    """The FQN of the innermost module that ran ``node`` (backward nodes: their forward op's), or None."""
    return custom_meta(node).get(MODULE_FQN_KEY)


def is_tagged_for_inductor(node: torch.fx.Node) -> bool:
    """Whether ``node`` carries a ``compile_with_inductor`` tag (regional_inductor compiles it)."""
    return COMPILE_WITH_INDUCTOR_KEY in custom_meta(node)


def inductor_tag(node: torch.fx.Node) -> Any:
    """``node``'s ``compile_with_inductor`` tag (a dict from :func:`tag_for_inductor`), or None."""
    return custom_meta(node).get(COMPILE_WITH_INDUCTOR_KEY)


def region_of(node: torch.fx.Node) -> Any:
    """The ``inductor_region`` id of ``node``'s ``compile_with_inductor`` tag, or None."""
    return (inductor_tag(node) or {}).get("inductor_region")


def fusion_group_of(node: torch.fx.Node) -> str | None:
    """The fusion group of ``node`` (:data:`FUSION_GROUP_KEY`), or None."""
    return custom_meta(node).get(FUSION_GROUP_KEY)


def tag_fusion_group(node: torch.fx.Node, group: str) -> None:
    """Put ``node`` into fusion group ``group``, keeping its other ``custom`` entries."""
    node.meta["custom"] = {**custom_meta(node), FUSION_GROUP_KEY: group}


def tag_for_inductor(node: torch.fx.Node, inductor_configs: dict[str, Any], region: str,
                     candidate_configs: list[dict[str, Any]] | None = None) -> None:
    """Tag ``node`` for region ``region`` of regional_inductor (``candidate_configs``: also timed)."""
    tag: dict[str, Any] = {"inductor_configs": dict(inductor_configs), "inductor_region": region}
    if candidate_configs:
        tag["candidate_inductor_configs"] = [dict(c) for c in candidate_configs]
    node.meta["custom"] = {**custom_meta(node), COMPILE_WITH_INDUCTOR_KEY: tag}


def is_tagged_recompute(node: torch.fx.Node) -> bool:
    """Whether ``node`` carries selective AC's ``PREFER/MUST_RECOMPUTE`` tag (``meta["recompute"]``)."""
    return node.meta.get("recompute") in (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE)


def strip_recompute_tags(graph: torch.fx.Graph) -> int:
    """Delete selective AC's recompute tags (else ``compile_fx`` recomputes again); returns how many."""
    n = 0
    for node in graph.nodes:
        n += node.meta.pop("recompute", None) is not None
        node.meta.pop("ac_graph_id", None)
    return n


def json_object(value: Any, flag: str) -> dict[str, Any]:
    """``value`` (JSON object text, a dict, or empty) as a dict; ``ValueError`` naming ``flag`` otherwise."""
    if isinstance(value, dict):
        return dict(value)
    if not value or not str(value).strip():
        return {}
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} must be a JSON object, e.g. '{{\"coordinate_descent_tuning\": true}}'; "
                         f"got {value!r} ({e})") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{flag} must be a JSON object, got {value!r}")
    return parsed
