"""The engine's paged attention, plugged into transformers' attention-function registry.

``register()`` adds ``"kvfleet_paged"`` to ``transformers.AttentionInterface``. A model whose
``config._attn_implementation`` is that name (set by the model runner) calls
:func:`paged_attention_forward` in every attention layer, so any Llama/Qwen2/Mistral-style
transformers model runs on the engine's packed, unpadded batch (``input_ids [1, T]``,
per-token ``position_ids``). No attention mask is built; the per-step
:class:`AttentionMetadata` reaches the layers as the forward keyword ``kvfleet_attn``.
Supported: causal attention, GQA/MQA, the module's ``scaling``, per-layer sliding windows
(:func:`layer_sliding_windows`) and logit soft-capping. For the compiled forward
(:mod:`kvfleet.runtime.worker.compilation`) the KV write and attention are one registered custom
op, ``torch.ops.kvfleet.unified_attention(query, key, value, layer, scale, softcap)``, that
reads the step's metadata from :func:`forward_context` (so a graph has no metadata inputs);
the forward then passes ``kvfleet_op=True`` instead of ``kvfleet_attn``. :func:`check_attention_support`
refuses other configs with a ValueError naming the field; :func:`probe_attention` refuses at
load what only a forward call shows. Details: docs/engine.md, "How a step runs".
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvfleet.kernels import paged_attention, reshape_and_cache, select_backend
from kvfleet.kernels.attention_plan import PagedAttentionPlan, plan_paged_attention_torch
from kvfleet.kernels.reference import paged_attention_torch, reshape_and_cache_torch

ATTN_IMPLEMENTATION = "kvfleet_paged"
"""Name under which the paged attention is registered in ``transformers.AttentionInterface``."""

METADATA_KWARG = "kvfleet_attn"
"""Keyword argument of the model's forward that carries :class:`AttentionMetadata`."""

OP_KWARG = "kvfleet_op"
"""Keyword argument (``True``) of the model's forward that routes every attention layer through
the ``kvfleet::unified_attention`` custom op, which reads :func:`forward_context`."""


@dataclass
class AttentionMetadata:
    """Everything the attention layers need for one forward pass over a packed batch.

    ``T`` = tokens in the step, ``B`` = sequences in the step.

    Attributes:
        slot_mapping: ``[T]`` int64, cache slot (``block_id * block_size + offset``) where
            each new token's K/V is written.
        block_tables: ``[B, max_blocks]`` int32, physical block ids of each sequence in
            logical order (rows padded with 0 past a sequence's last block).
        seq_lens: ``[B]`` int32, context length of each sequence after this step (tokens
            already cached + this step's tokens).
        query_start_loc: ``[B + 1]`` int32, offsets of each sequence's tokens in the batch.
        max_query_len: longest per-sequence chunk of new tokens, as a Python int.
        max_seq_len: longest ``seq_lens`` entry, as a Python int.
        kv_caches: per layer, ``(key_cache, value_cache)`` each of shape
            ``[num_blocks, block_size, num_kv_heads, head_size]`` (layout of
            :mod:`kvfleet.kernels`), indexed by the attention module's ``layer_idx``.
        sliding_windows: per layer, the sliding window in tokens or None (full causal
            attention), from :func:`layer_sliding_windows`; None (the default) means no
            layer has a window unless transformers passes ``sliding_window``.
        calls: number of attention-layer calls made with this metadata (the probe counts
            them).
        num_actual_tokens: tokens of the step that are real; the rest of the batch (a CUDA
            graph's padding up to its captured size) is neither written (``slot_mapping``
            -1) nor attended. None: all of them.

    On the torch (CPU) attention path, :meth:`torch_plan` keeps one
    :class:`~kvfleet.kernels.attention_plan.PagedAttentionPlan` per sliding window and cache
    geometry in the plain attribute ``_torch_plans`` (not a dataclass field, so
    ``dataclasses.replace`` / ``fields`` copies of the metadata start without it): the
    step's gather chunks, block ids and masks are computed by the first layer and reused
    by the others. The attention backend (``kvfleet.kernels.select_backend``) is likewise
    chosen by the first layer (attribute ``_backend``).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    sliding_windows: list[int | None] | None = None
    calls: int = 0
    num_actual_tokens: int | None = None

    def torch_plan(self, key_cache: torch.Tensor, sliding_window: int | None) -> PagedAttentionPlan:
        """The step's :func:`~kvfleet.kernels.attention_plan.plan_paged_attention_torch` for
        caches shaped like ``key_cache`` and this ``sliding_window``, computed on first use
        and shared by every layer that asks for the same one."""
        plans = self.__dict__.setdefault("_torch_plans", {})
        key = (sliding_window, tuple(key_cache.shape[1:]), key_cache.element_size(), key_cache.device)
        plan = plans.get(key)
        if plan is None:
            plan = plans[key] = plan_paged_attention_torch(
                self.block_tables, self.seq_lens, self.query_start_loc, key_cache, sliding_window=sliding_window
            )
        return plan


# Keyword arguments some transformers attention modules pass that add terms to the scores
# or select keys: none is implemented by the paged kernels (value: what it is, for errors).
_UNSUPPORTED_KWARGS = {
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
    "position_bias": "an additive position bias",
    "indices": "sparse (indexed) attention",
    "block_indices": "sparse (block-indexed) attention",
}


def _as_window(value) -> int | None:
    """A config/keyword sliding window as an int >= 1, or None for "no window" (None, 0)."""
    if value is None or value is False or value == 0:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"sliding_window={value!r}: expected a positive integer or null")
    return int(value)


def layer_sliding_windows(config) -> list[int | None]:
    """Per decoder layer, the sliding window (tokens) or None, as transformers' mask
    selection reads the config: with ``layer_types``, ``sliding_window`` on the
    ``"sliding_attention"`` layers and none on the ``"full_attention"`` ones (Qwen2, Gemma
    2/3, Cohere2, ...); without it, ``sliding_window`` on every layer (Mistral, Phi-3,
    Starcoder2: ``create_sliding_window_causal_mask`` when ``config.sliding_window`` is set).

    Args:
        config: a transformers config (the text config of a multimodal one).

    Returns: ``num_hidden_layers`` entries.

    Raises:
        ValueError: a ``layer_types`` entry other than ``full_attention`` /
            ``sliding_attention``, a ``sliding_attention`` layer without a positive
            ``sliding_window``, or a ``layer_types`` of the wrong length.
    """
    num_layers = config.num_hidden_layers
    window = _as_window(getattr(config, "sliding_window", None))
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return [window] * num_layers
    layer_types = list(layer_types)
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for num_hidden_layers={num_layers}")
    out: list[int | None] = []
    for i, kind in enumerate(layer_types):
        if kind == "full_attention":
            out.append(None)
        elif kind == "sliding_attention":
            if window is None:
                raise ValueError(f"layer_types[{i}] is 'sliding_attention' but sliding_window is not set")
            out.append(window)
        else:
            raise ValueError(
                f"layer_types[{i}]={kind!r}: kvfleet's paged attention implements only 'full_attention' and "
                "'sliding_attention' layers"
            )
    return out


def check_attention_support(config) -> list[int | None]:
    """Refuse a model config that uses an attention feature the paged attention does not
    implement, rather than serve wrong tokens; return the per-layer sliding windows.

    Refused (the ValueError names the config field): ``is_encoder_decoder``,
    ``add_cross_attention`` / ``cross_attention_layers`` (cross-attention), ALiBi
    (``alibi``, ``use_alibi``, ``attn_config.alibi``, ``position_embedding_type='alibi'``,
    ``model_type='bloom'``), multi-head latent attention (``kv_lora_rank``), chunked
    attention (``attention_chunk_size``), bidirectional attention
    (``use_bidirectional_attention``, ``is_causal=False``), KV sharing across layers
    (``num_kv_shared_layers``), GPT-Neo style ``attention_layers`` with local layers, and
    ``layer_types`` other than full/sliding attention (see :func:`layer_sliding_windows`).
    Implemented, hence accepted: ``sliding_window``, ``attn_logit_softcapping``,
    ``query_pre_attn_scalar`` (through the module's ``scaling``), and
    ``final_logit_softcapping`` (applied by the model's forward).

    Args:
        config: a transformers ``PretrainedConfig`` (multimodal ones are checked on their
            text config too).

    Returns: :func:`layer_sliding_windows` of the text config.

    Raises:
        ValueError: naming the field and the model type.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(config, "model_type", "?")

    def refuse(field: str, value, what: str) -> None:
        where = "" if field == "model_type" else f"model_type={model_type!r}: "
        raise ValueError(
            f"{where}{field}={value!r} ({what}) is not implemented by kvfleet's paged "
            "attention; refusing the model rather than serving wrong tokens"
        )

    for cfg in {id(config): config, id(text): text}.values():
        if getattr(cfg, "is_encoder_decoder", False):
            refuse("is_encoder_decoder", True, "an encoder-decoder model with cross-attention")
        if getattr(cfg, "add_cross_attention", False):
            refuse("add_cross_attention", True, "cross-attention")
        if getattr(cfg, "cross_attention_layers", None):
            refuse("cross_attention_layers", cfg.cross_attention_layers, "cross-attention")
        for field in ("alibi", "use_alibi"):
            if getattr(cfg, field, False) is True:
                refuse(field, True, "ALiBi position biases")
        attn_config = getattr(cfg, "attn_config", None)
        alibi = attn_config.get("alibi") if isinstance(attn_config, dict) else getattr(attn_config, "alibi", None)
        if alibi:
            refuse("attn_config.alibi", alibi, "ALiBi position biases")
        if getattr(cfg, "position_embedding_type", None) == "alibi":
            refuse("position_embedding_type", "alibi", "ALiBi position biases")
        if getattr(cfg, "model_type", None) == "bloom":
            refuse("model_type", "bloom", "ALiBi position biases")
        if getattr(cfg, "kv_lora_rank", None):
            refuse("kv_lora_rank", cfg.kv_lora_rank, "multi-head latent attention (MLA)")
        if getattr(cfg, "attention_chunk_size", None):
            refuse("attention_chunk_size", cfg.attention_chunk_size, "chunked local attention")
        if getattr(cfg, "use_bidirectional_attention", False):
            refuse("use_bidirectional_attention", True, "non-causal attention")
        if getattr(cfg, "is_causal", True) is False:
            refuse("is_causal", False, "non-causal attention")
        if getattr(cfg, "num_kv_shared_layers", 0):
            refuse("num_kv_shared_layers", cfg.num_kv_shared_layers, "layers that reuse another layer's KV cache")
        layers = getattr(cfg, "attention_layers", None)
        if isinstance(layers, (list, tuple)) and any(kind != "global" for kind in layers):
            refuse("attention_layers", list(layers), "local attention layers")
    try:
        return layer_sliding_windows(text)
    except ValueError as e:
        raise ValueError(f"model_type={model_type!r}: {e}; refusing the model rather than serving wrong tokens") from e


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention function with transformers' calling convention, over the paged KV cache.

    Args:
        module: the attention module; its ``layer_idx`` selects the layer's cache.
        query: ``[1, num_heads, T, head_size]`` (rotary embedding already applied).
        key, value: ``[1, num_kv_heads, T, head_size]``, this step's new keys/values.
        attention_mask: ignored (always None here, see the module docstring).
        scaling: softmax scale (the module's, e.g. ``head_size ** -0.5``).
        dropout: must be 0 (inference only).
        kvfleet_attn: the step's :class:`AttentionMetadata` (keyword argument).

    Writes the new K/V into the layer's cache at ``slot_mapping`` with
    ``kvfleet.kernels.reshape_and_cache``, then attends each query token over its
    sequence's cached tokens (causally) with ``kvfleet.kernels.paged_attention`` (on the
    torch backend: ``paged_attention_torch`` with the step's plan from
    :meth:`AttentionMetadata.torch_plan`, made by the first layer and reused by the others).

    Returns: ``(attn_output, None)`` with ``attn_output`` of shape
    ``[1, T, num_heads, head_size]`` (what transformers' attention modules expect).

    Keyword arguments transformers passes and that are honoured: ``sliding_window`` (must
    match the layer's entry of ``kvfleet_attn.sliding_windows`` when that is set) and
    ``softcap``. Anything that changes the scores otherwise (``attention_mask``,
    ``is_causal=False``, ``s_aux``/``sinks``, ``position_bias``, sparse ``indices``) raises.

    Raises:
        RuntimeError: called without ``kvfleet_attn`` (the model was run outside the
            engine after the engine switched its attention implementation) or with a
            batch dimension other than 1.
        ValueError: an attention feature the paged kernels do not implement (see above),
            a ``sliding_window`` that disagrees with the config, dropout in training, or
            keys and values of different head sizes (MLA).
    """
    meta: AttentionMetadata | None = kwargs.get(METADATA_KWARG)
    if meta is None and kwargs.get(OP_KWARG):
        return _op_attention(module, query, key, value, scaling, kwargs)
    if meta is None:
        raise RuntimeError(
            f"attention implementation {ATTN_IMPLEMENTATION!r} needs the {METADATA_KWARG}= forward "
            "argument: this model is owned by a kvfleet engine (load another copy for plain use)"
        )
    if query.shape[0] != 1:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} runs packed batches of shape [1, T]; got batch {query.shape[0]}")
    meta.calls += 1
    layer = module.layer_idx
    sliding_window, softcap = _layer_options(module, layer, meta, attention_mask, dropout, kwargs)
    if key.shape[-1] != value.shape[-1]:
        raise ValueError(
            f"layer {layer}: key head size {key.shape[-1]} != value head size {value.shape[-1]} "
            "(multi-head latent attention?) is not implemented by kvfleet's paged attention"
        )
    q = query[0].transpose(0, 1)  # [T, num_heads, head_size]
    k = key[0].transpose(0, 1)  # [T, num_kv_heads, head_size]
    v = value[0].transpose(0, 1)
    return attend(meta, layer, q, k, v, scaling, sliding_window, softcap).unsqueeze(0), None


def attend(meta: AttentionMetadata, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           scaling: float | None, sliding_window: int | None, softcap: float | None) -> torch.Tensor:
    """Write layer ``layer``'s new keys/values (``[T, num_kv_heads, head_size]``) into its
    cache and attend ``q`` (``[T, num_heads, head_size]``) over it; returns ``[T, num_heads,
    head_size]``. Rows past ``meta.num_actual_tokens`` (padding) are written nowhere and come
    back as zeros (CPU) or unspecified values (CUDA), never sampled."""
    key_cache, value_cache = meta.kv_caches[layer]
    backend = meta.__dict__.get("_backend") or meta.__dict__.setdefault("_backend", select_backend(q.device))
    if backend == "torch":
        # The CPU path: the step's plan (gather chunks, block ids, masks) is computed once
        # and shared by all layers (see AttentionMetadata.torch_plan); the backend is
        # chosen once per step too.
        reshape_and_cache_torch(k, v, key_cache, value_cache, meta.slot_mapping)
        n = meta.num_actual_tokens
        qn = q if n is None or n == q.shape[0] else q[:n]
        out = paged_attention_torch(
            qn, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scaling,
            sliding_window=sliding_window, softcap=softcap, plan=meta.torch_plan(key_cache, sliding_window),
        )
        if qn is not q:
            out = torch.cat([out, out.new_zeros((q.shape[0] - n, *out.shape[1:]))])
        return out
    reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
    return paged_attention(
        q,
        key_cache,
        value_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        scaling,
        max_query_len=meta.max_query_len,
        max_seq_len=meta.max_seq_len,
        sliding_window=sliding_window,
        softcap=softcap,
    )


_context = threading.local()


@contextmanager
def forward_context(meta: AttentionMetadata) -> Iterator[AttentionMetadata]:
    """Make ``meta`` the step's metadata for ``kvfleet::unified_attention`` calls made in this
    thread inside the ``with`` block (vLLM v1's forward context): the compiled graph takes no
    metadata input, so it neither guards nor recompiles on it."""
    prev = getattr(_context, "meta", None)
    _context.meta = meta
    try:
        yield meta
    finally:
        _context.meta = prev


def get_forward_context() -> AttentionMetadata:
    """The metadata set by :func:`forward_context`; RuntimeError outside one."""
    meta = getattr(_context, "meta", None)
    if meta is None:
        raise RuntimeError("kvfleet::unified_attention called outside forward_context(): no attention metadata")
    return meta


@torch.library.custom_op("kvfleet::unified_attention", mutates_args=())
def unified_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float,
                      softcap: float) -> torch.Tensor:
    """Custom op: :func:`attend` for layer ``layer`` with the metadata of
    :func:`forward_context`; ``query [T, num_heads, head_size]``, ``key``/``value`` ``[T,
    num_kv_heads, head_size]``, ``softcap`` 0 for none; returns ``[T, num_heads, head_size]``.
    Opaque to dynamo (one graph covers every layer); it writes the layer's KV cache, which is
    not an argument (the cache lives in the forward context, like vLLM's ``unified_attention``)."""
    meta = get_forward_context()
    window = meta.sliding_windows[layer] if meta.sliding_windows is not None else None
    out = attend(meta, layer, query, key, value, scale, window, softcap or None)
    # A custom op's output may not alias its inputs.
    return out.clone() if out.data_ptr() == query.data_ptr() else out


@unified_attention.register_fake
def _(query, key, value, layer, scale, softcap):
    return torch.empty_like(query)


def _op_attention(module, query, key, value, scaling, kwargs) -> tuple[torch.Tensor, None]:
    """The compiled forward's attention call (see :data:`OP_KWARG`); the layer's options were
    checked by :func:`probe_attention` at load time."""
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    softcap = float(kwargs.get("softcap") or 0.0)
    scale = float(scaling) if scaling is not None else float(q.shape[-1]) ** -0.5
    out = torch.ops.kvfleet.unified_attention(q, k, v, module.layer_idx, scale, softcap)
    return out.unsqueeze(0), None


def _layer_options(module, layer: int, meta: AttentionMetadata, attention_mask, dropout, kwargs) -> tuple:
    """``(sliding_window, softcap)`` of one attention call; ValueError for what the paged
    kernels do not implement."""
    where = f"layer {layer} ({type(module).__name__})"
    if attention_mask is not None:
        raise ValueError(f"{where}: received an attention mask; kvfleet's paged attention builds none and "
                         "cannot apply one (custom masks are not implemented)")
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        raise ValueError(f"{where}: non-causal attention (is_causal=False) is not implemented")
    for name, what in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"{where}: received {name}= ({what}), which kvfleet's paged attention does not implement")
    if dropout:
        raise ValueError(f"{where}: attention dropout {dropout} (training) is not implemented; call model.eval()")
    passed = _as_window(kwargs.get("sliding_window"))
    if meta.sliding_windows is None:
        window = passed
    else:
        window = meta.sliding_windows[layer]
        if passed is not None and passed != window:
            raise ValueError(
                f"{where}: transformers passed sliding_window={passed} but the config gives this layer "
                f"{window} (layer_types/sliding_window); refusing rather than guessing"
            )
    softcap = kwargs.get("softcap")
    return window, (float(softcap) if softcap else None)


@torch.inference_mode()
def probe_attention(model: torch.nn.Module, *, num_kv_heads: int, head_size: int, block_size: int,
                    sliding_windows: list[int | None], device: torch.device, dtype: torch.dtype) -> None:
    """Run two tokens through ``model`` (already switched to ``kvfleet_paged``) over a
    throw-away one-block cache, so that every attention layer's call is checked (see
    :func:`paged_attention_forward`) at load time, before any request.

    Args:
        model: the causal LM; ``sliding_windows``: :func:`layer_sliding_windows` of its
            config (one entry per layer); the rest: the KV cache geometry.

    Raises:
        ValueError: a layer received something the paged attention does not implement, or
            the number of attention calls differs from the number of layers (a layer that
            bypasses transformers' attention registry would attend without the cache).
    """
    num_layers = len(sliding_windows)
    shape = (1, max(block_size, 2), num_kv_heads, head_size)
    caches = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
              for _ in range(num_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(2, device=device),
        block_tables=torch.zeros((1, 1), dtype=torch.int32, device=device),
        seq_lens=torch.tensor([2], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, 2], dtype=torch.int32, device=device),
        max_query_len=2,
        max_seq_len=2,
        kv_caches=caches,
        sliding_windows=sliding_windows,
    )
    ids = torch.zeros((1, 2), dtype=torch.long, device=device)
    pos = torch.arange(2, device=device).unsqueeze(0)
    model(input_ids=ids, position_ids=pos, logits_to_keep=1, use_cache=False, **{METADATA_KWARG: meta})
    if meta.calls != num_layers:
        raise ValueError(
            f"{type(model).__name__}: {meta.calls} attention calls for {num_layers} layers: some layers do not go "
            "through transformers' attention-function registry, so kvfleet's paged attention cannot serve it"
        )


_registered = False


def register() -> str:
    """Register :func:`paged_attention_forward` with transformers (idempotent).

    Returns: the implementation name to put in ``config._attn_implementation``.
    """
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
        _registered = True
    return ATTN_IMPLEMENTATION
