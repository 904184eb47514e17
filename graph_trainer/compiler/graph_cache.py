"""The graph cache (``--compile.graph_cache_dir``): the traced step after its passes, before Inductor.

The cache stores the graph after the passes up to the first one that compiles (torch's ``GraphPickler``) with the
remaining pipeline steps, the run's statistics and the passes' process setup, under a key of everything that decides
the graph (:func:`cache_key`); a later run with the same key loads it and runs only the remaining steps. When that is
``full_inductor`` alone, the entry holds Inductor's compiled step instead of the graph (``<key>.inductor`` beside it),
called directly; one that does not load makes the next run a cold one."""

import dataclasses
import hashlib
import importlib
import json
import operator
import os
import pickle
import time
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from graph_trainer import logger
from graph_trainer.compiler.node_meta import process_setup
from graph_trainer.compiler.registry import registry

FORMAT = 1
#: ``[section]`` or ``(section, field)`` of the config that do not change the graph.
_NOT_IN_KEY = {"job", "profiling", "metrics", "checkpoint", "validation", "fault_tolerance", "projection",
               "lr_scheduler", "optimizer", "memory_estimation",
               ("training", "steps"), ("training", "dataset"), ("training", "dataset_path"),
               ("training", "dataloader"), ("training", "gc_freq"), ("training", "gc_debug"),
               ("compile", "graph_cache_dir"), ("compile", "dump_graphs")}  # fmt: skip


def cache_dir(graph_cache_dir: str, inductor_compilation: str) -> str | None:
    """The folder ``--compile.graph_cache_dir`` names, or None when the cache is off ("off" or empty; "auto" unless
    ``inductor_compilation`` is "full"). "auto" with full Inductor: ``graph_trainer/`` in Inductor's cache folder."""
    if graph_cache_dir in ("", "off") or (graph_cache_dir == "auto" and inductor_compilation != "full"):
        return None
    if graph_cache_dir == "auto":
        from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

        return os.path.join(inductor_cache_dir(), "graph_trainer")
    return graph_cache_dir


def source_hash() -> str:
    """sha256 of every ``.py`` file of the graph_trainer package (path and contents)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def cache_key(cfg: Any, rank: int, world_size: int, device: torch.device) -> str:
    """The key of a run's graph, 24 hex digits: its config (less :data:`_NOT_IN_KEY`), rank, world size, device
    (type and name), torch and torchtitan versions, :func:`source_hash` and Inductor's and AOTAutograd's configs."""
    sections = {}
    for f in dataclasses.fields(cfg):
        if f.name in _NOT_IN_KEY:
            continue
        value = getattr(cfg, f.name)
        fields = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else {"": value}
        sections[f.name] = {k: v for k, v in fields.items() if (f.name, k) not in _NOT_IN_KEY}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    import torchtitan
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    compilers = {"inductor": inductor_config.save_config_portable(),
                 "functorch": functorch_config.save_config_portable()}
    material = json.dumps({"config": sections, "rank": rank, "world_size": world_size, "device": name,
                           "torch": torch.__version__, "torchtitan": getattr(torchtitan, "__version__", ""),
                           "source": source_hash(), "compilers": compilers, "format": FORMAT},
                          sort_keys=True, default=str)
    return hashlib.sha256(material.encode()).hexdigest()[:24]


def compile_index(steps: list) -> int:
    """Index of the first step the cache cannot hold: the first that compiles (``GraphPass.compiles``)."""
    return next((i for i, s in enumerate(steps) if registry()[s.name].compiles), len(steps))


_TARGET_KEY = "graph_cache_target"


def _own_targets_by_name(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, Any]:
    """Give each ``call_function`` node whose target is one of the package's own functions (``hold``; GraphPickler
    cannot name them) the stand-in ``operator.pos`` and its ``"module:qualname"`` in ``meta``; returns node -> old
    target (the caller puts them back)."""
    swapped = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "__module__", "").startswith("graph_trainer."):
            swapped[node] = node.target
            node.meta[_TARGET_KEY] = f"{node.target.__module__}:{node.target.__qualname__}"
            node.target = operator.pos
    return swapped


def _own_targets_back(gm: torch.fx.GraphModule) -> None:
    """Undo :func:`_own_targets_by_name` on a loaded graph (imports the named functions)."""
    for node in gm.graph.nodes:
        if _TARGET_KEY in node.meta:
            module, _, name = node.meta.pop(_TARGET_KEY).partition(":")
            node.target = getattr(importlib.import_module(module), name)


#: The remaining steps whose result the cache holds compiled, instead of the graph (:func:`save_compiled`).
COMPILED_STEPS = ["full_inductor"]


def stores_compiled(steps: list) -> bool:
    """Whether the entry for remaining ``steps`` holds their compiled step (:data:`COMPILED_STEPS`), not the graph."""
    return [s.name for s in steps] == COMPILED_STEPS


def save(path: Path, gm: torch.fx.GraphModule, param_names: list[str], buffer_names: list[str],
         steps: list, stats: dict[str, Any], graph: bool = True) -> bool:
    """Write one entry to ``path`` (atomically); False and a warning when it cannot be pickled or written.
    ``graph=False``: the entry holds no graph (``gm`` gives only its outputs and process setup), for a compiled step
    saved beside it (:func:`save_compiled`): pickling the graph took seconds of every cold start."""
    from torch.fx._graph_pickler import GraphPickler, Options

    t0 = time.perf_counter()
    swapped = _own_targets_by_name(gm) if graph else {}
    try:
        leaves, spec = pytree.tree_flatten(gm.graph.output_node().args[0])  # "outputs": spec, leaves that are no node
        consts = {i: v for i, v in enumerate(leaves) if not isinstance(v, torch.fx.Node)}
        entry = {"format": FORMAT, "gm": GraphPickler.dumps(gm, Options(ops_filter=None)) if graph else None,
                 "param_names": param_names, "buffer_names": buffer_names, "steps": steps, "stats": stats,
                 "outputs": (pytree.treespec_dumps(spec), consts), "setup": process_setup(gm)}
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
    logger.info(f"graph cache: saved {path} ({len(data) / 2**20:.1f} MiB) in {time.perf_counter() - t0:.1f}s")
    return True


def compiled_path(path: Path) -> Path:
    """Where the compiled step of the entry at ``path`` is stored (its constants: ``.constants`` beside it)."""
    return path.with_suffix(".inductor")


def recording():
    """Run the remaining steps under this to record their cache artifacts for :func:`save_compiled`."""
    from torch.compiler._cache import CacheArtifactManager

    return CacheArtifactManager.with_fresh_cache()


def save_compiled(path: Path, gm: Any, steps: list) -> bool:
    """After ``steps`` (:data:`COMPILED_STEPS`) ran under :func:`recording` and gave ``gm``, write its
    ``compiled_fn`` to :func:`compiled_path` and its ``compiled_constants`` beside it. Returns whether it was
    written; a failure is a warning."""
    if not stores_compiled(steps) or not hasattr(gm, "compiled_constants"):
        return False
    try:
        artifacts = torch.compiler.save_cache_artifacts()
        if artifacts is None or len(artifacts[1].aot_autograd_artifacts) != 1:
            raise ValueError(f"{0 if artifacts is None else len(artifacts[1].aot_autograd_artifacts)} "
                             "AOTAutograd cache entries recorded, expected 1")
        module = importlib.import_module("torch._inductor.standalone_compile")  # the package's name is the function
        artifact_cls = getattr(module, "CacheCompiledArtifact", module.CompiledArtifact)  # torch >= 2.12: split
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(gm.compiled_constants, compiled_path(path).with_suffix(".constants"))
        artifact_cls(gm.compiled_fn, artifacts).save(path=str(compiled_path(path)), format="binary")
    except Exception as e:  # noqa: BLE001 - a cache must not stop the run
        logger.warning(f"graph cache: compiled step not saved ({type(e).__name__}: {e})")
        return False
    out = compiled_path(path)
    logger.info(f"graph cache: saved the compiled step {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    return True


class CompiledStep:
    """A compiled step loaded by :func:`load`, called and returning like the graph it was compiled from.
    ``constants``: the graph's own tensors, which the compiled code takes before the inputs."""

    def __init__(self, artifact, constants: list[torch.Tensor], outputs: tuple[str, dict[int, Any]]):
        self.artifact, self.constants = artifact, constants
        self.spec, self.consts = pytree.treespec_loads(outputs[0]), outputs[1]

    def __call__(self, *args):
        out = iter(self.artifact(*self.constants, *args))
        return pytree.tree_unflatten([self.consts[i] if i in self.consts else next(out)
                                      for i in range(self.spec.num_leaves)], self.spec)


def _load_compiled(path: Path, entry: dict[str, Any]) -> CompiledStep | None:
    """The entry's compiled step (:func:`save_compiled`), or None (none stored, or a warning: it failed to load)."""
    constants = compiled_path(path).with_suffix(".constants")
    if not stores_compiled(entry["steps"]) or "outputs" not in entry \
            or not compiled_path(path).is_file() or not constants.is_file():
        return None
    try:
        from torch._inductor import CompiledArtifact

        return CompiledStep(CompiledArtifact.load(path=str(compiled_path(path)), format="binary"),
                            torch.load(constants, weights_only=True), entry["outputs"])
    except Exception as e:  # noqa: BLE001
        logger.warning(f"graph cache: compiled step {compiled_path(path)} not used ({type(e).__name__}: {e})")
        return None


def load(path: Path) -> dict[str, Any] | None:
    """The entry at ``path``, or None (no file, or a warning: unreadable, its process setup raised, or it holds only a
    compiled step that does not load). The setup is called first. With a compiled step stored ``entry["compiled"]``
    is that :class:`CompiledStep` and ``gm`` None; otherwise ``gm`` is unpickled into a new fake mode with a shape env
    (else Inductor bypasses its cache)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    if not path.is_file():
        return None
    try:
        entry = pickle.loads(path.read_bytes())
        if entry.get("format") != FORMAT:
            raise ValueError(f"format {entry.get('format')}, expected {FORMAT}")
        for setup in entry.get("setup", []):
            setup()
        if (compiled := _load_compiled(path, entry)) is not None:
            entry.update(compiled=compiled, gm=None)
            return entry
        if entry["gm"] is None:
            raise ValueError("it holds no graph and its compiled step is not usable")
        entry["gm"] = GraphPickler.loads(entry["gm"], FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv()))
        _own_targets_back(entry["gm"])
        entry["gm"].recompile()
    except Exception as e:  # noqa: BLE001
        logger.warning(f"graph cache: {path} not used ({type(e).__name__}: {e})")
        return None
    return entry
