"""Torch implementations of the paged-KV-cache operations.

Both the production CPU path of the engine and the oracle the Triton kernels are tested
against; vectorised (no Python loop over tokens). :func:`plan_paged_attention_torch`
computes once per step what depends only on the step's metadata; every layer's
:func:`paged_attention_torch` call reuses it (``plan=``). Cache layout (vLLM's
FlashAttention backend, see ``kvfleet.kernels``)::

    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size]
    slot = block_id * block_size + offset_in_block

Arguments are checked by :mod:`kvfleet.kernels.checks`, as in the Triton kernels. Options
(same meaning in both kernels): ``sliding_window`` (a query at ``p`` sees keys
``p - sliding_window < k <= p``) and ``softcap`` (``softcap * tanh(scores / softcap)``).
Algorithm, option semantics and sources (PagedAttention, SOSP 2023; vLLM; transformers):
docs/performance.md, "CPU path (torch)".
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F

from kvfleet.kernels.attention_plan import PagedAttentionPlan, PrefillSeq, cache_geometry, plan_paged_attention_torch
from kvfleet.kernels.checks import check_attention_options, check_paged_attention_args, check_reshape_and_cache_args

__all__ = ["paged_attention_torch", "reshape_and_cache_torch"]




def reshape_and_cache_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write this step's keys and values into the paged caches, in place.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_size]``, any float dtype (cast to the
            cache dtype on write).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``,
            contiguous, same shape and device as each other.
        slot_mapping: ``[num_tokens]`` integer tensor; token ``t`` goes to block
            ``slot_mapping[t] // block_size`` at offset ``slot_mapping[t] % block_size``.
            A negative slot (``-1``) means "skip this token" (padding): the cache is left
            untouched for it.

    Returns: None (the caches are modified in place).

    Raises:
        ValueError: on mismatched shapes or a non-contiguous cache.

    Slots are assumed unique among the non-negative entries (each token owns its slot);
    a slot ``>= num_blocks * block_size`` raises IndexError from torch.
    """
    num_tokens, num_kv_heads, head_size = check_reshape_and_cache_args(key, value, key_cache, value_cache, slot_mapping)
    if num_tokens == 0:
        return
    kc = key_cache.view(-1, num_kv_heads, head_size)
    vc = value_cache.view(-1, num_kv_heads, head_size)
    slots = slot_mapping.to(device=key_cache.device, dtype=torch.long)
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots = slots[keep]
        key = key[keep]
        value = value[keep]
    kc.index_copy_(0, slots, key.to(kc.dtype))
    vc.index_copy_(0, slots, value.to(vc.dtype))




def _softcapped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float
) -> torch.Tensor:
    """``softmax(mask(softcap * tanh(q k^T * scale / softcap))) v`` with broadcasting batch
    dimensions (SDPA has no soft-capping). ``q [..., M, d]``, ``k, v [..., L, d]``,
    ``mask`` bool broadcastable to ``[..., M, L]`` (True = attend)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v)


def _sdpa_supports_gqa() -> bool:
    import inspect

    try:
        return "enable_gqa" in inspect.signature(F.scaled_dot_product_attention).parameters
    except (TypeError, ValueError):  # builtin without a signature: probe it
        try:
            x = torch.zeros(1, 2, 1, 4)
            F.scaled_dot_product_attention(x, x[:, :1], x[:, :1], enable_gqa=True)
            return True
        except TypeError:
            return False


_HAS_GQA = _sdpa_supports_gqa()


_local = threading.local()


def _gather_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A per-thread scratch buffer of at least ``numel`` elements, reused across calls.

    One buffer per inference-mode state: a buffer allocated under ``torch.inference_mode()``
    (the engine's steps) is an inference tensor, which torch refuses to write outside that
    mode ("Inplace update to inference tensor outside InferenceMode"), so a call outside it
    (tests, user code after an engine ran in the same thread) gets its own buffer."""
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    key = (dtype, device, torch.is_inference_mode_enabled())
    buf = bufs.get(key)
    if buf is None or buf.numel() < numel:
        buf = bufs[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def _decode_batch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: PagedAttentionPlan,
    scale: float,
    softcap: float | None,
    out: torch.Tensor,
) -> None:
    """Attend the plan's decode sequences (one query token each) into ``out``: chunk by
    chunk, gather the blocks into a reused per-thread buffer as a padded ``[n, kvh, L, d]``
    view and make one SDPA call with the plan's additive mask; GQA as ``q: [n, kvh, group, d]``
    (docs/performance.md, "CPU path (torch)")."""
    num_blocks, block_size, kvh, d = key_cache.shape
    num_heads = query.shape[1]
    group = num_heads // kvh
    D = plan.decode_rows.shape[0]
    q_all = query.index_select(0, plan.decode_rows).view(D, kvh, group, d)
    if q_all.dtype != torch.float32:
        q_all = q_all.float()
    o_all = torch.empty(D, kvh, group, d, dtype=q_all.dtype, device=query.device)
    per_block = block_size * kvh * d
    contiguous = key_cache.is_contiguous() and value_cache.is_contiguous()
    if contiguous:
        kflat = key_cache.view(num_blocks, per_block)
        vflat = value_cache.view(num_blocks, per_block)
        buf = _gather_buffer(plan.buffer_numel, key_cache.dtype, key_cache.device)
        ptr = buf.data_ptr()
    for c in plan.chunks:
        i, n, nb = c.start, c.n, c.nb
        L = nb * block_size
        if contiguous:
            views = c.views  # one read: another thread may replace it (its views, its buffer)
            if views is None or views[0] != ptr:
                m = n * nb * per_block
                kbuf, vbuf = buf[:m].view(n * nb, per_block), buf[m:2 * m].view(n * nb, per_block)
                views = c.views = (ptr, kbuf, vbuf, kbuf.view(n, L, kvh, d).transpose(1, 2),
                                   vbuf.view(n, L, kvh, d).transpose(1, 2))  # K, V: [n, kvh, L, d]
            _, kbuf, vbuf, k, v = views
            torch.index_select(kflat, 0, c.idx, out=kbuf)
            torch.index_select(vflat, 0, c.idx, out=vbuf)
        else:
            k = key_cache[c.idx].view(n, L, kvh, d).transpose(1, 2)  # [n, kvh, L, d]
            v = value_cache[c.idx].view(n, L, kvh, d).transpose(1, 2)
        if k.dtype != torch.float32:
            k, v = k.float(), v.float()
        if softcap is None:
            o_all[i:i + n] = F.scaled_dot_product_attention(q_all[i:i + n], k, v, attn_mask=c.additive, scale=scale)
        else:
            o_all[i:i + n] = _softcapped_attention(q_all[i:i + n], k, v, c.valid, scale, softcap)
    out.index_copy_(0, plan.decode_rows, o_all.view(D, num_heads, d).to(out.dtype))


def _prefill_one(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    p: PrefillSeq,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of ``q`` ([q_len, H, d], the last q_len positions of the sequence)
    over the sequence's cached keys in the plan's blocks ``p.blocks`` (only those that hold
    keys inside the first query's window when there is a sliding window). Returns
    [q_len, H, d] in fp32 (or q's dtype when that is fp32)."""
    _, block_size, kvh, d = key_cache.shape
    q_len, num_heads, _ = q.shape
    group = num_heads // kvh
    nbk = p.blocks.shape[0]
    L = p.L
    k = key_cache[p.blocks].view(nbk * block_size, kvh, d)[:L].transpose(0, 1)  # [kvh, L, d]
    v = value_cache[p.blocks].view(nbk * block_size, kvh, d)[:L].transpose(0, 1)
    if q.dtype != torch.float32:
        q = q.float()
    if k.dtype != torch.float32:  # a cache in another dtype than the activations (--kv-cache-dtype)
        k, v = k.float(), v.float()
    mask, causal = p.mask, p.causal
    if softcap is not None:
        if mask is None:
            mask = torch.ones(q_len, L, dtype=torch.bool, device=q.device).tril()
        # [kvh, group, q_len, d] against [kvh, 1, L, d]: GQA by broadcasting, no K/V copies.
        qh = q.view(q_len, kvh, group, d).permute(1, 2, 0, 3)
        o = _softcapped_attention(qh, k.unsqueeze(1), v.unsqueeze(1), mask, scale, softcap)
        return o.permute(2, 0, 1, 3).reshape(q_len, num_heads, d)
    if _HAS_GQA:
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
            attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True,
        )[0]  # [H, q_len, d]
        return o.transpose(0, 1)
    # Older torch: fold the query heads of one kv head into the query-length dimension.
    qh = q.reshape(q_len, kvh, group, d).permute(1, 2, 0, 3).reshape(kvh, group * q_len, d)
    if mask is None:
        mask = torch.ones(q_len, L, dtype=torch.bool, device=q.device).tril()
    o = F.scaled_dot_product_attention(
        qh.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask.repeat(group, 1), scale=scale
    )[0]
    return o.view(kvh, group, q_len, d).permute(2, 0, 1, 3).reshape(q_len, num_heads, d)


def paged_attention_torch(
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
    sliding_window: int | None = None,
    softcap: float | None = None,
    plan: PagedAttentionPlan | None = None,
) -> torch.Tensor:
    """Causal attention of a packed varlen batch of query tokens over a paged KV cache.

    Args:
        query: ``[num_tokens, num_heads, head_size]``; the query tokens of sequence ``s``
            are rows ``query_start_loc[s]:query_start_loc[s+1]``.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``; must
            already hold this step's keys/values (call ``reshape_and_cache`` first). Their dtype
            may differ from the query's (a bf16 cache beside float32 activations,
            ``--kv-cache-dtype``): the gathered keys and values are widened to float32.
        block_tables: ``[num_seqs, max_blocks]`` integer (int32), physical block ids of
            each sequence in logical order; entries past a sequence's last block do not
            affect the result but must be valid block ids (e.g. 0 padding), because the
            torch decode path gathers them before masking.
        seq_lens: ``[num_seqs]`` integer, context length of each sequence in tokens
            INCLUDING this step's new query tokens.
        query_start_loc: ``[num_seqs + 1]`` int32, cumulative query-token offsets
            (``query_start_loc[0] == 0``, ``query_start_loc[-1] == num_tokens``).
        scale: softmax scale; default ``1/sqrt(head_size)``.
        max_query_len, max_seq_len: optional hints (unused here; the Triton path uses them
            to size its grid without a device-to-host copy).
        out: optional ``[num_tokens, num_heads, head_size]`` tensor to write into.
        sliding_window: None (default) for full causal attention, or the window in tokens
            (``>= 1``): a query at position ``p`` attends only to keys at positions
            ``p - sliding_window < k <= p`` (transformers' ``sliding_window_overlay``).
            Blocks wholly before the window are not read (they must be valid block ids).
        softcap: None (default) or ``> 0``: attention logits become
            ``softcap * tanh(scale * q.k / softcap)`` before masking and softmax
            (Gemma 2's ``attn_logit_softcapping``).
        plan: optional :class:`PagedAttentionPlan` from :func:`plan_paged_attention_torch`
            for the same ``block_tables`` / ``seq_lens`` / ``query_start_loc`` and
            ``sliding_window`` (the engine plans once per step and passes it to every
            layer); None plans here. The result is the same either way.

    Semantics: query token ``i`` of sequence ``s`` (``q_len_s`` tokens) sits at position
    ``seq_lens[s] - q_len_s + i`` and attends to keys at positions ``[0, pos]`` (causal,
    bottom-right aligned), or ``(pos - sliding_window, pos]`` with a window. Grouped-query
    attention: query head ``h`` uses kv head ``h // (num_heads // num_kv_heads)``.
    Sequences with ``q_len_s == 0`` contribute no rows. Scores, softmax and the weighted
    sum are computed in fp32.

    Cache slots that no sequence has written must hold finite values (allocate caches
    with ``torch.zeros``, as the engine does): the decode path reads whole blocks and
    masks the tail, and ``0 * NaN`` is NaN. The Triton kernel never reads those slots.

    Returns: ``[num_tokens, num_heads, head_size]`` in ``query.dtype`` (``out`` if given).

    Raises: ValueError on inconsistent shapes (see ``check_paged_attention_args``),
    invalid options (see ``check_attention_options``), or a ``plan`` made for another
    batch, cache geometry or ``sliding_window``.
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
    if query.shape[0] == 0 or num_seqs == 0:
        return out
    if plan is None:
        plan = plan_paged_attention_torch(block_tables, seq_lens, query_start_loc, key_cache,
                                          sliding_window=sliding_window)
    elif (plan.num_seqs, plan.num_tokens, plan.geometry, plan.sliding_window) != (
            num_seqs, query.shape[0], cache_geometry(key_cache), sliding_window):
        raise ValueError(
            f"plan made for {plan.num_seqs} sequences, {plan.num_tokens} tokens, cache geometry "
            f"{plan.geometry[:4]} and sliding_window={plan.sliding_window}; this call has {num_seqs}, "
            f"{query.shape[0]}, {cache_geometry(key_cache)[:4]} and {sliding_window}"
        )
    if plan.chunks:
        _decode_batch(query, key_cache, value_cache, plan, scale, softcap, out)
    for p in plan.prefill:
        out[p.a:p.b] = _prefill_one(query[p.a:p.b], key_cache, value_cache, p, scale, softcap).to(out.dtype)
    return out
