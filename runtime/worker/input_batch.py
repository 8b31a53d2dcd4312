"""The model runner's persistent input batch: a step's tensors built with little Python.

As vLLM v1's ``InputBatch`` / ``BlockTable``: each request keeps a row of a persistent host
block table (numpy ``int32 [rows, max_blocks]``) while it is scheduled step after step; a step
writes only the block ids a request gained since its previous step (usually none, one every
``block_size`` tokens), not its whole table, and builds the step's ``block_tables [B,
max_blocks]`` with one gather of its rows. A row is rewritten when its request was preempted
since (recompute: new blocks), when its table shrank, or, for a model with a sliding window
(out-of-window entries become the null block), whenever the table changed. A request that is
not scheduled in a step gives its row back (it gets a new one, written in full, when it comes
back), so rows never outlive their requests and no finished-request bookkeeping is needed.

:func:`build_inputs` is the stateless construction (the previous ``ModelRunner.prepare_inputs``),
kept as the reference the persistent batch must equal (tests/unit/runtime/worker/test_input_batch.py) and for
callers without a runner. Both give the same arrays: ``input_ids [T]``, ``positions [T]``,
``slot_mapping [T]`` int64, ``block_tables [B, max_blocks]`` (rows padded with 0),
``seq_lens [B]``, ``query_start_loc [B + 1]``, ``logits_indices [S]`` (the last token of each
request that samples; with speculative drafts, its last ``1 + k`` tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvfleet.runtime.worker.attention import AttentionMetadata
from kvfleet.runtime.worker.request_state import ScheduledRow


@dataclass
class StepArrays:
    """A step's inputs as host numpy arrays (see the module docstring for shapes)."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    logits_indices: np.ndarray
    max_query_len: int
    max_seq_len: int


def _num_logits(scheduled: list[ScheduledRow]) -> np.ndarray:
    """Rows of logits each request keeps: 0 (no sampling), 1, or ``1 + k`` with ``k`` drafts."""
    return np.fromiter((s.sample * (1 + len(s.spec_token_ids)) for s in scheduled), dtype=np.int64,
                       count=len(scheduled))


def _logits_indices(qsl: np.ndarray, num_logits: np.ndarray) -> np.ndarray:
    """The batch rows of each request's last ``num_logits[i]`` tokens, in order."""
    if num_logits.max(initial=0) <= 1:
        return qsl[1:][num_logits > 0] - 1
    ends = np.repeat(qsl[1:], num_logits)
    return ends - np.concatenate([np.arange(n, 0, -1) for n in num_logits if n])


def _token_arrays(scheduled: list[ScheduledRow], block_tables: np.ndarray, block_size: int,
                  num_new: np.ndarray, start: np.ndarray, num_logits: np.ndarray) -> StepArrays:
    num_reqs = len(scheduled)
    qsl = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(num_new, out=qsl[1:])
    total = int(qsl[-1])
    seq_lens = start + num_new
    if total == num_reqs:  # decode only: one token each, at position start
        input_ids = np.fromiter((s.token_ids[0] for s in scheduled), dtype=np.int64, count=total)
        positions = start
        slot_mapping = block_tables[np.arange(num_reqs), positions // block_size] * block_size + positions % block_size
    else:
        input_ids = np.fromiter((t for s in scheduled for t in s.token_ids), dtype=np.int64, count=total)
        req_idx = np.repeat(np.arange(num_reqs), num_new)
        positions = np.arange(total, dtype=np.int64) + np.repeat(start - qsl[:-1], num_new)
        slot_mapping = block_tables[req_idx, positions // block_size] * block_size + positions % block_size
    return StepArrays(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping.astype(np.int64, copy=False),
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=qsl,
        logits_indices=_logits_indices(qsl, num_logits),
        max_query_len=int(num_new.max()),
        max_seq_len=int(seq_lens.max()),
    )


def build_inputs(scheduled: list[ScheduledRow], block_size: int) -> StepArrays:
    """The step's arrays from scratch (no state): the reference construction."""
    num_reqs = len(scheduled)
    num_new = np.fromiter((len(s.token_ids) for s in scheduled), dtype=np.int64, count=num_reqs)
    start = np.fromiter((s.start_pos for s in scheduled), dtype=np.int64, count=num_reqs)
    nblocks = (start + num_new + block_size - 1) // block_size
    block_tables = np.zeros((num_reqs, int(nblocks.max())), dtype=np.int64)
    for i, s in enumerate(scheduled):
        n = int(nblocks[i])
        block_tables[i, :n] = s.block_ids[:n]
    return _token_arrays(scheduled, block_tables, block_size, num_new, start, _num_logits(scheduled))


class InputBatch:
    """Persistent host state of the requests scheduled step after step (their block-table rows).

    Args:
        block_size: tokens per KV block.
        sliding_window: True when some layer has a sliding window: the KV cache manager then
            replaces out-of-window table entries by the null block, so a row is compared with
            the request's table every step instead of only appended to.
        max_rows, max_blocks: initial capacity (both grow on demand).
    """

    def __init__(self, block_size: int, sliding_window: bool = False, max_rows: int = 64,
                 max_blocks: int = 64) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.table = np.zeros((max_rows, max_blocks), dtype=np.int64)
        self._rows: dict[str, int] = {}  # request id -> row
        # Per row: the Request that owns it, its num_preemptions when the row was written,
        # how many block ids the row holds (-1: none yet), and with a sliding window the ids.
        self._owner: list[object] = [None] * max_rows
        self._preemptions: list[int] = [0] * max_rows
        self._num_written: list[int] = [-1] * max_rows
        self._written: list[list[int] | None] = [None] * max_rows
        self._free: list[int] = list(range(max_rows - 1, -1, -1))

    @property
    def num_rows(self) -> int:
        """Rows held by requests (those scheduled in the last step)."""
        return len(self._rows)

    def _grow(self, rows: int, blocks: int) -> None:
        old_rows, old_blocks = self.table.shape
        new_rows, new_blocks = max(rows, old_rows), max(blocks, old_blocks)
        if (new_rows, new_blocks) == (old_rows, old_blocks):
            return
        if new_rows > old_rows:
            new_rows = max(new_rows, 2 * old_rows)
        if new_blocks > old_blocks:
            new_blocks = max(new_blocks, 2 * old_blocks)
        table = np.zeros((new_rows, new_blocks), dtype=np.int64)
        table[:old_rows, :old_blocks] = self.table
        self.table = table
        extra = new_rows - old_rows
        if extra:
            self._owner.extend([None] * extra)
            self._preemptions.extend([0] * extra)
            self._num_written.extend([-1] * extra)
            self._written.extend([None] * extra)
            self._free[:0] = range(new_rows - 1, old_rows - 1, -1)

    def _write_row(self, row: int, request, block_ids: list[int]) -> None:
        n = len(block_ids)
        if n > self.table.shape[1]:
            self._grow(0, n)
        have = self._num_written[row]
        preemptions = request.num_preemptions
        if (have < 0 or self._owner[row] is not request or preemptions != self._preemptions[row] or have > n
                or (self.sliding_window and block_ids[:have] != self._written[row])):
            self.table[row, :n] = block_ids
            self.table[row, n:] = 0
            self._owner[row] = request
            self._preemptions[row] = preemptions
        elif have < n:  # the common case: the table grew at its end (or not at all)
            self.table[row, have:n] = block_ids[have:]
        self._num_written[row] = n
        if self.sliding_window:
            self._written[row] = list(block_ids)

    def _release(self, row: int) -> None:
        self._owner[row] = None
        self._num_written[row] = -1
        self._written[row] = None
        self._free.append(row)

    def update(self, scheduled: list[ScheduledRow]) -> np.ndarray:
        """Bring the rows of ``scheduled`` up to date; return their row indices in order
        (int64). Rows of requests not scheduled now are given back."""
        old_rows = self._rows
        rows: dict[str, int] = {}
        idx = []
        for s in scheduled:
            request = s.request
            rid = request.request_id
            row = old_rows.pop(rid, None)
            if row is None:
                if not self._free:
                    self._grow(self.table.shape[0] + 1, 0)
                row = self._free.pop()
            rows[rid] = row
            idx.append(row)
            self._write_row(row, request, s.block_ids)
        for row in old_rows.values():
            self._release(row)
        self._rows = rows
        return np.fromiter(idx, dtype=np.int64, count=len(idx))

    def build(self, scheduled: list[ScheduledRow]) -> StepArrays:
        """The step's arrays (equal to :func:`build_inputs` of the same ``scheduled``)."""
        bs = self.block_size
        num_reqs = len(scheduled)
        row_idx = self.update(scheduled)
        num_new = np.fromiter((len(s.token_ids) for s in scheduled), dtype=np.int64, count=num_reqs)
        start = np.fromiter((s.start_pos for s in scheduled), dtype=np.int64, count=num_reqs)
        width = int(((start + num_new + bs - 1) // bs).max())
        block_tables = self.table[row_idx, :width]
        # Entries past a request's blocks for this step are 0 in the reference; the table may
        # hold more blocks than this step reaches (allocated ahead), so mask them.
        nblocks = (start + num_new + bs - 1) // bs
        if width and (nblocks < width).any():
            block_tables[np.arange(width) >= nblocks[:, None]] = 0
        return _token_arrays(scheduled, block_tables, bs, num_new, start, _num_logits(scheduled))

    def prepare(self, scheduled: list[ScheduledRow], kv_caches, sliding_windows, device: torch.device,
                pin: bool = False) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """The model runner's step inputs: ``(input_ids [1, T], positions [1, T],
        AttentionMetadata, logits_indices [S])`` on ``device`` (see
        ``ModelRunner.prepare_inputs``)."""
        a = self.build(scheduled)
        return to_device(a, kv_caches, sliding_windows, device, pin)


def to_device(a: StepArrays, kv_caches, sliding_windows, device: torch.device,
              pin: bool = False) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """``StepArrays`` as the forward's tensors (one copy each to a non-CPU ``device``, from
    pinned memory when ``pin``)."""

    def to_dev(x: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        t = torch.from_numpy(x).to(dtype)
        if device.type == "cpu":
            return t
        return (t.pin_memory() if pin else t).to(device, non_blocking=True)

    meta = AttentionMetadata(
        slot_mapping=to_dev(a.slot_mapping, torch.int64),
        block_tables=to_dev(a.block_tables, torch.int32),
        seq_lens=to_dev(a.seq_lens, torch.int32),
        query_start_loc=to_dev(a.query_start_loc, torch.int32),
        max_query_len=a.max_query_len,
        max_seq_len=a.max_seq_len,
        kv_caches=kv_caches,
        sliding_windows=sliding_windows,
    )
    return (
        to_dev(a.input_ids, torch.int64).unsqueeze(0),
        to_dev(a.positions, torch.int64).unsqueeze(0),
        meta,
        to_dev(a.logits_indices, torch.int64),
    )
