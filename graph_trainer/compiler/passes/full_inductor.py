"""Compile the whole training-step graph with Inductor (no annotation needed).

Removes the ``hold`` nodes and selective AC's recompute tags, moves one-element CPU tensors to the accelerator
(:func:`move_cpu_scalars`) and compiles a flat copy with ``compile_fx`` under the graph's fake mode, each fusion
group fused only within itself (:func:`fusion_group_guard`). The result is called like the input; the compiled
callable is ``gm.compiled_fn``, the tensors it holds as graph constants ``gm.compiled_constants``."""

import contextlib
import hashlib
import operator
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from graph_trainer.compiler.collectives import collective_kind, strip_holds
from graph_trainer.compiler.graph_values import accelerator_of, detect_graph_fake_mode, fake_inputs_for
from graph_trainer.compiler.node_meta import fusion_group_of, json_object, set_pass_summary, strip_recompute_tags
from graph_trainer.compiler.registry import GraphPass

#: Inductor's own phase timers (``torch._dynamo.utils.compilation_time_metrics``, filled by ``dynamo_timed``) that
#: :func:`inductor_phases` reports, by a short name.
INDUCTOR_PHASES = {"AOT metadata": "aot_collect_metadata", "joint-graph passes": "_recursive_joint_graph_passes",
                   "post-grad passes": "_recursive_post_grad_passes", "lowering": "GraphLowering.run",
                   "fusion": "Scheduler.__init__", "codegen": "Scheduler.codegen",
                   "kernel compile wait": "async_compile.wait", "module load": "PyCodeCache.load_by_key_path"}


@contextlib.contextmanager
def inductor_phases():
    """Time Inductor's phases of the compiles run under this: yields a dict, filled on exit with seconds (float) per
    phase of :data:`INDUCTOR_PHASES` that ran (nothing on a cache hit). The timers are torch's, read before and
    after, so compiles outside the block do not count."""
    from torch._dynamo.utils import compilation_time_metrics as metrics

    before = {name: len(metrics.get(key, ())) for name, key in INDUCTOR_PHASES.items()}
    phases: dict[str, float] = {}
    try:
        yield phases
    finally:
        for name, key in INDUCTOR_PHASES.items():
            if spent := sum(metrics.get(key, [])[before[name]:]):
                phases[name] = round(spent, 2)


def move_cpu_scalars(gm: torch.fx.GraphModule, device: torch.device | None) -> int:
    """Put the graph's one-element CPU tensors (constants, ``device=cpu`` factory calls and copies of those) on
    ``device`` (Inductor would copy them to the device on every call); nothing for ``device`` None or CPU. Returns
    the number of constants and calls moved."""
    if device is None or device.type == "cpu":
        return 0
    moved: set[torch.fx.Node] = set()
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if not (isinstance(val, torch.Tensor) and val.device.type == "cpu" and val.numel() == 1):
            continue
        if n.op == "get_attr":
            owner, _, name = n.target.rpartition(".")
            mod = gm.get_submodule(owner) if owner else gm
            setattr(mod, name, getattr(mod, name).to(device))
        elif n.op == "call_function" and n.kwargs.get("device") is not None:
            n.kwargs = {**n.kwargs, "device": device}
        elif not (n.op == "call_function" and n.all_input_nodes and set(n.all_input_nodes) <= moved):
            continue
        n.meta["val"] = val.to(device)
        moved.add(n)
    if moved:
        gm.recompile()
    return len(moved)


def realize_group_boundaries(graph: torch.fx.Graph) -> int:
    """Realize every post-grad node read in another fusion group (``inductor_realize_to_strides``); returns how many."""
    marked = 0
    for n in graph.nodes:
        if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor) and any(
                u.op != "output" and fusion_group_of(u) != fusion_group_of(n) for u in n.users):
            n.meta["inductor_realize_to_strides"] = True
            marked += 1
    return marked


@contextlib.contextmanager
def fusion_group_guard(gm: torch.fx.GraphModule):
    """Compile under this to keep ``gm``'s fusion groups apart: two scheduler nodes fuse only when the FX nodes they
    were lowered from hold the same set of groups, and the values that cross a group's boundary are realized
    (:func:`realize_group_boundaries` as ``post_grad_custom_pre_pass``, whose ``uuid`` puts the groups into the
    cache key). Yields ``(config patches, counts)``; ``counts["refused"]`` (fusions refused) and ``["realized"]``
    are filled while compiling, 0 on a cache hit."""
    from torch._inductor.custom_graph_pass import CustomGraphPass
    from torch._inductor.virtualized import V

    groups = sorted((n.name, g) for n in gm.graph.nodes if (g := fusion_group_of(n)))
    counts = {"groups": len({g for _, g in groups}), "refused": 0, "realized": 0}
    if not groups:
        yield {}, counts
        return

    def tags(snode) -> set[str]:
        origins = (o for s in snode.get_nodes() for o in getattr(getattr(s, "node", None), "origins", None) or ())
        return {g for o in origins if (g := fusion_group_of(o))}

    base = type(V.choices)

    class Choices(base):  # type: ignore[misc, valid-type]
        def can_fuse(self, scheduler, node1, node2, shared_data_score):
            if not base.can_fuse(scheduler, node1, node2, shared_data_score):
                return False
            if tags(node1) != tags(node2):
                counts["refused"] += 1  # a fusion Inductor's heuristics would have allowed
                return False
            return True

    class GroupsKey(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            counts["realized"] = realize_group_boundaries(graph)

        def uuid(self) -> bytes:
            return hashlib.sha256(repr(groups).encode() + b"realize_group_boundaries.v1").digest()

    with V.set_choices_handler(Choices()):
        yield {"post_grad_custom_pre_pass": GroupsKey()}, counts


def full_inductor_pass(gm: torch.fx.GraphModule, example_inputs=None, inductor_configs: dict[str, Any] | None = None,
                       pin_collectives: bool = False) -> torch.fx.GraphModule:
    """Compile all of ``gm`` with Inductor; return a GraphModule called like ``gm``. ``inductor_configs``:
    ``torch._inductor.config`` overrides (unknown keys raise ``AttributeError``); ``pin_collectives``: keep each
    collective's issue / wait between the same two matmuls (:mod:`graph_trainer.compiler.pin_collectives`). Stats:
    ``compile_s``, ``inductor_phases_s`` (:func:`inductor_phases`), ``nodes_compiled``, ``fusion_groups``,
    ``fusions_refused``, ``boundary_values_realized``."""
    from torch._inductor.compile_fx import compile_fx

    from graph_trainer.compiler.pin_collectives import PinCollectivesPass

    strip_holds(gm)
    moved = move_cpu_scalars(gm, accelerator_of(gm, example_inputs))
    strip_recompute_tags(gm.graph)
    fake_inputs = fake_inputs_for(gm, example_inputs)
    fake_mode = detect_graph_fake_mode(gm, example_inputs)

    flat_graph = torch.fx.Graph()  # flat inputs, a tuple of the output's node leaves
    out_leaves, out_spec = pytree.tree_flatten(flat_graph.graph_copy(gm.graph, {}))
    flat_graph.output(tuple(leaf for leaf in out_leaves if isinstance(leaf, torch.fx.Node)))
    flat_gm = torch.fx.GraphModule(gm, flat_graph)

    patches = dict(inductor_configs or {})
    pin_collectives = pin_collectives and any(collective_kind(n) for n in gm.graph.nodes)
    if pin_collectives:
        patches["post_grad_custom_post_pass"] = PinCollectivesPass()
        # for inference graphs (the traced step) reorder_for_locality moves each wait to its first user
        patches.setdefault("reorder_for_locality", False)
    t0 = time.perf_counter()
    tracing = contextlib.nullcontext() if fake_mode is None else torch._guards.tracing(
        torch._guards.TracingContext(fake_mode))
    with fusion_group_guard(gm) as (group_patches, groups), tracing, inductor_phases() as phases, \
            torch._inductor.config.patch({**patches, **group_patches}):
        compiled = compile_fx(flat_gm, fake_inputs)
    compile_s = time.perf_counter() - t0

    def inductor_compiled_graph(*args):
        return compiled(*args)

    # wrapper: gm's placeholders and codegen, one call, one getitem per output node
    graph = torch.fx.Graph()
    placeholders = [graph.node_copy(node) for node in gm.graph.find_nodes(op="placeholder")]
    call = graph.call_function(inductor_compiled_graph, tuple(placeholders))
    node_leaves = [leaf for leaf in out_leaves if isinstance(leaf, torch.fx.Node)]
    call.meta["val"] = tuple(leaf.meta.get("val") for leaf in node_leaves)
    items = {}
    for i, leaf in enumerate(node_leaves):
        items[leaf] = graph.call_function(operator.getitem, (call, i))
        items[leaf].meta = {k: v for k, v in leaf.meta.items() if k in ("val", "tensor_meta", "custom")}
    new_leaves = [items[leaf] if isinstance(leaf, torch.fx.Node) else leaf for leaf in out_leaves]
    graph.output(pytree.tree_unflatten(new_leaves, out_spec))
    graph._codegen = gm.graph._codegen
    new_gm = torch.fx.GraphModule(torch.nn.Module(), graph, class_name="InductorCompiledGraph")
    new_gm.meta.update(gm.meta)
    new_gm.compiled_fn = compiled
    # the module's tensors AOTAutograd passes before the inputs (parameters, then buffers)
    new_gm.compiled_constants = [*dict(flat_gm.named_parameters(remove_duplicate=False)).values(),
                                 *dict(flat_gm.named_buffers(remove_duplicate=False)).values()]
    set_pass_summary(
        new_gm, f"compiled the whole graph ({len(gm.graph.nodes)} nodes) with Inductor in {compile_s:.1f}s"
        + (f" ({', '.join(f'{k} {v:.1f}s' for k, v in phases.items())})" if phases else "")
        + (" (collective schedule pinned)" if pin_collectives else "")
        + (f"; {moved} CPU scalar(s) moved to the device" if moved else "")
        + (f"; {groups['groups']} fusion groups kept apart ({groups['refused']} fusions refused, "
           f"{groups['realized']} boundary values realized)" if groups["groups"] else "")
        + (f"; configs {sorted(inductor_configs)}" if inductor_configs else ""),
        compile_s=round(compile_s, 3), inductor_phases_s=phases, nodes_compiled=len(gm.graph.nodes),
        fusion_groups=groups["groups"], fusions_refused=groups["refused"], boundary_values_realized=groups["realized"])
    return new_gm


@dataclass
class FullInductorOptions:
    """``[compile.full_inductor]``: options of ``full_inductor`` (``--compile.inductor_compilation full``)."""

    configs: str = ""
    """``torch._inductor.config`` overrides for the whole-graph compile: JSON on the CLI, a table in TOML, dotted
    keys, e.g. ``{"aten_distributed_optimizations.enable_overlap_scheduling": true}``."""

    pin_collectives: bool = True
    """Keep overlap_collectives' placement of every collective and wait (under the same matmuls) inside Inductor's
    schedule (graph_trainer/compiler/pin_collectives.py). Without it Inductor's peak-memory reordering waits for
    each collective right after issuing it, so nothing overlaps."""

    def check(self) -> None:
        """Raises ValueError: configs is not a JSON object."""
        json_object(self.configs, "--compile.full_inductor.configs")


PASS = GraphPass(name="full_inductor", fn=full_inductor_pass, options=FullInductorOptions, compiles=True,
                 aliases=("full_inductor_compilation",),
                 enabled=lambda ctx: ctx.compile_cfg.inductor_compilation == "full",
                 kwargs=lambda o, ctx: {"inductor_configs": json_object(o.configs, "--compile.full_inductor.configs")
                                        or None, "pin_collectives": o.pin_collectives})
