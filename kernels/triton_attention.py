"""Triton kernels: causal attention of a packed varlen batch over the paged KV cache.

One kernel (``_paged_attention_kernel``) serves prefill, chunked prefill after a cached
prefix, and decode: a program owns ``BLOCK_Q`` query tokens of one sequence times the
``GROUP`` query heads of one kv head (grid: query block, kv head, KV split) and runs
FlashAttention-2's online softmax over ``BLOCK_N``-token tiles gathered through the block
table. Long contexts are split (``num_splits > 1``) and merged by ``_reduce_splits_kernel``
(Flash-Decoding). Variants: ``SLIDING`` (tiles wholly before the window are never loaded)
and ``SOFTCAP`` (``c * tanh(scores / c)`` before the mask). Same contract as
:func:`kvfleet.kernels.reference.paged_attention_torch`.

Work decomposition, masking passes and sources (FlashAttention-2, Flash-Decoding,
PagedAttention, vLLM's ``triton_unified_attention.py``): docs/performance.md, "Design notes".
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvfleet.kernels.checks import check_attention_options, check_paged_attention_args

__all__ = ["paged_attention_triton", "choose_num_splits", "launch_config", "LaunchConfig", "kernel_constexprs"]

_LOG2E = 1.4426950408889634
# Running max before any key: finite (-1e30, written inline in the kernel because compiled
# Triton only reads constexpr globals), so exp2(m_old - m_new) never computes inf - inf.


@triton.jit
def _find_seq(qsl_ptr, pid, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest s in [0, num_seqs) with qsl[s] // BLOCK_Q + s <= pid (binary search)."""
    # Typed loop-carried scalars: num_seqs may arrive as a specialised constant (e.g. 1).
    lo = tl.zeros([], dtype=tl.int32)
    hi = lo + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if start <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _softcap_log2(s, SOFTCAP: tl.constexpr):
    """``c * tanh(x / c)`` for scores ``s = x * log2(e)`` kept in the exp2 domain
    (``c = SOFTCAP``): ``tanh(t) = sign(t) * (1 - e) / (1 + e)``, ``e = exp(-2|t|)``."""
    t = s * (1.0 / (SOFTCAP * 1.4426950408889634))
    e = tl.exp2(tl.abs(t) * -2.8853900817779268)  # exp(-2|t|) = 2^(-2 log2(e) |t|)
    th = (1.0 - e) / (1.0 + e)
    return tl.where(t < 0, -th, th) * (SOFTCAP * 1.4426950408889634)


@triton.jit
def _attend_tiles(
    m_i, l_i, acc, q, q_pos, tile_lo, tile_hi, kv_start, kv_end, bt_row, k_base, v_base, d, d_ok, scale_log2e,
    window,
    stride_kb, stride_kt, stride_vb, stride_vt,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL_MASK: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Online-softmax update of (m_i, l_i, acc) over KV tiles [tile_lo, tile_hi).

    With ``CAUSAL_MASK`` every score outside ``(q_pos - window, q_pos]`` (the window only
    when ``SLIDING``) and past ``kv_end`` is masked; without it the caller guarantees that
    every key of these tiles is visible to every valid row. With ``SLIDING``, keys before
    ``kv_start`` (the first row's window start) are not loaded at all, so block-table entries
    freed behind the window (the cache manager's null block) are never read, even in the
    tile that straddles the window's lower edge."""
    n = tl.arange(0, BLOCK_N)
    for tile in range(tile_lo, tile_hi):
        j = tile * BLOCK_N + n  # key positions of this tile
        j_ok = j < kv_end
        if SLIDING:
            j_ok = j_ok & (j >= kv_start)
        blk = tl.load(bt_row + j // BLOCK_SIZE, mask=j_ok, other=0).to(tl.int64)
        off = (j % BLOCK_SIZE).to(tl.int64)
        kv_mask = j_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + blk[:, None] * stride_kb + off[:, None] * stride_kt + d[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(v_base + blk[:, None] * stride_vb + off[:, None] * stride_vt + d[None, :],
                    mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2e
        if SOFTCAP > 0:
            s = _softcap_log2(s, SOFTCAP)
        if CAUSAL_MASK:
            visible = (j[None, :] <= q_pos[:, None]) & j_ok[None, :]
            if SLIDING:
                visible = visible & (j[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    qsl_ptr,
    scale_log2e,
    num_seqs,
    num_heads,
    num_splits,
    tiles_per_split,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq(qsl_ptr, pid, num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    q_block = pid - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # tokens cached before this step's chunk

    r = tl.arange(0, BLOCK_M)
    q_tok = q_block * BLOCK_Q + r // GROUP  # index of the query token within its sequence
    head = kv_head * GROUP + r % GROUP
    row_ok = (r < BLOCK_Q * GROUP) & (q_tok < q_len)
    q_pos = context_len + q_tok  # absolute position: attends to keys [0, q_pos]
    d = tl.arange(0, HEAD_PAD)
    # Masks along head_size only when it is padded: a row-only mask keeps the loads
    # vectorised (16-byte accesses) instead of one predicated load per element.
    if HEAD_PAD == HEAD_SIZE:
        d_ok = tl.full([HEAD_PAD], 1, dtype=tl.int1)
    else:
        d_ok = d < HEAD_SIZE
    tok = (q_start + q_tok).to(tl.int64)

    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(k_cache_ptr.dtype.element_ty)
    if UPCAST:
        q = q.to(tl.float32)

    # Keys this query block can see: [0, kv_end), or [first_pos - window + 1, kv_end).
    kv_end = context_len + tl.minimum(q_len, (q_block + 1) * BLOCK_Q)
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    first_pos = context_len + q_block * BLOCK_Q  # position of the block's first query row
    if SLIDING:
        # Tiles before the first row's window are never loaded; from tile `in_window` on,
        # every key is inside the last row's window (kv_end - 1 - window < key), hence all rows'.
        kv_start = tl.maximum(first_pos - window + 1, 0)
        tile_start = kv_start // BLOCK_N
        in_window = tl.cdiv(tl.maximum(kv_end - window, 0), BLOCK_N)
    else:
        kv_start = 0
        tile_start = 0
        in_window = 0
    tile_lo = tile_start + split * tiles_per_split
    # The last split takes every remaining tile, so a low max_seq_len hint costs balance only.
    tile_hi = tl.where(split == num_splits - 1, num_tiles, tl.minimum(tile_lo + tiles_per_split, num_tiles))

    # Every valid row sees keys [0, first row's position]: tiles wholly inside need no mask.
    first_masked_tile = (first_pos + 1) // BLOCK_N
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    # Two passes over this split's tiles (as FlashAttention's causal kernels do): tiles left
    # of the diagonal without the causal mask, then the rest with it; with a sliding window
    # a first masked pass over the tiles that straddle the window's lower edge.
    lo = tile_lo
    if SLIDING:
        lo = tl.maximum(tl.minimum(in_window, tile_hi), tile_lo)
        m_i, l_i, acc = _attend_tiles(
            m_i, l_i, acc, q, q_pos, tile_lo, lo, kv_start, kv_end, bt_row, k_base, v_base, d, d_ok, scale_log2e,
            window, stride_kb, stride_kt, stride_vb, stride_vt,
            BLOCK_SIZE, BLOCK_N, True, PRECISION, UPCAST, SLIDING, SOFTCAP,
        )
    mid = tl.maximum(tl.minimum(first_masked_tile, tile_hi), lo)
    m_i, l_i, acc = _attend_tiles(
        m_i, l_i, acc, q, q_pos, lo, mid, kv_start, kv_end, bt_row, k_base, v_base, d, d_ok, scale_log2e, window,
        stride_kb, stride_kt, stride_vb, stride_vt,
        BLOCK_SIZE, BLOCK_N, False, PRECISION, UPCAST, SLIDING, SOFTCAP,
    )
    m_i, l_i, acc = _attend_tiles(
        m_i, l_i, acc, q, q_pos, mid, tile_hi, kv_start, kv_end, bt_row, k_base, v_base, d, d_ok, scale_log2e, window,
        stride_kb, stride_kt, stride_vb, stride_vt,
        BLOCK_SIZE, BLOCK_N, True, PRECISION, UPCAST, SLIDING, SOFTCAP,
    )

    if SPLIT:
        # Partials: acc [T, H, S, HEAD_PAD], (m, l) [T, H, S, 2]; every split writes, even
        # an empty one (m = -1e30, l = 0), so the reduce never reads garbage.
        ph = (tok * num_heads + head) * num_splits + split
        tl.store(part_acc_ptr + ph[:, None] * HEAD_PAD + d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + ph * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + ph * 2 + 1, l_i, mask=row_ok)
    else:
        o = acc / tl.where(row_ok, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def _reduce_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    num_heads,
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    sp_ok = sp < num_splits
    base = (tok * num_heads + head) * num_splits
    m = tl.load(part_ml_ptr + (base + sp) * 2, mask=sp_ok, other=float("-inf"))
    l_sp = tl.load(part_ml_ptr + (base + sp) * 2 + 1, mask=sp_ok, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.exp2(m - m_max)
    denom = tl.sum(w * l_sp, axis=0)
    d = tl.arange(0, HEAD_PAD)
    acc = tl.load(part_acc_ptr + (base + sp)[:, None] * HEAD_PAD + d[None, :], mask=sp_ok[:, None], other=0.0)
    o = tl.sum(acc * w[:, None], axis=0) / denom
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_SIZE)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 4  # interpreter: a small pretend machine, so tests still exercise splitting


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_num_splits(num_q_programs: int, max_seq_len: int, block_n: int, device: torch.device,
                      min_tokens_per_split: int = 256, max_splits: int = 64, num_sms: int | None = None) -> int:
    """How many KV splits: enough programs to cover ~2 waves of the GPU's SMs, but at
    least ``min_tokens_per_split`` keys per split (the reduce and the partials cost
    memory traffic) and at most ``max_splits``."""
    if num_q_programs <= 0 or max_seq_len <= 0:
        return 1
    want = -(-2 * (num_sms or _num_sms(device)) // num_q_programs)
    cap = max(1, max_seq_len // max(min_tokens_per_split, block_n))
    return int(max(1, min(want, cap, max_splits)))


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and grid of one :func:`paged_attention_triton` call."""

    head_pad: int  # head_size rounded up to a power of two (>= 16)
    block_m: int  # rows per program: block_q query tokens x GROUP query heads, padded
    block_q: int  # query tokens per program
    block_n: int  # keys per KV tile
    num_splits: int  # KV splits (Flash-Decoding) per query block
    num_q_programs: int  # grid axis 0 (upper bound on query blocks of the packed batch)
    num_warps: int
    num_stages: int = 2  # software pipelining depth of the KV loop (cp.async double buffering)


def launch_config(num_tokens: int, num_seqs: int, num_heads: int, num_kv_heads: int, head_size: int, *,
                  max_query_len: int | None, max_seq_len: int | None, device: torch.device,
                  num_splits: int | None = None, block_n: int | None = None,
                  num_sms: int | None = None, sliding_window: int | None = None) -> LaunchConfig:
    """Choose tiles and splits (pure function of the shapes; also used by the GPU check to
    print what ran). ``max_seq_len`` is needed only when ``num_splits`` is None or > 1;
    ``num_sms`` (default: the device's multiprocessor count) sizes the splits. With a
    ``sliding_window`` the splits are sized for the keys one query block reads (at most
    ``sliding_window + block_q - 1``), not for the whole context.

    Decode-like batches (``max_query_len * group <= max(16, group)``): 16-row query tiles
    (tl.dot's minimum; more when the GQA group is larger) and 64-key tiles, 4 warps; the
    context is split when the batch has too few query blocks to fill the GPU. Prefill: 64-row
    query tiles, 64-key tiles (32 for head sizes above 128), 8 warps for head size 128 and above. Untuned defaults: see
    docs/performance.md.
    """
    group = num_heads // num_kv_heads
    head_pad = max(16, triton.next_power_of_2(head_size))
    if max_query_len is None:
        max_query_len = 1 if num_tokens <= num_seqs else num_tokens
    min_rows = max(16, triton.next_power_of_2(group))  # one query token's GROUP heads, >= tl.dot's 16
    decode_like = max_query_len * group <= min_rows
    block_m = min_rows if decode_like else max(64, min_rows)
    block_q = block_m // group
    if block_n is None:
        block_n = 64 if head_pad <= 128 else 32
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    num_q_programs = num_tokens // block_q + num_seqs
    if num_splits is None:
        span = max_seq_len or 0
        if sliding_window is not None:
            span = min(span, sliding_window + block_q - 1)
        num_splits = choose_num_splits(num_q_programs * num_kv_heads, span, block_n, device, num_sms=num_sms)
    num_splits = max(1, int(num_splits))
    num_warps = 4 if decode_like or head_pad < 128 else 8
    return LaunchConfig(head_pad, block_m, block_q, block_n, num_splits, num_q_programs, num_warps)


def kernel_constexprs(cfg: LaunchConfig, *, head_size: int, block_size: int, group: int,
                      cache_dtype: torch.dtype, interpreting: bool = False, sliding: bool = False,
                      softcap: float | None = None) -> dict:
    """The compile-time arguments of ``_paged_attention_kernel`` for one launch.

    ``sliding``: compile the sliding-window variant (the window itself is a runtime
    argument); ``softcap``: the logit cap, a compile-time constant (one variant per
    model; None or 0 compiles no capping).

    fp32 caches use IEEE fp32 dots (no TF32: the result must match the fp32 reference);
    fp16/bf16 use the tensor cores with fp32 accumulation. Under the interpreter bf16
    dots run in fp32, because the interpreter's tl.dot mishandles bf16 operands (numpy
    has no bfloat16); compiled kernels never upcast.
    """
    upcast = cache_dtype == torch.bfloat16 and interpreting
    precision = "ieee" if cache_dtype == torch.float32 or upcast else "tf32"
    return dict(
        HEAD_SIZE=head_size, HEAD_PAD=cfg.head_pad, BLOCK_SIZE=block_size, GROUP=group,
        BLOCK_Q=cfg.block_q, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SPLIT=cfg.num_splits > 1,
        PRECISION=precision, UPCAST=upcast, SLIDING=bool(sliding), SOFTCAP=float(softcap or 0.0),
    )


def paged_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None = None,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Triton version of :func:`kvfleet.kernels.reference.paged_attention_torch`: same
    arguments (including ``sliding_window`` and ``softcap``), semantics and return value
    (``[num_tokens, num_heads, head_size]`` in ``query.dtype``, fp32 accumulation).
    With a sliding window, KV tiles wholly before a query block's window are skipped
    (never loaded), so the cost per query token is bounded by the window.

    Extra keyword arguments (tuning; defaults are chosen per call):

    * ``num_splits``: KV splits per query block (Flash-Decoding); default from
      :func:`choose_num_splits` (only > 1 when the batch has few query blocks).
    * ``block_n``: keys per tile (power of two >= 16).

    Hints: ``max_seq_len`` (default ``seq_lens.max()``, one device-to-host copy) sizes
    the splits; ``max_query_len`` (default: ``1`` when ``num_tokens == num_seqs`` else
    ``num_tokens``; no copy) picks the query tile. Wrong hints cost speed, not
    correctness (a low ``max_seq_len`` makes the last split take the remaining keys).

    ``seq_lens``, ``query_start_loc`` and ``block_tables``: any integer dtype on the
    query's device (converted to int32 if needed). The caches need unit stride on
    ``head_size``.
    Raises ValueError on inconsistent shapes or invalid options.
    """
    num_seqs, num_heads, num_kv_heads, head_size, block_size = check_paged_attention_args(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc
    )
    sliding_window, softcap = check_attention_options(sliding_window, softcap)
    if scale is None:
        scale = 1.0 / math.sqrt(head_size)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    elif out.shape != query.shape:
        raise ValueError(f"out shape {tuple(out.shape)} != query shape {tuple(query.shape)}")
    num_tokens = query.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    for name, t in (("query", query), ("out", out), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride on head_size")
    # One integer type for the metadata (tiny tensors): the kernel is compiled for int32.
    block_tables = block_tables.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    query_start_loc = query_start_loc.to(torch.int32).contiguous()

    if num_splits is None or num_splits > 1:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
    cfg = launch_config(num_tokens, num_seqs, num_heads, num_kv_heads, head_size, max_query_len=max_query_len,
                        max_seq_len=max_seq_len, device=query.device, num_splits=num_splits, block_n=block_n,
                        sliding_window=sliding_window)
    head_pad, block_n = cfg.head_pad, cfg.block_n
    num_splits, num_q_programs, num_warps = cfg.num_splits, cfg.num_q_programs, cfg.num_warps
    tiles_per_split = 1 << 30  # one split: all tiles
    if num_splits > 1:
        span_tiles = -(-max_seq_len // block_n)
        if sliding_window is not None:  # tiles one query block reads, window edges unaligned
            span_tiles = min(span_tiles, -(-(sliding_window + cfg.block_q - 1) // block_n) + 1)
        tiles_per_split = -(-span_tiles // num_splits)
        part_acc = torch.empty(num_tokens, num_heads, num_splits, head_pad, dtype=torch.float32, device=query.device)
        part_ml = torch.empty(num_tokens, num_heads, num_splits, 2, dtype=torch.float32, device=query.device)
    else:
        part_acc = part_ml = out  # unused (SPLIT=False)

    meta = kernel_constexprs(cfg, head_size=head_size, block_size=block_size, group=num_heads // num_kv_heads,
                             cache_dtype=key_cache.dtype, interpreting=_interpreting(),
                             sliding=sliding_window is not None, softcap=softcap)
    grid = (num_q_programs, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        query, key_cache, value_cache, out, part_acc, part_ml,
        block_tables, seq_lens, query_start_loc,
        scale * _LOG2E, num_seqs, num_heads, num_splits, tiles_per_split, sliding_window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        **meta, num_warps=num_warps, num_stages=cfg.num_stages,
    )
    if num_splits > 1:
        _reduce_splits_kernel[(num_tokens, num_heads)](
            out, part_acc, part_ml, num_heads, num_splits, out.stride(0), out.stride(1),
            HEAD_SIZE=head_size, HEAD_PAD=head_pad, SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
        )
    return out
