"""The step-invariant part of the torch paged attention (:mod:`kvfleet.kernels.reference`).

:func:`plan_paged_attention_torch` derives, from a step's metadata alone (block tables, sequence
lengths, query bounds, the cache's geometry), which sequences decode and in which order, their
gather chunks with block ids and masks, and the prefill sequences' blocks and masks: a
:class:`PagedAttentionPlan` that every layer's ``paged_attention_torch(..., plan=)`` call of the
step reuses (why: docs/performance.md, "One plan per step").
"""

from __future__ import annotations

import torch

from kvfleet.kernels.checks import check_attention_options

__all__ = ["DecodeChunk", "PagedAttentionPlan", "PrefillSeq", "cache_geometry", "plan_paged_attention_torch"]

# Decode sequences are attended in chunks whose gathered K+V take at most this many bytes
# (fits a CPU's L2/L3; measured: docs/performance.md, "CPU path (torch)").
_DECODE_CHUNK_BYTES = 4 << 20


class DecodeChunk:
    """One gather chunk of decode sequences: rows ``start:start + n`` of the plan's decode
    order, ``nb`` blocks each (``L = nb * block_size`` keys), their physical block ids
    ``idx`` (``[n * nb]`` int64, sequence-major) and the keys each one sees ``valid``
    (``[n, 1, 1, L]`` bool, True = attend). ``additive`` is the same mask as SDPA applies a
    boolean one (``0`` / ``-inf`` float32, ``torch.where(valid, 0, -inf)``), built on first
    use and shared by the layers."""

    __slots__ = ("start", "n", "nb", "idx", "valid", "_additive", "views")

    def __init__(self, start: int, n: int, nb: int, idx: torch.Tensor, valid: torch.Tensor) -> None:
        self.start, self.n, self.nb, self.idx, self.valid = start, n, nb, idx, valid
        self._additive: torch.Tensor | None = None
        # (buffer data_ptr, K rows, V rows, K [n, kvh, L, d], V [n, kvh, L, d]) views of the
        # gather buffer the last call used: the next layers reuse them (same buffer).
        self.views: tuple | None = None

    @property
    def additive(self) -> torch.Tensor:
        if self._additive is None:
            self._additive = torch.zeros(self.valid.shape, dtype=torch.float32, device=self.valid.device)
            self._additive.masked_fill_(~self.valid, float("-inf"))
        return self._additive


class PrefillSeq:
    """One prefill sequence: query rows ``a:b``, the physical blocks to read ``blocks``
    (``[nb]`` int64, from the first block inside the first query's window), the number of
    keys ``L`` read from them, and the mask (``[q_len, L]`` bool, or None with ``causal``
    True: SDPA's own top-left causal mask, right when there is no cached prefix)."""

    __slots__ = ("a", "b", "blocks", "L", "mask", "causal")

    def __init__(self, a, b, blocks, L, mask, causal) -> None:
        self.a, self.b, self.blocks, self.L, self.mask, self.causal = a, b, blocks, L, mask, causal


class PagedAttentionPlan:
    """Everything :func:`paged_attention_torch` derives from a step's metadata and not from
    its query or cache contents, computed once by :func:`plan_paged_attention_torch` and
    reused by every layer of the step (why: docs/performance.md, "One plan per step").

    Holds: the decode sequences' query rows in processing order (``decode_rows``, ``[D]``
    int64; sorted by decreasing block count), their gather chunks (:class:`DecodeChunk`:
    block ids and masks), the gather buffer size, and the prefill sequences
    (:class:`PrefillSeq`). Valid only for caches of the geometry it was planned for
    (``block_size``, ``num_kv_heads``, ``head_size``, element size) and for the same
    ``sliding_window``; :func:`paged_attention_torch` checks that and raises ValueError.
    """

    __slots__ = ("num_seqs", "num_tokens", "geometry", "sliding_window", "decode_rows", "chunks",
                 "buffer_numel", "prefill")

    def __init__(self, num_seqs, num_tokens, geometry, sliding_window, decode_rows, chunks, buffer_numel, prefill):
        self.num_seqs = num_seqs
        self.num_tokens = num_tokens
        self.geometry = geometry
        self.sliding_window = sliding_window
        self.decode_rows = decode_rows
        self.chunks = chunks
        self.buffer_numel = buffer_numel
        self.prefill = prefill


def cache_geometry(key_cache: torch.Tensor) -> tuple:
    """``(block_size, num_kv_heads, head_size, element size, device)`` of a cache."""
    _, block_size, kvh, d = key_cache.shape
    return (block_size, kvh, d, key_cache.element_size(), key_cache.device)


def plan_paged_attention_torch(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    key_cache: torch.Tensor,
    *,
    sliding_window: int | None = None,
) -> PagedAttentionPlan:
    """Precompute the step-invariant part of :func:`paged_attention_torch` (which sequences
    decode, their order, gather chunks, block ids and masks; the prefill sequences' blocks
    and masks) so that several calls with the same metadata (one per layer) share it.

    Args:
        block_tables, seq_lens, query_start_loc: as for :func:`paged_attention_torch`
            (``[num_seqs, max_blocks]``, ``[num_seqs]``, ``[num_seqs + 1]`` integers).
        key_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, any layer's
            cache (only its geometry, dtype size and device are used).
        sliding_window: None or the window in tokens (``>= 1``), as the calls will pass it.

    Returns: a :class:`PagedAttentionPlan` to pass as ``plan=``.

    Raises:
        ValueError: invalid ``sliding_window``, a decode sequence with ``seq_len < 1``, or a
            sequence shorter than its query tokens.
    """
    sliding_window, _ = check_attention_options(sliding_window, None)
    geometry = cache_geometry(key_cache)
    num_seqs = block_tables.shape[0]
    q_bounds = query_start_loc.tolist()
    lens_l = seq_lens.tolist()
    num_tokens = int(q_bounds[-1]) if q_bounds else 0
    decode = [s for s in range(num_seqs) if q_bounds[s + 1] - q_bounds[s] == 1]
    prefill_ids = [s for s in range(num_seqs) if q_bounds[s + 1] - q_bounds[s] > 1]
    decode_rows, chunks, buffer_numel = None, [], 0
    if decode:
        decode_rows, chunks, buffer_numel = _plan_decode(decode, block_tables, seq_lens, q_bounds, lens_l, geometry,
                                                         sliding_window)
    prefill = _plan_prefill(prefill_ids, block_tables, q_bounds, lens_l, geometry, sliding_window)
    return PagedAttentionPlan(num_seqs, num_tokens, geometry, sliding_window, decode_rows, chunks, buffer_numel,
                              prefill)


def _plan_decode(decode: list[int], block_tables: torch.Tensor, seq_lens: torch.Tensor, q_bounds: list[int],
                 lens_l: list[int], geometry, sliding_window: int | None
                 ) -> tuple[torch.Tensor, list[DecodeChunk], int]:
    """The decode sequences' part of the plan: their batch rows (most blocks first), the gather
    chunks and the gather buffer's size in elements."""
    block_size, kvh, d, elem, dev = geometry
    if min(lens_l[s] for s in decode) < 1:
        raise ValueError("a decode sequence (1 query token) must have seq_len >= 1")
    # Blocks each one reads: all of them, or from its window's first key's block on.
    first = None
    if sliding_window is not None:
        first = {s: max(0, lens_l[s] - sliding_window) // block_size for s in decode}
    nblocks = {s: -(-lens_l[s] // block_size) - (first[s] if first else 0) for s in decode}
    # Most blocks first, so each chunk is padded only to its own widest sequence:
    # sorting bounds the padding of ragged batches.
    decode = sorted(decode, key=lambda s: nblocks[s], reverse=True)
    order_nblocks = [nblocks[s] for s in decode]
    D = len(decode)
    order_t = torch.tensor(decode, dtype=torch.long, device=dev)
    decode_rows = torch.tensor([q_bounds[s] for s in decode], dtype=torch.long, device=dev)
    max_nb = order_nblocks[0]
    lens_all = seq_lens.to(device=dev, dtype=torch.long).index_select(0, order_t)  # [D]
    positions = torch.arange(max_nb * block_size, device=dev)
    bt = block_tables.to(dev).index_select(0, order_t).long()
    if first is None:
        bt_all = bt[:, :max_nb]  # [D, max_nb]
        first_pos = None
    else:
        fb = torch.tensor([first[s] for s in decode], dtype=torch.long, device=dev)
        cols = (fb.unsqueeze(1) + torch.arange(max_nb, device=dev)).clamp_(max=block_tables.shape[1] - 1)
        bt_all = bt.gather(1, cols)  # [D, max_nb]
        first_pos = fb * block_size  # [D] absolute position of each gathered row's first key
    per_block = block_size * kvh * d
    chunk_blocks = max(1, _DECODE_CHUNK_BYTES // (2 * per_block * max(elem, 4)))
    buffer_numel = 2 * max(chunk_blocks, max_nb) * per_block
    chunks: list[DecodeChunk] = []
    i = 0
    while i < D:
        nb = order_nblocks[i]
        n = min(D - i, max(1, chunk_blocks // nb))
        L = nb * block_size
        seq_len = lens_all[i:i + n].unsqueeze(1)  # [n, 1]
        if first_pos is None:
            valid = positions[:L].unsqueeze(0) < seq_len  # [n, L]
        else:
            pos = first_pos[i:i + n].unsqueeze(1) + positions[:L].unsqueeze(0)  # [n, L]
            # The query sits at seq_len - 1 and sees keys seq_len - 1 - W < pos <= seq_len - 1.
            valid = (pos < seq_len) & (pos >= seq_len - sliding_window)
        idx = bt_all[i:i + n, :nb].reshape(-1).contiguous()
        chunks.append(DecodeChunk(i, n, nb, idx, valid.view(n, 1, 1, L)))
        i += n
    return decode_rows, chunks, buffer_numel


def _plan_prefill(prefill_ids: list[int], block_tables: torch.Tensor, q_bounds: list[int], lens_l: list[int],
                  geometry, sliding_window: int | None) -> list[PrefillSeq]:
    """The part of the plan of the sequences with several query tokens: blocks and masks."""
    block_size, dev = geometry[0], geometry[4]
    prefill: list[PrefillSeq] = []
    for s in prefill_ids:
        a, b = q_bounds[s], q_bounds[s + 1]
        q_len, seq_len = b - a, lens_l[s]
        if seq_len < q_len:
            raise ValueError(f"seq_lens[{s}]={seq_len} is shorter than its {q_len} query tokens")
        prefix = seq_len - q_len
        nb = (seq_len + block_size - 1) // block_size
        # First block to read: the block of the first query's lowest visible key.
        kb = 0 if sliding_window is None else max(0, prefix - sliding_window + 1) // block_size
        first_key = kb * block_size
        blocks = block_tables[s, kb:nb].to(device=dev, dtype=torch.long)
        if prefix == 0 and sliding_window is None:
            mask, causal = None, True  # SDPA's causal mask is top-left aligned: right when L == q_len
        else:
            # Query token i sits at position prefix + i and sees keys [0, prefix + i] (within the window).
            pos = torch.arange(prefix, seq_len, device=dev).unsqueeze(1)  # [q_len, 1]
            kpos = torch.arange(first_key, seq_len, device=dev).unsqueeze(0)  # [1, L]
            mask = kpos <= pos  # [q_len, L]
            if sliding_window is not None:
                mask &= kpos > pos - sliding_window
            causal = False
        prefill.append(PrefillSeq(a, b, blocks, seq_len - first_key, mask, causal))
    return prefill
