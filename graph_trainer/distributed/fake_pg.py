"""The process group of ``COMM_MODE=fake_collectives``: one process, every collective local.

One process trains as rank 0 of an ``NGPU``-rank layout on one device, each collective replaced
by the local work of a world in which every rank holds this rank's tensors: all-gather copies
the input into every chunk, reduce-scatter keeps this rank's chunk of the input (no reduction),
scatter / gather move this rank's piece, all-to-all copies; all-reduce, broadcast, barrier and
send / recv change nothing. It measures the rank's compute and host time without communication.

Own code because torch's fake process group (``torch.testing._internal.distributed.fake_pg``)
leaves a reduce-scatter's output as allocated: garbage on a GPU, which turned the losses into NaN.
"""

from __future__ import annotations

import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

BACKEND = "fake_collectives"


def _done(result=None):
    """A completed ``Work``."""
    fut = Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class LocalCopyProcessGroup(dist.ProcessGroup):
    """``world_size`` ranks of which this process is ``rank``; collectives are local copies
    (module docstring), on tensors of any device."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        self._rank, self._world = rank, world_size

    def size(self) -> int:
        return self._world

    @property
    def group_name(self) -> str:
        return dist.distributed_c10d._world.pg_names[self]

    @property
    def pg_name(self) -> str:
        return self.group_name

    def getBackendName(self) -> str:
        return BACKEND

    def __repr__(self) -> str:
        return f"LocalCopyProcessGroup(rank={self._rank}, world_size={self._world})"

    def _unchanged(self, tensors, *args, **kwargs):
        return _done(tensors)

    allreduce = allreduce_coalesced = broadcast = send = recv = _unchanged

    def barrier(self, *args, **kwargs):
        return _done()

    def scatter(self, outputs, inputs, *args, **kwargs):
        if inputs:
            outputs[0].copy_(inputs[0][self._rank])
        return _done(outputs)

    def gather(self, outputs, inputs, *args, **kwargs):
        for o in outputs[0] if outputs else []:
            o.copy_(inputs[0])
        return _done(outputs)

    def all_to_all_single(self, output, input, *args, **kwargs):
        if output.shape == input.shape:
            output.copy_(input)
        return _done([output])

    def allgather(self, outputs, inputs, *args, **kwargs):
        for outs, x in zip(outputs, inputs):
            for o in outs:
                o.copy_(x)
        return _done(outputs)

    def all_gather_single(self, output, input, *args, **kwargs):
        output.view(self._world, *input.shape).copy_(input.unsqueeze(0).expand(self._world, *input.shape))
        return _done([output])

    def all_gather_single_coalesced(self, outputs, inputs, *args, **kwargs):
        for o, x in zip(outputs, inputs):
            self.all_gather_single(o, x)
        return _done(outputs)

    def reduce_scatter(self, outputs, inputs, *args, **kwargs):
        for o, xs in zip(outputs, inputs):
            o.copy_(xs[self._rank])
        return _done(outputs)

    def reduce_scatter_single(self, output, input, *args, **kwargs):
        output.copy_(input.view(self._world, *output.shape)[self._rank])
        return _done([output])

    def reduce_scatter_single_coalesced(self, outputs, inputs, *args, **kwargs):
        for o, x in zip(outputs, inputs):
            self.reduce_scatter_single(o, x)
        return _done(outputs)

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
