"""Tensor parallelism inside the fused C step: the all-reduce that ``kernels/cpu_tp.h`` calls after
each layer's o and down projections, over a ``torch.distributed`` process group.

Under tensor parallelism each rank's :class:`~kvfleet.kernels.cpu_decoder.FusedDecoder` holds its
shard (its query and KV heads of q|k|v and of the caches, its MLP channels of gate|up, the
matching input columns of o and down); o's and down's products are the rank's partial sums of
the sublayer's output. :class:`AllReduce` is the callback the C step calls with that partial
output ``[M, H]`` (``kv_decoder.all_reduce``): a ctypes ``CFUNCTYPE`` whose body views the C buffer
as a float32 tensor (no copy) and sums it over the group in place. Every rank must step alike
(the same rows, the same decoder layout), as transformers' own tensor-parallel forward does.

Summation order (batch invariance): with two ranks ``dist.all_reduce`` (SUM) adds ``a + b`` per
element, the same bits whatever the step's rows. With more ranks gloo's ring all-reduce adds each
chunk of the buffer in a different rank order, and a row's chunk depends on the step's row count,
so there the partials are all-gathered and added in rank order (``world`` times the traffic, but
each element's sum is the same for every batch).

A failure inside the callback (a dead peer, a closed group) is kept in :attr:`AllReduce.error`
and the callback returns -1: the C step stops and :meth:`FusedDecoder.step` raises it
(:class:`TensorParallelStepError`); the ranks are then out of step.
"""

from __future__ import annotations

import ctypes

import torch
import torch.distributed as dist

CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64)
"""``int64_t (*)(float *buf, int64_t n)``: ``kv_decoder.all_reduce`` (cpu_decoder.h)."""


class TensorParallelStepError(RuntimeError):
    """A fused step's all-reduce failed (the cause chained); the ranks are out of step."""


class AllReduce:
    """The C step's all-reduce over ``group`` (None: the default process group).

    Attributes:
        world: the group's ranks.
        calls: all-reduces run so far (two per layer per step; a test's evidence that a step ran
            fused under tensor parallelism).
        error: the exception of the last failed call, or None.
    """

    def __init__(self, group=None) -> None:
        if not dist.is_initialized():
            raise ValueError("tensor parallelism in the fused step needs an initialised torch.distributed group")
        self.group = group
        self.world = dist.get_world_size(group)
        self.calls = 0
        self.error: BaseException | None = None
        self._fn = CALLBACK(self._call)   # kept alive as long as the decoder points to it

    @property
    def address(self) -> int:
        """The callback's address, for ``kv_decoder.all_reduce``."""
        return ctypes.cast(self._fn, ctypes.c_void_p).value

    def reduce(self, t: torch.Tensor) -> None:
        """Sum the float32 tensor ``t`` over the group, in place, in a fixed order per element."""
        if self.world == 1:
            return
        if self.world == 2:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
            return
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t, group=self.group)
        t.copy_(parts[0])
        for part in parts[1:]:
            t.add_(part)

    def _call(self, address: int, n: int) -> int:
        try:
            self.reduce(torch.frombuffer((ctypes.c_float * n).from_address(address), dtype=torch.float32))
            self.calls += 1
            return 0
        except BaseException as exc:  # never unwind through C: the step stops and raises it
            self.error = exc
            return -1
