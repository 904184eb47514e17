"""Replay the (compiled) training step as a CUDA graph. CUDA only, optional
(``--compile.passes cudagraph``).

Matches: the whole module (no node is inspected).

Changes: ``gm.forward`` is replaced by a :class:`CUDAGraphWrapper`: the first
``warmup`` calls run eagerly on a side stream, the next call captures one CUDA
graph with static input buffers, and every later call copies the new inputs
into those buffers and replays the graph.

* Static inputs are used in place by the graph: ``nn.Parameter``s, inputs whose
  flat index is in ``static_input_indices``, and inputs whose storage did not
  change between the last warmup call and the capture call (parameters and
  buffers updated in place by the optimizer). Every other tensor input (tokens,
  labels, ...) is copied into a static buffer on each call. If a static input
  later arrives with a different storage, its values are copied into the
  captured tensor (correct, but slower; logged once).
* The outputs are the graph's static output tensors, overwritten by the next
  call: consume them (``loss.item()``, ``optimizer.step()``) before calling
  again, or clone them.
* The input structure (pytree spec, shapes, dtypes) must stay the same.
* Memory: the captured graph keeps its own pool, so under traced FSDP the step's peak
  grows. The gain is the host time between kernels: it pays where the GPU waits on the
  host (TP ranks under regional Inductor), not where kernels are long (FSDP2) or few (full
  Inductor); perf.md, "eighth session".

Raises ``RuntimeError`` when CUDA is unavailable or the example inputs are not
CUDA tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from graph_trainer.compiler.common import set_pass_summary
from graph_trainer.compiler.registry import GraphPass

logger = logging.getLogger("graph_trainer")


class CUDAGraphWrapper:
    """Warm up, capture once, then replay ``fn`` (see module docstring)."""

    def __init__(self, fn: Callable, warmup: int = 1, static_input_indices: Sequence[int] = ()) -> None:
        self.fn = fn
        self.warmup = warmup
        self.static_input_indices = set(static_input_indices)
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.spec = None
        self.static_inputs: list[Any] = []
        self.static_outputs: Any = None
        self._warmup_ptrs: list[int | None] = []
        self._warned = False
        self.static_idx: set[int] = set()

    def _is_static(self, i: int, x: Any) -> bool:
        if i in self.static_input_indices or isinstance(x, torch.nn.Parameter):
            return True
        return i < len(self._warmup_ptrs) and self._warmup_ptrs[i] == x.data_ptr()

    def __call__(self, *args: Any) -> Any:
        flat, spec = pytree.tree_flatten(args)
        if self.graph is None and self.calls < self.warmup:
            self.calls += 1
            self._warmup_ptrs = [x.data_ptr() if isinstance(x, torch.Tensor) else None for x in flat]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                out = self.fn(*args)
            torch.cuda.current_stream().wait_stream(stream)
            return out
        if self.graph is None:
            self.spec = spec
            self.static_idx = {i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and self._is_static(i, x)}
            self.static_inputs = [
                x if not isinstance(x, torch.Tensor) or i in self.static_idx else x.clone()
                for i, x in enumerate(flat)
            ]
            self.graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.graph(self.graph):
                self.static_outputs = self.fn(*pytree.tree_unflatten(self.static_inputs, spec))
            logger.info(
                "cudagraph_pass: captured CUDA graph (%d inputs, %d static)", len(flat), len(self.static_idx)
            )
        if spec != self.spec:
            raise RuntimeError("CUDAGraphWrapper: input structure changed since capture")
        for i, (dst, src) in enumerate(zip(self.static_inputs, flat)):
            if isinstance(dst, torch.Tensor) and dst.data_ptr() != src.data_ptr():
                if i in self.static_idx and not self._warned:
                    self._warned = True
                    logger.warning("cudagraph_pass: static input %d changed storage; copying it each call", i)
                dst.copy_(src)
        self.graph.replay()
        return self.static_outputs


def cudagraph_pass(
    gm: torch.fx.GraphModule,
    example_inputs=None,
    *,
    warmup: int = 1,
    static_input_indices: Sequence[int] = (),
) -> torch.fx.GraphModule:
    """Wrap ``gm.forward`` in a :class:`CUDAGraphWrapper` (CUDA only)."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "cudagraph_pass needs CUDA (torch.cuda.is_available() is False); "
            "leave cudagraph out of --compile.passes on CPU"
        )
    leaves = [x for x in pytree.tree_leaves(example_inputs) if isinstance(x, torch.Tensor)]
    if any(x.device.type != "cuda" for x in leaves):
        raise RuntimeError("cudagraph_pass: all example inputs must be CUDA tensors")
    gm.forward = CUDAGraphWrapper(gm.forward, warmup=warmup, static_input_indices=static_input_indices)
    set_pass_summary(gm, f"wrapped forward in a CUDA graph (warmup={warmup}, capture on the next call)")
    return gm


PASS = GraphPass(name="cudagraph", fn=cudagraph_pass, compiles=True)
