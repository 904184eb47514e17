"""aot_fx_trace: capture forward + loss + backward of one training step as ONE FX graph.

:func:`trace_train_step` runs ``make_fx`` (fake tensors, real shapes — no memory is
used for activations while tracing) over a function of the *flattened* inputs::

    step(*params, *buffers, tokens, labels) -> (loss, *grads)      # one grad per param

so graph placeholders are, in order, the parameters (``named_parameters`` order),
the buffers, ``tokens`` and ``labels``; the output is a flat tuple. Inside, the model
runs re-parametrized with the placeholders (``torch.nn.utils.stateless``, kept through
the backward) and ``torch.autograd.grad`` produces the gradients, so the backward is traced by
autograd itself. Layer-level activation checkpointing recomputes inside the traced
backward; op-level selective AC only tags the nodes it would recompute
(``node.meta["recompute"]``) and the ``sac_recompute`` pass does the recomputation.

Mixed precision (``param_dtype``): floating parameters are cast to ``param_dtype``
at the start of the forward (``aten._to_copy`` in the graph; with ``materialize``, the
FSDP all-gather / TP ``DTensor`` wrap of :mod:`graph_trainer.distributed.parallelize` happen there too);
autograd casts their gradients back, so gradients and the optimizer stay in the
parameters' dtype (fp32).

Metadata written on the nodes: see :mod:`graph_trainer` (``custom["phase"]``,
``custom["module_fqn"]``, ``custom["ac_region"]``).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx.traceback as fx_traceback
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.fx.experimental.proxy_tensor import make_fx

from torch.nn.utils.stateless import _reparametrize_module

from graph_trainer import AC_REGION_KEY, MODULE_FQN_KEY, PHASE_KEY


def _preserve_seq_nr_in_backward(loss: torch.Tensor) -> None:
    """Make backward nodes carry the ``seq_nr`` of the forward op they differentiate.

    Uses the autograd pre/post hooks that AOTAutograd installs for the same purpose
    (stack traces and seq_nr of backward nodes); a no-op if the helper is missing.
    """
    try:
        from torch._functorch._aot_autograd.logging_utils import (
            setup_stacktrace_preservation_hooks,
        )
    except ImportError:  # pragma: no cover - older/newer torch
        return
    if loss.grad_fn is not None:
        setup_stacktrace_preservation_hooks([loss.grad_fn])


@contextlib.contextmanager
def annotate_module_fqns(model: torch.nn.Module):
    """Annotate every node produced inside a submodule's forward with its FQN.

    Registers forward pre/post hooks that enter/leave
    ``torch.fx.traceback.annotate({"module_fqn": fqn})``; nested modules override
    the outer FQN and restore it on exit. Hooks are removed on exit. Nodes inside an
    activation-checkpointed module (a ``CheckpointWrapper``) also get
    ``{"ac_region": its fqn}``: the block whose inputs checkpointing saves (used by
    :func:`graph_trainer.compiler.passes.sac_recompute_pass`).
    """
    handles = []
    stacks: list[contextlib.ExitStack] = []

    def make_pre(annotation):
        def pre(_mod, _args):
            stack = contextlib.ExitStack()
            stack.enter_context(fx_traceback.annotate(annotation))
            stacks.append(stack)

        return pre

    def post(_mod, _args, _out):
        stacks.pop().close()

    for fqn, mod in model.named_modules():
        if not fqn:
            continue
        clean = fqn.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", "")
        annotation = {MODULE_FQN_KEY: clean}
        if isinstance(mod, CheckpointWrapper):  # nested annotations keep it (annotate merges)
            annotation[AC_REGION_KEY] = clean
        handles.append(mod.register_forward_pre_hook(make_pre(annotation)))
        handles.append(mod.register_forward_hook(post, always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        while stacks:
            stacks.pop().close()


def _propagate_fqn_to_backward(gm: torch.fx.GraphModule) -> int:
    """Give backward nodes the module FQN of the forward node with the same ``seq_nr``.

    Returns the number of backward nodes that received an FQN.
    """
    fwd_fqn: dict[int, str] = {}
    for node in gm.graph.nodes:
        custom = node.meta.get("custom", {})
        if custom.get(PHASE_KEY) == "forward" and MODULE_FQN_KEY in custom:
            seq_nr = node.meta.get("seq_nr")
            if seq_nr is not None:
                fwd_fqn[seq_nr] = custom[MODULE_FQN_KEY]
    n = 0
    for node in gm.graph.nodes:
        custom = node.meta.get("custom")
        if not custom or custom.get(PHASE_KEY) != "backward" or MODULE_FQN_KEY in custom:
            continue
        fqn = fwd_fqn.get(node.meta.get("seq_nr"))
        if fqn is not None:
            node.meta["custom"] = {**custom, MODULE_FQN_KEY: fqn}
            n += 1
    return n


def ops_by_kind(gm: torch.fx.GraphModule) -> Counter:
    """Count ``call_function`` nodes by target name (e.g. ``aten.mm.default``)."""
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


@dataclass
class TracedStep:
    """The traced training step and how to call it.

    Attributes:
        gm: the FX graph (after :func:`trace_train_step`; passes may replace it with
            a compiled callable taking the same flat inputs).
        param_names / buffer_names: FQNs in placeholder order.
        trace_time_s: wall time of make_fx, seconds.
        example_inputs: fake tensors of the placeholders (for passes).
    """

    gm: Callable
    param_names: list[str]
    buffer_names: list[str]
    trace_time_s: float
    example_inputs: list = field(default_factory=list)

    def __call__(self, params, buffers, tokens, labels):
        """Run the graph. Returns ``(loss: 0-d fp32 tensor, grads: list[Tensor])``."""
        with torch.no_grad():
            out = self.gm(*params, *buffers, tokens, labels)
        return out[0], list(out[1:])


def trace_train_step(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    tokens: torch.Tensor,
    labels: torch.Tensor,
    param_dtype: torch.dtype | None = None,
    params: list[torch.Tensor] | None = None,
    param_names: list[str] | None = None,
    materialize: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
) -> TracedStep:
    """Trace forward + ``loss_fn`` + ``torch.autograd.grad`` of ``model`` into one graph.

    Args:
        model: the (possibly AC-wrapped / parallelized) model; its parameters must
            require grad. Not modified (hooks are removed afterwards).
        loss_fn: ``loss_fn(logits [B, S, V], labels [B, S] int64) -> 0-d tensor``.
        tokens, labels: ``[B, S]`` int64 example batch; only shapes/dtypes are used
            (tracing runs on fake tensors).
        param_dtype: compute dtype for floating parameters (``None``: keep theirs).
        params / param_names: graph inputs that stand for the parameters and the
            module FQNs they fill (default: ``model.named_parameters()``). With FSDP
            these are the local shards (:mod:`graph_trainer.distributed.fsdp`).
        materialize: maps the ``params`` inputs to the full compute parameters inside
            the graph (FSDP: all-gather + cast). Default: cast to ``param_dtype``.

    Returns:
        A :class:`TracedStep` whose graph maps
        ``(*params, *buffers, tokens, labels) -> (loss, *grads)``.

    Raises:
        Whatever make_fx raises for untraceable models (e.g. data-dependent control flow).
    """
    if params is None:
        named_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        param_names = [n for n, _ in named_params]
        params = [p for _, p in named_params]
    named_bufs = list(model.named_buffers())
    buffer_names = [n for n, _ in named_bufs]
    n_p, n_b = len(param_names), len(buffer_names)

    def step(*flat):
        params, bufs = flat[:n_p], flat[n_p : n_p + n_b]
        toks, labs = flat[n_p + n_b], flat[n_p + n_b + 1]
        with fx_traceback.annotate({PHASE_KEY: "forward"}):
            if materialize is not None:
                compute = materialize(list(params))
            else:
                compute = [
                    p.to(param_dtype)
                    if param_dtype is not None and p.is_floating_point() and p.dtype != param_dtype
                    else p
                    for p in params
                ]
            state = {**dict(zip(param_names, compute)), **dict(zip(buffer_names, bufs))}
        # The module stays re-parametrized through the backward too: activation
        # checkpointing recomputes the forward there and must see the placeholders.
        with _reparametrize_module(model, state):
            with fx_traceback.annotate({PHASE_KEY: "forward"}):
                logits = model(toks)
                loss = loss_fn(logits, labs)
            _preserve_seq_nr_in_backward(loss)
            with fx_traceback.annotate({PHASE_KEY: "backward"}):
                grads = torch.autograd.grad(loss, params)
        # TP with loss parallel: the loss is a replicated DTensor; return its local value
        # (a plain tensor the graph computes, not a constant)
        if hasattr(loss, "to_local"):
            loss = loss.to_local()
        return (loss, *grads)

    inputs = list(params) + [b for _, b in named_bufs] + [tokens, labels]
    t0 = time.perf_counter()
    with fx_traceback.preserve_node_meta(), annotate_module_fqns(model):
        gm = make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=False)(*inputs)
    _propagate_fqn_to_backward(gm)
    trace_time = time.perf_counter() - t0
    example_inputs = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    return TracedStep(gm, param_names, buffer_names, trace_time, example_inputs)
