"""Compile the whole training-step graph with Inductor.

Matches: the entire graph (every node; no annotation needed).

Changes: the keep-alive ``hold`` nodes of ``overlap_collectives`` and the recompute tags
of selective AC are removed (:func:`~graph_trainer.compiler.common.strip_holds`,
:func:`~graph_trainer.compiler.common.strip_recompute_tags`: Inductor owns buffer lifetimes,
and ``sac_recompute`` owns recomputation), and one-element CPU tensors move to the
inputs' accelerator (:func:`move_cpu_scalars`). Then the graph is copied with flat inputs /
a tuple output and compiled by
``torch._inductor.compile_fx.compile_fx`` (AOTAutograd functionalization +
Inductor decompositions + codegen; ``compile_fx_inner`` alone rejects the
un-decomposed aten graph that make_fx produces, e.g. ``aten.t``). Compilation
runs under a ``torch._guards.TracingContext`` holding the graph's fake mode
(detected from the placeholders' ``meta["val"]``), with those fake values as
example inputs. On CPU Inductor uses its C++ backend.

Calling convention: the returned module is a new ``torch.fx.GraphModule`` with
the *same placeholders and codegen* as the input graph, whose body is a single
call to the compiled code followed by ``getitem``s. It is therefore called
exactly like the input graph: ``gm(*flat_inputs)`` for a flat graph, or with
the original pytree arguments (``gm(params, buffers, tokens, labels)``) for a
make_fx graph carrying ``_PyTreeCodeGen``; outputs keep their structure. The
compiled callable is also available as ``gm.compiled_fn`` (flat ``*args``).
"""

from __future__ import annotations

from dataclasses import dataclass

import logging
import operator
import time
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from graph_trainer.compiler.common import (
    json_object,
    collective_kind,
    detect_graph_fake_mode,
    fake_inputs_for,
    placeholder_vals,
    set_pass_summary,
    strip_holds,
    strip_recompute_tags,
)
from graph_trainer.compiler.registry import GraphPass

logger = logging.getLogger("graph_trainer")


def _flat_copy(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list, pytree.TreeSpec]:
    """Copy of ``gm`` taking flat positional inputs and returning a flat tuple of
    its output's node leaves; also returns the output leaves and their spec."""
    graph = torch.fx.Graph()
    val_map: dict[torch.fx.Node, torch.fx.Node] = {}
    out_args = graph.graph_copy(gm.graph, val_map)
    leaves, spec = pytree.tree_flatten(out_args)
    node_leaves = [leaf for leaf in leaves if isinstance(leaf, torch.fx.Node)]
    graph.output(tuple(node_leaves))
    flat_gm = torch.fx.GraphModule(gm, graph)
    return flat_gm, leaves, spec


def _input_device(gm: torch.fx.GraphModule, example_inputs) -> torch.device | None:
    """The accelerator of the graph's inputs (the first tensor input not on the CPU), else None."""
    vals = placeholder_vals(gm) + (pytree.tree_leaves(example_inputs) if example_inputs is not None else [])
    for v in vals:
        if isinstance(v, torch.Tensor) and v.device.type not in ("cpu", "meta"):
            return v.device
    return None


def move_cpu_scalars(gm: torch.fx.GraphModule, device: torch.device | None) -> int:
    """Put the graph's one-element CPU tensors on ``device``: constants (``get_attr``),
    factory calls with ``device=cpu`` (``aten.scalar_tensor``, ``aten.full``, ...) and copies
    made only of those (``aten.lift_fresh_copy``), e.g. the ``0`` that DTensor's
    vocabulary-parallel embedding writes with ``index_put_``.

    Eager CUDA ops read such a CPU scalar as a plain number, but Inductor makes it a graph
    input that it copies host-to-device on every call, which CUDA graph capture refuses
    (``Cannot copy between CPU and CUDA tensors during CUDA graph capture``). The values and
    dtypes stay the same. Nothing changes when ``device`` is None or the CPU.

    Returns:
        The number of constants and calls moved.
    """
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
            continue  # (a copy of a moved constant, e.g. lift_fresh_copy, follows it)
        n.meta["val"] = val.to(device)
        moved.add(n)
    if moved:
        gm.recompile()
    return len(moved)


def full_inductor_pass(
    gm: torch.fx.GraphModule,
    example_inputs=None,
    inductor_configs: dict[str, Any] | None = None,
    pin_collectives: bool = False,
) -> torch.fx.GraphModule:
    """Compile all of ``gm`` with Inductor; return a GraphModule called like ``gm``.

    Args:
        inductor_configs: ``torch._inductor.config`` overrides for this compile
            (``--compile.full_inductor.configs``; dotted keys, e.g.
            ``{"aten_distributed_optimizations.enable_overlap_scheduling": true}``);
            unknown keys raise ``AttributeError`` from ``config.patch``.
        pin_collectives: keep the issue / wait positions of the collectives between
            the same two matmuls as in ``gm`` (``--compile.full_inductor.pin_collectives``:
            the hook of :mod:`graph_trainer.compiler.pin_collectives` as Inductor's
            ``post_grad_custom_post_pass``, with ``reorder_for_locality`` off); without it
            Inductor's peak-memory reordering puts each wait right after its collective.
            Nothing changes for a graph without collectives.

    Stats: ``compile_s``, ``nodes_compiled``.
    """
    strip_holds(gm)  # keep-alive identities of overlap_collectives: Inductor owns lifetimes
    moved = move_cpu_scalars(gm, _input_device(gm, example_inputs))
    strip_recompute_tags(gm.graph)  # AC recompute is sac_recompute's job, not compile_fx's (torch >= 2.12)
    fake_inputs = fake_inputs_for(gm, example_inputs)
    fake_mode = detect_graph_fake_mode(gm, example_inputs)
    flat_gm, out_leaves, out_spec = _flat_copy(gm)
    n_compiled = len(gm.graph.nodes)

    from torch._inductor.compile_fx import compile_fx

    patches = dict(inductor_configs or {})
    pin_collectives = pin_collectives and any(collective_kind(n) for n in gm.graph.nodes)
    if pin_collectives:
        from graph_trainer.compiler.pin_collectives import PinCollectivesPass

        patches["post_grad_custom_post_pass"] = PinCollectivesPass()
        # Inductor compiles the traced step as an inference graph, and for those its
        # post-grad reorder_for_locality moves every wait_tensor right before its first
        # user: the reduce-scatter waits (used only by the graph output) to the very end.
        patches.setdefault("reorder_for_locality", False)
    t0 = time.perf_counter()
    with torch._inductor.config.patch(patches):
        if fake_mode is not None:
            with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
                compiled = compile_fx(flat_gm, fake_inputs)
        else:
            compiled = compile_fx(flat_gm, fake_inputs)
    compile_s = time.perf_counter() - t0

    def inductor_compiled_graph(*args):
        return compiled(*args)

    # Wrapper graph: same placeholders + codegen as gm, one call, getitems.
    graph = torch.fx.Graph()
    placeholders = []
    for node in gm.graph.find_nodes(op="placeholder"):
        new = graph.placeholder(node.target, type_expr=node.type)
        new.meta = dict(node.meta)
        placeholders.append(new)
    call = graph.call_function(inductor_compiled_graph, tuple(placeholders))
    call.meta["val"] = tuple(
        leaf.meta.get("val") for leaf in out_leaves if isinstance(leaf, torch.fx.Node)
    )
    new_leaves = []
    idx = 0
    for leaf in out_leaves:
        if isinstance(leaf, torch.fx.Node):
            item = graph.call_function(operator.getitem, (call, idx))
            item.meta = {k: v for k, v in leaf.meta.items() if k in ("val", "tensor_meta", "custom")}
            new_leaves.append(item)
            idx += 1
        else:
            new_leaves.append(leaf)
    graph.output(pytree.tree_unflatten(new_leaves, out_spec))
    graph._codegen = gm.graph._codegen
    new_gm = torch.fx.GraphModule(torch.nn.Module(), graph, class_name="InductorCompiledGraph")
    new_gm.meta.update({k: v for k, v in gm.meta.items()})
    new_gm.compiled_fn = compiled
    set_pass_summary(
        new_gm,
        f"compiled the whole graph ({n_compiled} nodes) with Inductor in {compile_s:.1f}s"
        + (" (collective schedule pinned)" if pin_collectives else "")
        + (f"; {moved} CPU scalar(s) moved to the device" if moved else "")
        + (f"; configs {sorted(inductor_configs)}" if inductor_configs else ""),
        compile_s=round(compile_s, 3),
        nodes_compiled=n_compiled,
    )
    return new_gm



@dataclass
class FullInductorOptions:
    """``[compile.full_inductor]``: options of ``full_inductor``
    (``--compile.inductor_compilation full``)."""

    configs: str = ""
    """``torch._inductor.config`` overrides for the whole-graph compile: JSON on the CLI, a
    table in TOML, dotted keys, e.g.
    ``{"aten_distributed_optimizations.enable_overlap_scheduling": true}``."""

    pin_collectives: bool = True
    """Keep overlap_collectives' placement of every collective and wait (under the same
    matmuls) inside Inductor's schedule (graph_trainer/compiler/pin_collectives.py). Without it
    Inductor's peak-memory reordering waits for each collective right after issuing it,
    so nothing overlaps."""

    def check(self) -> None:
        """Raises ValueError: configs is not a JSON object."""
        json_object(self.configs, "--compile.full_inductor.configs")


PASS = GraphPass(
    name="full_inductor", fn=full_inductor_pass, options=FullInductorOptions, compiles=True,
    enabled=lambda ctx: ctx.compile_cfg.inductor_compilation == "full",
    kwargs=lambda options, ctx: {"inductor_configs": json_object(options.configs, "--compile.full_inductor.configs")
                                 or None, "pin_collectives": options.pin_collectives},
    aliases=("full_inductor_compilation",),
)
