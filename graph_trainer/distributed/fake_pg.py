"""The process group of ``COMM_MODE=fake_collectives``: one process, every collective local.

One process trains as rank 0 of an ``NGPU``-rank layout on one device, each collective replaced by the local work of a
world in which every rank holds this rank's tensors (all-gather copies the input into every chunk, reduce-scatter keeps
this rank's chunk, all-reduce changes nothing). On a GPU the copies run on a side stream, as NCCL's kernels do
(docs/design.md, "Layout").

Own code because torch's fake process group leaves a reduce-scatter's output as allocated: garbage on a GPU, which
turned the losses into NaN."""

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

BACKEND = "fake_collectives"

#: The side stream of each CUDA device that every group's copies run on (created at first use).
SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _done(result=None):
    """A completed ``Work``."""
    fut = Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class SideStreamWork(dist.Work):
    """The ``Work`` of copies queued on a side stream. ``wait()`` makes the caller's current stream
    wait for them (a CUDA event), then drops the tensors it held since the copies were queued: their
    blocks are freed in the waiting stream's order, after the copies (NCCL's "stashed" tensors). Not
    ``record_stream``: the caching allocator reuses no block used on another stream while a CUDA
    graph capture is under way, so a captured step's memory would grow with every collective."""

    def __init__(self, event: torch.cuda.Event, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self._event, self._tensors = event, tensors

    def wait(self, timeout=None) -> bool:
        self._event.wait()
        self._tensors = []
        return True


class LocalCopyProcessGroup(dist.ProcessGroup):
    """``world_size`` ranks of which this process is ``rank``; collectives are local copies
    (module docstring), on tensors of any device."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        self._rank, self._world = rank, world_size

    def _local(self, outputs, inputs, copy) -> dist.Work:
        """Run ``copy()``, the collective's local copies from ``inputs`` into ``outputs``, and return
        its ``Work``. CUDA tensors: on the device's side stream (``SIDE_STREAMS``), which first waits
        for the caller's stream; a :class:`SideStreamWork`. Elsewhere: at once, a completed ``Work``."""
        tensors = [t for t in pytree.tree_leaves((outputs, inputs)) if isinstance(t, torch.Tensor)]
        device = tensors[0].device if tensors else None
        if device is None or device.type != "cuda":
            copy()
            return _done(outputs)
        if (side := SIDE_STREAMS.get(device)) is None:
            side = SIDE_STREAMS[device] = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            copy()
        event = torch.cuda.Event()
        event.record(side)
        return SideStreamWork(event, tensors)

    def _each(self, outputs, inputs, copy_one) -> dist.Work:
        """:meth:`_local` of ``copy_one(o, x)`` for each pair of ``outputs`` and ``inputs``."""
        def copy():
            for o, x in zip(outputs, inputs):
                copy_one(o, x)
        return self._local(outputs, inputs, copy)

    def _gather_into(self, output, x) -> None:
        """Every chunk of ``output`` a contiguous copy of ``x`` (an expanded source would be a
        strided, slower kernel)."""
        for chunk in output.view(self._world, *x.shape).unbind(0):
            chunk.copy_(x)

    def _scatter_from(self, output, x) -> None:
        """``output`` = this rank's chunk of ``x``."""
        output.copy_(x.view(self._world, *output.shape)[self._rank])

    def size(self) -> int:
        return self._world

    @property
    def group_name(self) -> str:
        return dist.distributed_c10d._world.pg_names[self]

    def getBackendName(self) -> str:
        return BACKEND

    def __repr__(self) -> str:
        return f"LocalCopyProcessGroup(rank={self._rank}, world_size={self._world})"

    def _unchanged(self, tensors, *args, **kwargs):
        return _done(tensors)

    allreduce = allreduce_coalesced = broadcast = send = recv = _unchanged

    def barrier(self, *args, **kwargs):
        return _done()

    def all_to_all_single(self, output, input, *args, **kwargs):
        def copy():
            if output.shape == input.shape:
                output.copy_(input)
        return self._local([output], [input], copy)

    def allgather(self, outputs, inputs, *args, **kwargs):
        def copy_all(outs, x):
            for o in outs:
                o.copy_(x)
        return self._each(outputs, inputs, copy_all)

    def all_gather_single(self, output, input, *args, **kwargs):
        return self._local([output], [input], lambda: self._gather_into(output, input))

    def all_gather_single_coalesced(self, outputs, inputs, *args, **kwargs):
        return self._each(outputs, inputs, self._gather_into)

    def reduce_scatter(self, outputs, inputs, *args, **kwargs):
        return self._each(outputs, inputs, lambda o, xs: o.copy_(xs[self._rank]))

    def reduce_scatter_single(self, output, input, *args, **kwargs):
        return self._local([output], [input], lambda: self._scatter_from(output, input))

    def reduce_scatter_single_coalesced(self, outputs, inputs, *args, **kwargs):
        return self._each(outputs, inputs, self._scatter_from)

    gather = allgather  # the root's outputs[0] gets the input W times; other ranks have no outputs
    scatter = reduce_scatter  # the root's inputs[0][rank]; other ranks have no inputs
    # the names torch < 2.13 looks up
    alltoall_base = all_to_all_single
    _allgather_base = all_gather_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    _reduce_scatter_base = reduce_scatter_single
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced


def init(world_size: int) -> None:
    """Start the default process group as rank 0 of ``world_size`` ranks on
    :class:`LocalCopyProcessGroup` (CPU and CUDA tensors); no store, no peers."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, lambda store, rank, world, timeout: LocalCopyProcessGroup(rank, world),
                                      devices=["cpu", "cuda"])
    dist.init_process_group(BACKEND, rank=0, world_size=world_size, store=FakeStore())
