"""The process group of ``COMM_MODE=fake_collectives``: one process, every collective local.

One process plays rank 0 of an ``NGPU``-rank layout and runs its training step for real on
one device; there are no peers, so each collective is replaced by the local work of a world
in which every rank holds this rank's tensors:

* all-gather (single tensor, list, coalesced): every output chunk is a copy of the input;
* reduce-scatter (single tensor, list, coalesced): the output is a copy of this rank's chunk
  of the input (the reduction over the other ranks is left out, whatever the ``ReduceOp``);
* scatter / gather: this rank's piece, every piece; all-to-all: a copy of the input;
* all-reduce, broadcast, barrier, send / recv: nothing changes.

So every tensor the step reads is defined (torch's own fake process group leaves a
reduce-scatter's output as allocated, which on a GPU is garbage and turned the losses into
NaN at step 1), and finite data run at the speed real data run (a GPU's matmuls are faster
on NaN). Each
all-gather / reduce-scatter costs one local copy kernel instead of the transfer, and no time
is spent waiting for peers: a step measures the rank's compute and host time without
communication. The values are not those of the real layout.

:func:`init` registers the backend and starts the default group; sub-groups (device-mesh
dimensions) are created by ``torch.distributed`` through the same backend.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllToAllOptions,
    AllreduceOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceScatterOptions,
    ScatterOptions,
    _create_work_from_future,
)
from torch.futures import Future

BACKEND = "fake_collectives"


def _done(result=None):
    """A completed ``Work`` (its ``wait()`` returns at once)."""
    fut = Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class LocalCopyProcessGroup(dist.ProcessGroup):
    """A process group of ``world_size`` ranks of which this process is ``rank``; its
    collectives are local copies (see the module docstring). Tensors may be on any device."""

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

    # --- nothing to do ---
    def allreduce(self, tensors, opts=AllreduceOptions()):
        return _done(tensors)

    def allreduce_coalesced(self, tensors, opts=AllreduceOptions()):
        return _done(tensors)

    def broadcast(self, tensors, opts=BroadcastOptions()):
        return _done(tensors)

    def barrier(self, opts=BarrierOptions()):
        return _done()

    # --- rooted: every rank's piece is this rank's ---
    def scatter(self, outputs, inputs, opts=ScatterOptions()):
        if inputs:
            outputs[0].copy_(inputs[0][self._rank])
        return _done(outputs)

    def gather(self, outputs, inputs, opts=GatherOptions()):
        for o in outputs[0] if outputs else []:
            o.copy_(inputs[0])
        return _done(outputs)

    # --- point to point: nothing arrives ---
    def send(self, tensors, dst, tag=0):
        return _done(tensors)

    def recv(self, tensors, src, tag=0):
        return _done(tensors)

    # --- all-to-all: this rank's input, where the sizes allow ---
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=AllToAllOptions()):
        if output.shape == input.shape:
            output.copy_(input)
        return _done([output])

    alltoall_base = all_to_all_single  # its name before torch 2.13

    # --- all-gather: every chunk is this rank's input ---
    def allgather(self, outputs, inputs, opts=AllgatherOptions()):
        for outs, x in zip(outputs, inputs):
            for o in outs:
                o.copy_(x)
        return _done(outputs)

    def all_gather_single(self, output, input, opts=AllgatherOptions()):
        output.view(self._world, *input.shape).copy_(input.unsqueeze(0).expand(self._world, *input.shape))
        return _done([output])

    def all_gather_single_coalesced(self, outputs, inputs, opts=AllgatherOptions()):
        for o, x in zip(outputs, inputs):
            self.all_gather_single(o, x)
        return _done(outputs)

    # the names torch < 2.13 looks up
    _allgather_base = all_gather_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced

    # --- reduce-scatter: this rank's chunk of its own input ---
    def reduce_scatter(self, outputs, inputs, opts=ReduceScatterOptions()):
        for o, xs in zip(outputs, inputs):
            o.copy_(xs[self._rank])
        return _done(outputs)

    def reduce_scatter_single(self, output, input, opts=ReduceScatterOptions()):
        output.copy_(input.view(self._world, *output.shape)[self._rank])
        return _done([output])

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=ReduceScatterOptions()):
        for o, x in zip(outputs, inputs):
            self.reduce_scatter_single(o, x)
        return _done(outputs)

    _reduce_scatter_base = reduce_scatter_single
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced


def _create(store, rank: int, world_size: int, timeout) -> LocalCopyProcessGroup:
    return LocalCopyProcessGroup(rank, world_size)


def init(world_size: int) -> None:
    """Start the default process group as rank 0 of ``world_size`` ranks on
    :class:`LocalCopyProcessGroup` (CPU and CUDA tensors); no store, no peers."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])
    dist.init_process_group(BACKEND, rank=0, world_size=world_size, store=FakeStore())
