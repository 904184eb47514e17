"""aot_fx_trace: capture forward + loss + backward of one training step as ONE FX graph.

:func:`trace_train_step` runs ``make_fx`` (fake tensors) over ``step(*params, *buffers, tokens, labels) -> (loss,
*grads)`` with the model re-parametrized by the placeholders and ``torch.autograd.grad`` for the backward
(docs/design.md, "aot_fx_trace"). Op-level selective AC only tags nodes; the ``sac_recompute`` pass recomputes. Node
metadata written here: see :mod:`graph_trainer`."""

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx.traceback as fx_traceback
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.utils.stateless import _reparametrize_module

from graph_trainer import AC_REGION_KEY, MODULE_FQN_KEY, PHASE_KEY


def _preserve_seq_nr_in_backward(loss: torch.Tensor) -> None:
    """Make backward nodes carry the ``seq_nr`` of the forward op they differentiate (AOTAutograd's hooks; a no-op
    where this torch lacks them)."""
    try:
        from torch._functorch._aot_autograd.logging_utils import setup_stacktrace_preservation_hooks
    except ImportError:  # pragma: no cover - older/newer torch
        return
    if loss.grad_fn is not None:
        setup_stacktrace_preservation_hooks([loss.grad_fn])


@contextlib.contextmanager
def annotate_module_fqns(model: torch.nn.Module):
    """Annotate every node made inside a submodule's forward with ``{"module_fqn": fqn}`` (innermost wins)
    and, inside a ``CheckpointWrapper``, ``{"ac_region": its fqn}``, through forward hooks removed on exit."""
    handles, stacks = [], []

    def pre(annotation, _mod, _args):
        stacks.append(contextlib.ExitStack())
        stacks[-1].enter_context(fx_traceback.annotate(annotation))

    def post(_mod, _args, _out):
        stacks.pop().close()

    for fqn, mod in model.named_modules():
        if not fqn:
            continue
        clean = fqn.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", "")
        annotation = {MODULE_FQN_KEY: clean}
        if isinstance(mod, CheckpointWrapper):  # nested annotations keep it (annotate merges)
            annotation[AC_REGION_KEY] = clean
        handles.append(mod.register_forward_pre_hook(functools.partial(pre, annotation)))
        handles.append(mod.register_forward_hook(post, always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        while stacks:
            stacks.pop().close()


def _propagate_fqn_to_backward(gm: torch.fx.GraphModule) -> None:
    """Give backward nodes the module FQN of the forward node with the same ``seq_nr``."""
    fwd_fqn = {n.meta["seq_nr"]: c[MODULE_FQN_KEY] for n in gm.graph.nodes
               if (c := n.meta.get("custom", {})).get(PHASE_KEY) == "forward" and MODULE_FQN_KEY in c
               and n.meta.get("seq_nr") is not None}
    for node in gm.graph.nodes:
        custom = node.meta.get("custom")
        if custom and custom.get(PHASE_KEY) == "backward" and MODULE_FQN_KEY not in custom:
            if (fqn := fwd_fqn.get(node.meta.get("seq_nr"))) is not None:
                node.meta["custom"] = {**custom, MODULE_FQN_KEY: fqn}


@dataclass
class TracedStep:
    """The traced step: ``gm`` (the FX graph, or after passes a compiled callable of the same inputs),
    parameter / buffer FQNs in placeholder order, make_fx time (s), the placeholders' fake tensors."""

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


def trace_train_step(model: torch.nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                     tokens: torch.Tensor, labels: torch.Tensor, param_dtype: torch.dtype | None = None,
                     params: list[torch.Tensor] | None = None, param_names: list[str] | None = None,
                     materialize: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None) -> TracedStep:
    """Trace forward + ``loss_fn`` + ``torch.autograd.grad`` of ``model`` (AC-wrapped / parallelized, not modified) into
    one graph: a :class:`TracedStep` ``(*params, *buffers, tokens, labels) -> (loss, *grads)``.

    ``loss_fn(logits [B, S, V], labels [B, S] int64) -> 0-d tensor``; ``tokens`` / ``labels``: ``[B, S]`` int64 example
    batch (shapes and dtypes only); ``param_dtype``: compute dtype of floating parameters (None: theirs); ``params`` /
    ``param_names``: the inputs standing for the parameters and the FQNs they fill (default
    ``model.named_parameters()``; FSDP: the local shards); ``materialize``: ``params`` -> the full compute parameters
    inside the graph (FSDP: all-gather + cast; default: cast to ``param_dtype``). Raises whatever make_fx raises for an
    untraceable model (e.g. data-dependent control flow)."""
    if params is None:
        param_names, params = map(list, zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad]))
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
                compute = [p.to(param_dtype) if p.is_floating_point() and param_dtype not in (None, p.dtype) else p
                           for p in params]
            state = {**dict(zip(param_names, compute)), **dict(zip(buffer_names, bufs))}
        # re-parametrized through the backward too: activation checkpointing recomputes there
        with _reparametrize_module(model, state):
            with fx_traceback.annotate({PHASE_KEY: "forward"}):
                loss = loss_fn(model(toks), labs)
            _preserve_seq_nr_in_backward(loss)
            with fx_traceback.annotate({PHASE_KEY: "backward"}):
                grads = torch.autograd.grad(loss, params)
        if hasattr(loss, "to_local"):  # TP loss parallel: a replicated DTensor; return the computed local value
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
