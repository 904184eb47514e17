"""Replay the (compiled) training step as a CUDA graph. CUDA only; the memory policy adds it where it fits (one
process on a CUDA device, no whole-graph Inductor) unless a flag names it (with several processes the NCCL
collectives are captured too). Numerics unchanged.

``gm.forward`` becomes a :class:`CUDAGraphWrapper`: one eager call on a side stream, one capture, then replays.
``nn.Parameter`` s and inputs whose storage did not change between the warmup call and the capture are used in
place; other tensor inputs are copied into static buffers on each call. The outputs are static tensors overwritten
by the next call; the input structure must not change.

With several processes, :func:`release_cuda_graphs` must run before ``dist.destroy_process_group()``: NCCL's
communicator destroy waits until every graph that captured one of its collectives is destroyed, so a live graph
hangs the exit (pytorch/pytorch#115388; NCCL's ``localPersistentRefs``)."""

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.fx._lazy_graph_module import _LazyGraphModule

from graph_trainer import logger
from graph_trainer.compiler.node_meta import set_pass_summary
from graph_trainer.compiler.registry import GraphPass

_LIVE: "weakref.WeakSet[CUDAGraphWrapper]" = weakref.WeakSet()


class CUDAGraphWrapper:
    """Warm up, capture once, then replay ``fn`` (module docstring)."""

    def __init__(self, fn: Callable) -> None:
        _LIVE.add(self)
        self.fn = fn
        self.graph: torch.cuda.CUDAGraph | None = None
        self._warmup_ptrs: list[int | None] | None = None  # set by the one warmup call
        self._warned = False

    def __call__(self, *args: Any) -> Any:
        flat, spec = pytree.tree_flatten(args)
        if self._warmup_ptrs is None:
            self._warmup_ptrs = [x.data_ptr() if isinstance(x, torch.Tensor) else None for x in flat]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                out = self.fn(*args)
            torch.cuda.current_stream().wait_stream(stream)
            return out
        if self.graph is None:
            self.spec = spec
            ptrs = self._warmup_ptrs + [None] * (len(flat) - len(self._warmup_ptrs))
            self.static_idx = {i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)
                               and (isinstance(x, torch.nn.Parameter) or ptrs[i] == x.data_ptr())}
            self.static_inputs = [x if not isinstance(x, torch.Tensor) or i in self.static_idx else x.clone()
                                  for i, x in enumerate(flat)]
            self.graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            before = torch.cuda.memory_reserved()
            # with NCCL peers, other threads (ProcessGroupNCCL's watchdog) query CUDA events during the capture:
            # only this thread's calls may invalidate it
            mode = "thread_local" if dist.is_initialized() and dist.get_world_size() > 1 else "global"
            with torch.cuda.graph(self.graph, capture_error_mode=mode):  # (its __enter__ empties the allocator's cache)
                self.static_outputs = self.fn(*pytree.tree_unflatten(self.static_inputs, spec))
            after = torch.cuda.memory_reserved()
            logger.info("cudagraph_pass: captured CUDA graph (%d inputs, %d static); reserved %.2f GiB before the "
                        "capture, %.2f GiB after (peak so far %.2f GiB)", len(flat), len(self.static_idx),
                        before / 2**30, after / 2**30, torch.cuda.max_memory_reserved() / 2**30)
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


def release_cuda_graphs() -> int:
    """Destroy every captured graph (``CUDAGraph.reset``), then synchronize the device; returns how many. Call it
    before ``dist.destroy_process_group()`` (module docstring). A wrapper called again captures anew."""
    graphs = [w for w in list(_LIVE) if w.graph is not None]
    for w in graphs:
        w.graph.reset()
        w.graph = None
    if graphs:
        torch.cuda.synchronize()
    return len(graphs)


def generated_forward(gm: torch.fx.GraphModule) -> Callable:
    """``gm.forward`` as its generated code (a lazy GraphModule's placeholder forward would re-enter the wrapper)."""
    if isinstance(gm, _LazyGraphModule):
        gm.real_recompile()
    return gm.forward


def cudagraph_pass(gm: torch.fx.GraphModule, example_inputs=None) -> torch.fx.GraphModule:
    """Wrap ``gm.forward`` in a :class:`CUDAGraphWrapper`; ``RuntimeError`` without CUDA or with non-CUDA inputs."""
    if not torch.cuda.is_available():
        raise RuntimeError("cudagraph_pass needs CUDA (torch.cuda.is_available() is False); "
                           "leave cudagraph out of --compile.passes on CPU")
    if any(x.device.type != "cuda" for x in pytree.tree_leaves(example_inputs) if isinstance(x, torch.Tensor)):
        raise RuntimeError("cudagraph_pass: all example inputs must be CUDA tensors")
    gm.forward = CUDAGraphWrapper(generated_forward(gm))
    set_pass_summary(gm, "wrapped forward in a CUDA graph (warmup=1, capture on the next call)")
    return gm


PASS = GraphPass(name="cudagraph", fn=cudagraph_pass, compiles=True,
                 enabled=lambda ctx: bool(getattr(ctx.levers, "cudagraph", False)))
