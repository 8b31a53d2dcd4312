"""Test and benchmark helpers: random paged batches and a naive dense attention oracle.

Used by ``tests/unit/kernels/``, ``benchmarks/kernels_cpu.py`` and
``benchmarks/gpu_check.py``; importing it does not import triton.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

__all__ = ["PagedBatch", "make_paged_batch", "naive_attention", "poison_before_window", "TOLERANCES", "triton_kernels",
           "record_calls"]

TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    # (atol, rtol) of a kernel against the torch reference, inputs ~N(0, 1), scale 1/sqrt(d).
    # fp32: both accumulate in fp32, only summation order differs.
    torch.float32: (1e-5, 1e-5),
    # fp16: Q/K/V and the output are rounded to fp16 (unit roundoff 4.9e-4); the Triton
    # kernel also rounds the softmax probabilities to fp16 before P@V, as FlashAttention does.
    torch.float16: (2e-3, 2e-3),
    # bf16: unit roundoff 3.9e-3, same argument.
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


@dataclass
class PagedBatch:
    """A packed varlen batch over a randomly filled paged KV cache.

    ``keys[s]`` / ``values[s]`` hold sequence ``s``'s whole context densely
    (``[seq_len, num_kv_heads, head_size]``) for the naive oracle. ``new_keys`` /
    ``new_values`` / ``slot_mapping`` are this step's tokens (the last ``q_len`` of each
    sequence), already written into the cache.
    """

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    slot_mapping: torch.Tensor
    new_keys: torch.Tensor
    new_values: torch.Tensor
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    scale: float = 0.125

    @property
    def attn_args(self) -> tuple:
        """Positional arguments of ``paged_attention``."""
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
                self.query_start_loc, self.scale)

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max()) if self.seq_lens.numel() else 0


def make_paged_batch(
    seqs: list[tuple[int, int]],
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_size: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    shuffle: bool = True,
    spare_blocks: int = 3,
    garbage: float = 100.0,
    max_blocks: int | None = None,
) -> PagedBatch:
    """Build a batch of sequences given as ``(seq_len, q_len)`` pairs.

    Each sequence gets ``ceil(seq_len / block_size)`` physical blocks, a random
    permutation of the pool when ``shuffle`` (so blocks are neither contiguous nor in
    order), plus ``spare_blocks`` unused ones. Every slot that no sequence owns (tails of
    last blocks, spare blocks) holds values of magnitude ``garbage`` so a kernel that
    reads past a sequence's end gives a visibly wrong answer. Block-table entries past a
    sequence's last block point at a spare block, for the same reason.

    Returns a :class:`PagedBatch` on ``device``; the cache already contains every token.
    """
    if any(q > L or L < 0 or q < 0 for L, q in seqs):
        raise ValueError(f"need 0 <= q_len <= seq_len for every sequence, got {seqs}")
    g = torch.Generator().manual_seed(seed)
    nblk = [(L + block_size - 1) // block_size for L, _ in seqs]
    num_blocks = sum(nblk) + spare_blocks + 1
    width = max(max(nblk, default=1), 1) if max_blocks is None else max_blocks
    perm = torch.randperm(num_blocks, generator=g)  # drawn either way: same data with and without shuffle
    order = perm if shuffle else torch.arange(num_blocks)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = (torch.rand(shape, generator=g) * 2 - 1) * garbage
    value_cache = (torch.rand(shape, generator=g) * 2 - 1) * garbage
    spare = int(order[-1])
    block_tables = torch.full((len(seqs), width), spare, dtype=torch.int32)
    keys, values, slots, new_k, new_v = [], [], [], [], []
    used = 0
    for s, (L, q) in enumerate(seqs):
        blocks = order[used:used + nblk[s]]
        used += nblk[s]
        block_tables[s, : nblk[s]] = blocks.to(torch.int32)
        k = torch.randn(L, num_kv_heads, head_size, generator=g).to(dtype)
        v = torch.randn(L, num_kv_heads, head_size, generator=g).to(dtype)
        pos = torch.arange(L)
        sl = blocks[pos // block_size] * block_size + pos % block_size
        key_cache.view(-1, num_kv_heads, head_size)[sl] = k.float()
        value_cache.view(-1, num_kv_heads, head_size)[sl] = v.float()
        keys.append(k)
        values.append(v)
        slots.append(sl[L - q:])
        new_k.append(k[L - q:])
        new_v.append(v[L - q:])
    q_lens = torch.tensor([q for _, q in seqs], dtype=torch.int32)
    qsl = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q_lens, 0)
    num_tokens = int(qsl[-1])
    query = torch.randn(num_tokens, num_heads, head_size, generator=g).to(dtype)
    empty = torch.zeros(0, num_kv_heads, head_size, dtype=dtype)
    dev = torch.device(device)
    return PagedBatch(
        query=query.to(dev),
        key_cache=key_cache.to(dtype).to(dev),
        value_cache=value_cache.to(dtype).to(dev),
        block_tables=block_tables.to(dev),
        seq_lens=torch.tensor([L for L, _ in seqs], dtype=torch.int32, device=dev),
        query_start_loc=qsl.to(dev),
        slot_mapping=(torch.cat(slots) if slots else torch.zeros(0, dtype=torch.long)).to(dev),
        new_keys=(torch.cat(new_k) if new_k else empty).to(dev),
        new_values=(torch.cat(new_v) if new_v else empty).to(dev),
        keys=keys,
        values=values,
        scale=head_size ** -0.5,
    )


def naive_attention(batch: PagedBatch, *, sliding_window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """Dense causal attention, one sequence at a time, straight from the definition:
    ``softmax(Q K^T * scale + causal mask) V`` in fp64 on CPU, with K/V repeated per query
    head for GQA. With ``sliding_window`` the query at position ``p`` sees only keys
    ``max(0, p - sliding_window + 1) .. p`` (transformers' ``sliding_window_overlay``:
    ``kv_idx > q_idx - sliding_window``); with ``softcap`` the scores become
    ``softcap * tanh(scores / softcap)`` (Gemma 2). Returns ``[num_tokens, num_heads,
    head_size]`` fp64 (CPU)."""
    q_all = batch.query.detach().cpu().double()
    qsl = batch.query_start_loc.tolist()
    outs = []
    for s, (k, v) in enumerate(zip(batch.keys, batch.values)):
        a, b = qsl[s], qsl[s + 1]
        q = q_all[a:b]  # [q_len, H, d]
        L, q_len = k.shape[0], b - a
        group = q.shape[1] // k.shape[1]
        kk = k.double().repeat_interleave(group, dim=1)  # [L, H, d]
        vv = v.double().repeat_interleave(group, dim=1)
        out = torch.empty(q_len, q.shape[1], q.shape[2], dtype=torch.float64)
        for i in range(q_len):
            pos = L - q_len + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for h in range(q.shape[1]):
                scores = (kk[lo: pos + 1, h] @ q[i, h]) * batch.scale  # [pos + 1 - lo]
                if softcap is not None:
                    scores = softcap * torch.tanh(scores / softcap)
                p = torch.softmax(scores, dim=0)
                out[i, h] = p @ vv[lo: pos + 1, h]
        outs.append(out)
    if not outs:
        return torch.zeros(0, batch.query.shape[1], batch.query.shape[2], dtype=torch.float64)
    return torch.cat(outs)


def poison_before_window(batch: PagedBatch, sliding_window: int, align: int) -> int:
    """Fill with NaN every cache block (keys and values) that holds only positions before
    ``floor(lo / align) * align``, where ``lo = max(0, first_query_pos - sliding_window + 1)``
    is the lowest key any of the sequence's query tokens may see. A kernel that skips the
    blocks (tiles of ``align`` keys) outside the window is unaffected; one that loads them
    and merely masks the scores gives NaN (``0 * NaN`` in ``P @ V``). Returns the number of
    blocks poisoned (so a test can check it poisoned something).
    """
    block_size = batch.key_cache.shape[1]
    qsl = batch.query_start_loc.tolist()
    poisoned = 0
    for s, L in enumerate(batch.seq_lens.tolist()):
        q_len = qsl[s + 1] - qsl[s]
        if q_len == 0:
            continue
        lo = max(0, L - q_len - sliding_window + 1) // align * align
        for i in range(lo // block_size):
            blk = int(batch.block_tables[s, i])
            batch.key_cache[blk] = float("nan")
            batch.value_cache[blk] = float("nan")
            poisoned += 1
    return poisoned


@contextlib.contextmanager
def triton_kernels(interpret: bool):
    """Context manager: import (or re-import) the Triton kernel modules, interpreted when
    ``interpret``; yields ``(triton_cache_module, triton_attention_module)``.

    The interpreter flag is read when ``triton.jit`` decorates a kernel, when triton is
    first imported (its library functions), and by modules triton imports lazily at the
    first launch, so ``TRITON_INTERPRET=1`` stays set for the whole ``with`` block and is
    restored afterwards. Raises RuntimeError when triton was already imported in compiled
    mode in this process (then run the caller in its own process, or export the variable).
    """
    import importlib
    import os
    import sys

    old = os.environ.get("TRITON_INTERPRET")
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        mods = []
        for name in ("kvfleet.kernels.triton_cache", "kvfleet.kernels.triton_attention"):
            mod = sys.modules.get(name)
            mods.append(importlib.reload(mod) if mod is not None else importlib.import_module(name))
        if interpret:
            import triton.language.standard as std

            if type(std.cdiv).__name__ != "InterpretedFunction":
                raise RuntimeError(
                    "triton was imported in this process before TRITON_INTERPRET=1 was set, so its "
                    "library functions are compiled-mode only: run the interpreter tests in their own "
                    "pytest process, or export TRITON_INTERPRET=1"
                )
        yield mods[0], mods[1]
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


def record_calls(monkeypatch, owner, name: str) -> list[dict]:
    """Replace ``owner.name`` (a module attribute) with a wrapper that calls the original
    and records each call's keyword arguments; return the (live) list of those dicts.

    ``monkeypatch`` is pytest's fixture: the original is restored at the end of the test.
    Tests use it to check that a kernel or planner actually ran, and with which options
    (e.g. ``[c.get("sliding_window") for c in calls]``)."""
    calls: list[dict] = []
    real = getattr(owner, name)

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, recording)
    return calls
