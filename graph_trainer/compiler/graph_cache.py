"""The graph cache (``--compile.graph_cache_dir``): the traced step after its passes, before Inductor.

A run traces the step, plans the memory levers and runs the passes up to the first one that
compiles (``regional_inductor``, ``full_inductor`` or ``cudagraph``); the cache stores that
graph (torch's ``GraphPickler``: nodes, ``meta`` with fake tensors and the region tags) with the
remaining pipeline steps and the run's statistics, under a key of everything that decides the
graph (:func:`cache_key`). A later run with the same key loads it and runs only the remaining
steps, so the first step costs the imports and the compile (with a warm Inductor cache, a
load). Numerics: the loaded graph is the graph the cold run compiled.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pickle
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("graph_trainer")

FORMAT = 1
#: ``[section]`` or ``(section, field)`` of the config that do not change the graph.
_NOT_IN_KEY = {"job", "profiling", "metrics", "checkpoint", "validation", "fault_tolerance", "projection",
               "lr_scheduler", "optimizer", "memory_estimation",
               ("training", "steps"), ("training", "dataset"), ("training", "dataset_path"),
               ("training", "dataloader"), ("training", "gc_freq"), ("training", "gc_debug"),
               ("compile", "graph_cache_dir"), ("compile", "dump_graphs")}  # fmt: skip


def source_hash() -> str:
    """sha256 of every ``.py`` file of the graph_trainer package (path and contents)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def cache_key(cfg: Any, rank: int, world_size: int, device: torch.device) -> str:
    """The key of a run's graph: its config (less :data:`_NOT_IN_KEY`), rank, world size, device
    (type and name), torch and torchtitan versions and :func:`source_hash`. 24 hex digits."""
    sections = {}
    for f in dataclasses.fields(cfg):
        if f.name in _NOT_IN_KEY:
            continue
        value = getattr(cfg, f.name)
        fields = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else {"": value}
        sections[f.name] = {k: v for k, v in fields.items() if (f.name, k) not in _NOT_IN_KEY}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    try:
        import torchtitan

        titan = getattr(torchtitan, "__version__", "")
    except ImportError:
        titan = ""
    material = json.dumps({"config": sections, "rank": rank, "world_size": world_size, "device": name,
                           "torch": torch.__version__, "torchtitan": titan, "source": source_hash(),
                           "format": FORMAT}, sort_keys=True, default=str)
    return hashlib.sha256(material.encode()).hexdigest()[:24]


def compile_index(steps: list) -> int:
    """Index of the first step the cache cannot hold: the first that compiles (``GraphPass.compiles``:
    ``regional_inductor``, ``full_inductor``, ``cudagraph``)."""
    from graph_trainer.compiler.registry import registry

    return next((i for i, s in enumerate(steps) if registry()[s.name].compiles), len(steps))


_TARGET_KEY = "graph_cache_target"


def _own_targets_by_name(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, Any]:
    """GraphPickler names only torch's, ``operator``'s, ``math``'s and builtin targets: give each
    ``call_function`` node whose target is one of the package's own functions (``hold``) the
    stand-in ``operator.pos`` and its real ``"module:qualname"`` in ``meta``; returns node -> old
    target (the caller puts them back)."""
    import operator

    swapped = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "__module__", "").startswith("graph_trainer."):
            swapped[node] = node.target
            node.meta[_TARGET_KEY] = f"{node.target.__module__}:{node.target.__qualname__}"
            node.target = operator.pos
    return swapped


def _own_targets_back(gm: torch.fx.GraphModule) -> None:
    """Undo :func:`_own_targets_by_name` on a loaded graph (imports the named functions)."""
    import importlib

    for node in gm.graph.nodes:
        if _TARGET_KEY in node.meta:
            module, _, name = node.meta.pop(_TARGET_KEY).partition(":")
            node.target = getattr(importlib.import_module(module), name)


def save(path: Path, gm: torch.fx.GraphModule, param_names: list[str], buffer_names: list[str],
         steps: list, stats: dict[str, Any]) -> bool:
    """Write one entry to ``path`` (a temporary file, then renamed). Returns False and logs a
    warning when the graph or the steps cannot be pickled or the folder not written (the run
    goes on uncached)."""
    from torch.fx._graph_pickler import GraphPickler, Options

    swapped = _own_targets_by_name(gm)
    try:
        entry = {"format": FORMAT, "gm": GraphPickler.dumps(gm, Options(ops_filter=None)),
                 "param_names": param_names, "buffer_names": buffer_names, "steps": steps, "stats": stats}
        data = pickle.dumps(entry, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 - a cache must not stop the run
        logger.warning(f"graph cache: not saved ({type(e).__name__}: {e})")
        return False
    finally:
        for node, target in swapped.items():
            node.target = target
            del node.meta[_TARGET_KEY]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as e:
        logger.warning(f"graph cache: not saved in {path.parent} ({e.strerror or e})")
        return False
    logger.info(f"graph cache: saved {path} ({len(data) / 2**20:.1f} MiB)")
    return True


def load(path: Path) -> dict[str, Any] | None:
    """The entry at ``path`` with ``gm`` unpickled into a new fake mode, or None (no file, or an
    unreadable one: a warning). The fake mode has a shape env: without one Inductor bypasses its
    FX graph cache ("No shape env") and a warm restart compiles again."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    if not path.is_file():
        return None
    try:
        entry = pickle.loads(path.read_bytes())
        if entry.get("format") != FORMAT:
            raise ValueError(f"format {entry.get('format')}, expected {FORMAT}")
        entry["gm"] = GraphPickler.loads(entry["gm"], FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv()))
        _own_targets_back(entry["gm"])
        entry["gm"].recompile()
    except Exception as e:  # noqa: BLE001
        logger.warning(f"graph cache: {path} not used ({type(e).__name__}: {e})")
        return None
    return entry
