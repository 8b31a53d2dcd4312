"""The fused CPU decode path: steps of a dense decoder in one C call
(:mod:`kvfleet.kernels.cpu_decoder`) instead of transformers' modules: decode steps, and with
fused prefill on, prefill chunks and mixed steps too. The model's layer is read through its
family's recipe (:mod:`kvfleet.runtime.worker.recipes`, which lists the families).

:func:`build` decides once, after the KV caches exist, whether an engine can use it, and returns
a :class:`CpuDecodePath` or None (the reason is logged). It can when all of these hold:

- the model runs on the CPU in float32, the AVX2 kernels are available, ``$KVFLEET_CPU_DECODER``
  is not ``0``;
- the torch attention backend (``$KVFLEET_ATTENTION_BACKEND`` not ``triton``); under tensor parallelism
  each rank its shard, where :mod:`~kvfleet.runtime.worker.cpu_decode_tp` follows the model's plan (the
  LM head on its vocabulary rows, logits gathered); with LoRA on (``enable_lora``) the path reads the LoRA
  layers' base layers, and their slot tensors as the C step's adapter tables (:mod:`kvfleet.kernels.cpu_lora`:
  q, k, v, o, gate, up, down of the dense layers), so a step with adapter tokens runs fused too, each
  row adding its own adapter's deltas (:meth:`CpuDecodePath.lora_slots`); only a step with an adapter
  of a layer the C step has no table for (a MoE's experts or router) runs transformers' modules;
- :func:`~kvfleet.runtime.worker.recipes.recipe_for` has a recipe for the model (its reason is
  logged otherwise), the engine's per-layer sliding windows, attention scale and logit scale agree
  with the recipe's, a mixture-of-experts layer's router and experts are ones
  :func:`~kvfleet.runtime.worker.moe_experts.moe_layer` reads (Mixtral, Qwen3-MoE), and its linear
  layers (the experts' too) are plain float32 ``nn.Linear`` or kvfleet's
  :class:`~kvfleet.runtime.worker.woq_linear.Int8Linear` /
  :class:`~kvfleet.runtime.worker.woq_linear.Int4Linear` (``--quantization`` on an AVX2 CPU, or a
  packed checkpoint's layer; an act-order GPTQ layer,
  :class:`~kvfleet.runtime.worker.packed_checkpoints.PermutedInt4Linear`, as its int4 layer and its
  input permutation, which q/k/v and gate/up must share to be fused, else the path is off) /
  :class:`~kvfleet.runtime.worker.woq_linear.Bf16Linear` (bf16 weights of a float32 model,
  :func:`~kvfleet.runtime.worker.woq_linear.to_bf16_weights`);
- KV caches in float32 or bf16 (``kv_cache_dtype``; the torch path of prefill and mixed steps reads
  and writes the same cache; the runner's ``auto`` asks :func:`unsupported` whether this path will run).

Weights are not copied: each layer's q, k and v weights (and gate and up) are concatenated once into
one tensor, and the modules' own weights become views of it, so the transformers path that runs the
steps the fused one does not reads the same memory (a family that stores them fused, Phi-3's
``qkv_proj`` and ``gate_up_proj``, is read as stored). Models shared by several engines are fused
once. Norm weights are float32 copies (Gemma's ``(1 + w)`` folded in).

:meth:`CpuDecodePath.applies` says whether a step qualifies. Never with prompt logprobs or
padding rows. Otherwise:

- fused prefill off (the default with the float32 kernels; ``$KVFLEET_CPU_FUSED_PREFILL=0``): every scheduled
  sequence has exactly one new token (decode, or a one-token prompt chunk) or, with speculative
  decoding, at most ``1 + k`` (its last token and its drafts: one row each), at most
  :data:`DECODE_ROWS` rows; prefill chunks and mixed steps run transformers' modules;
- fused prefill on (the default where the matmuls run in bf16, on AMX tiles or AVX512-BF16 dot products,
  :func:`matmul_asked`; ``$KVFLEET_CPU_FUSED_PREFILL=1``, or ``CpuDecodePath(..., prefill=True)``): every step of up to
  :data:`~kvfleet.kernels.cpu_decoder.MAX_ROWS` tokens, a prompt chunk's tokens one row each like
  speculative drafts. Then every token of the engine goes through one code path whose rows are
  bitwise independent of each other (batch-invariant), prefill included, and prefill skips
  transformers' per-op overhead. On tiles a 400-token prompt took 185 ms against torch's 466; with
  the float32 kernels it was 2.2-2.6x slower than torch's prefill (oneDNN's GEMMs against the
  one-row-order sums; docs/performance.md, "Fused prefill"), hence off there.

Either way the LM head runs only on the rows that sample (``logits_indices``).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Protocol

import torch

from kvfleet.kernels import BACKEND_ENV, cpu_woq, select_backend
from kvfleet.kernels.cpu_decoder import (
    MAX_ROWS,
    DecoderWeights,
    FusedDecoder,
    Layer,
    Linear,
    resolve_matmul,
)
from kvfleet.kernels.cpu_lora import LoRATable
from kvfleet.runtime import env
from kvfleet.runtime.worker import cpu_decode_tp
from kvfleet.runtime.worker.cpu_plan import MATMUL_NAMES, CpuPlan, matrix_matmul
from kvfleet.runtime.worker.lora_layers import LoRALinear
from kvfleet.runtime.worker.moe_experts import is_moe_block, moe_layer
from kvfleet.runtime.worker.packed_checkpoints import PermutedInt4Linear
from kvfleet.runtime.worker.recipes import Recipe, recipe_for
from kvfleet.runtime.worker.woq_linear import Bf16Linear, Int4Linear, Int8GroupLinear, Int8Linear

logger = logging.getLogger(__name__)

ENV = env.CPU_DECODER.name
"""``0`` turns the fused decode path off (every step runs transformers' modules)."""
MATMUL_ENV = env.CPU_MATMUL.name
"""Where the CPU plan chose bf16 matmuls (:attr:`~kvfleet.runtime.worker.cpu_plan.CpuPlan.matmul`),
the kernels to run instead: ``float32`` (the float32 kernels: one stream is faster there on AMX
CPUs), ``avx512_bf16`` or ``amx`` (where the library and CPU have them). Unset: the plan's."""
PREFILL_ENV = env.CPU_FUSED_PREFILL.name
"""``1`` runs prefill chunks and mixed steps fused too, ``0`` never; unset: :func:`fused_prefill`'s default."""
DECODE_ROWS = 64
"""Most rows of a decode or speculative step that runs fused while fused prefill is off."""
_FUSED_ATTR = "_kvfleet_fused"


class Runner(Protocol):
    """What this module reads of :class:`~kvfleet.runtime.worker.model_runner.ModelRunner`."""

    model: torch.nn.Module
    hf_config: Any
    device: torch.device
    dtype: torch.dtype
    cpu_plan: CpuPlan | None
    tp_size: int
    lora: object | None
    sliding_windows: list[int | None] | None
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    num_heads: int
    num_kv_heads: int
    head_size: int

    @property
    def logit_scale(self) -> float: ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor: ...


def _base(module: torch.nn.Module | None) -> torch.nn.Module | None:
    """The layer whose weights the C step reads: a LoRA wrapper's base layer (its adapters' slots are
    the C step's LoRA tables, :func:`_lora_tables`), else the module itself."""
    return module.base_layer if isinstance(module, LoRALinear) else module


def _inner(module: torch.nn.Module | None) -> torch.nn.Module | None:
    """The layer holding the weights: :func:`_base`, and an act-order layer's int4 layer."""
    module = _base(module)
    return module.inner if isinstance(module, PermutedInt4Linear) else module


def _linear(module: torch.nn.Module) -> Linear | None:
    """The layer's weights in a format the C step reads (an act-order layer's with its input permutation), or None."""
    base = _base(module)
    if isinstance(base, PermutedInt4Linear):
        inner = _linear(base.inner)
        if inner is not None:
            inner.perm = base.perm.to(torch.int32).contiguous()
        return inner
    module = base
    if isinstance(module, Int8Linear):
        return Linear("int8", module.weight, module.qscale, bias=module.bias32)
    if isinstance(module, Bf16Linear):
        return Linear("bf16", module.weight, bias=module.bias32)
    if isinstance(module, Int4Linear):
        return Linear("int4", module.weight, module.qscale, module.qshift, module.group_size, module.bias32,
                      scale_d=getattr(module, "qscale_d", None), shift_d=getattr(module, "qshift_d", None))
    if isinstance(module, Int8GroupLinear):
        return Linear("int8g", module.weight, module.qscale, module.qshift, module.group_size, module.bias32,
                      high=getattr(module, "qhigh", None), scale_d=getattr(module, "qscale_d", None),
                      shift_d=getattr(module, "qshift_d", None))
    if type(module) is torch.nn.Linear:   # (tensor parallelism: a DTensor parameter's local shard)
        w = cpu_decode_tp.local(module.weight.detach())
        bias = cpu_decode_tp.local(module.bias.detach()).float().contiguous() if module.bias is not None else None
        if type(w) is torch.Tensor and w.dtype == torch.float32 and w.is_contiguous():
            return Linear("fp32", w, bias=bias)
    return None


def _lora_tables(layer: torch.nn.Module, recipe: Recipe, moe: bool) -> dict[str, LoRATable]:
    """The layer's LoRA slot tensors as the C step's tables (:mod:`kvfleet.kernels.cpu_lora`): every
    LoRA-wrapped module among q, k, v (or a stored qkv), o, gate, up (or a stored gate_up) and down
    (not an MLP of experts), each at its columns of the stacked matrix."""
    fam, attn, mlp = recipe.layer, layer.self_attn, layer.mlp
    groups = [([getattr(attn, n, None) for n in fam.qkv], ("q", "k", "v")), ([getattr(attn, fam.o, None)], ("o",))]
    if not moe:
        groups += [([getattr(mlp, n, None) for n in fam.gate_up], ("gate", "up")),
                   ([getattr(mlp, fam.down, None)], ("down",))]
    tables = {}
    for modules, parts in groups:
        n0 = 0
        for module, part in zip(modules, parts):
            if isinstance(module, LoRALinear):
                tables[part] = LoRATable(module.lora_a, module.lora_b, n0)
            n0 += module.out_features if module is not None else 0
    return tables


def _fuse(modules: list[torch.nn.Module]) -> Linear | None:
    """One :class:`Linear` over ``modules`` stacked along the output features; the modules' weights (and scales)
    become views of it. None when a module's format is not one the C step reads or the formats differ.

    Raises:
        ValueError: the modules have different input permutations (act-order GPTQ layers
            quantized with different orders: one matrix takes one)."""
    parts = [_linear(m) for m in modules]
    modules = [_inner(m) for m in modules]
    if all(p is not None and p.fmt == "int8g" for p in parts) and len({p.form[3] for p in parts}) > 1:
        parts = [cpu_woq.without_five_bit(p) for p in parts]   # int8g, 5-bit and not: all as int8 (same weights)
    if any(p is None for p in parts) or len({p.form for p in parts}) != 1:
        return None
    perms = [p.perm for p in parts]
    if any(p is not None for p in perms) and not all(p is not None and torch.equal(p, perms[0]) for p in perms):
        raise ValueError("act-order layers with different input permutations cannot be one matrix ("
                         + ", ".join("none" if p is None else "own" for p in perms) + ")")
    fmt, group = parts[0].fmt, parts[0].group
    w = torch.cat([p.w for p in parts])
    scales = cpu_woq.stack_scales(fmt, parts)   # scale, shift, high, scale_d, shift_d
    bias = None
    if any(p.bias is not None for p in parts):
        bias = torch.cat([p.bias if p.bias is not None else torch.zeros(p.shape[0]) for p in parts])
    start = 0
    for module, part in zip(modules, parts):
        end = start + part.w.shape[0]
        if fmt == "fp32":
            module.weight = torch.nn.Parameter(w[start:end], requires_grad=False)
        elif fmt == "bf16":
            module.weight = w[start:end]
        else:
            module.weight = w[start:end]
            for key, t in scales.items():
                if t is not None or getattr(module, f"q{key}", None) is not None:
                    setattr(module, f"q{key}", None if t is None else t[start:end])
        start = end
    return Linear(fmt, w, group=group, bias=bias, perm=perms[0], **scales)


def _stacked(modules: list[torch.nn.Module]) -> Linear | None:
    """One module as stored (a fused ``qkv_proj`` / ``gate_up_proj``), or several fused (:func:`_fuse`)."""
    return _linear(modules[0]) if len(modules) == 1 else _fuse(modules)


def _fused_layer(layer: torch.nn.Module, recipe: Recipe) -> tuple[Linear, Linear | None] | None:
    """``(qkv, gate_up)`` of a decoder layer (the recipe's modules), fused on first use and kept on
    the layer; ``gate_up`` None for a mixture of experts (:func:`moe_layer` reads those).

    Raises:
        ValueError: :func:`_fuse`'s (act-order layers with different permutations)."""
    cached = getattr(layer, _FUSED_ATTR, None)
    moe = is_moe_block(layer.mlp)
    qkv_mods = [getattr(layer.self_attn, n, None) for n in recipe.layer.qkv]
    gate_up_mods = [] if moe else [getattr(layer.mlp, n, None) for n in recipe.layer.gate_up]
    if any(m is None or getattr(_inner(m), "weight", None) is None for m in qkv_mods + gate_up_mods):
        return None
    if cached is not None and cached[0].w.data_ptr() == _inner(qkv_mods[0]).weight.data_ptr() \
            and (moe or cached[1].w.data_ptr() == _inner(gate_up_mods[0]).weight.data_ptr()):
        return cached
    qkv = _stacked(qkv_mods)
    gate_up = _stacked(gate_up_mods) if qkv is not None and not moe else None
    if qkv is None or (gate_up is None and not moe):
        return None
    object.__setattr__(layer, _FUSED_ATTR, (qkv, gate_up))
    return qkv, gate_up


def _norm(module: torch.nn.Module | None, offset: float) -> torch.Tensor | None:
    """An RMSNorm's weight as the C step takes it: float32, ``offset`` added (Gemma's ``1 + w``)."""
    if module is None:
        return None
    w = cpu_decode_tp.local(module.weight.detach()).float()
    return (w + offset).contiguous() if offset else w.contiguous()


def unsupported(runner: Runner) -> str | None:
    """Why this engine cannot take the fused path (None: it can)."""
    cfg = runner.hf_config
    if not env.CPU_DECODER.get():
        return f"${ENV}=0"
    if runner.device.type != "cpu" or runner.dtype != torch.float32:
        return f"it runs {runner.dtype} on {runner.device.type}, not float32 on the CPU"
    if select_backend(runner.device) != "torch":
        return f"${BACKEND_ENV} selects the {select_backend(runner.device)} attention kernels"
    recipe = recipe_for(cfg)
    if isinstance(recipe, str):
        return recipe
    if runner.tp_size > 1 and (tp_why := cpu_decode_tp.unsupported(runner, recipe)):
        return f"tensor parallelism: {tp_why}"
    windows = tuple(w or 0 for w in runner.sliding_windows or ()) or (0,) * len(recipe.windows)
    if windows != recipe.windows:
        return f"the engine's sliding windows {windows} are not the recipe's {recipe.windows}"
    if not math.isclose(runner.logit_scale, recipe.logit_scale, rel_tol=1e-4):
        return f"the model scales its logits by {runner.logit_scale:.6g}, its recipe by {recipe.logit_scale:.6g}"
    if not cpu_woq.available():
        return f"the CPU kernels are unavailable ({cpu_woq.unavailable_reason()})"
    decoder = runner.model.get_decoder()
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(decoder, name):
            return f"the decoder has no {name}"
    for i, layer in enumerate(decoder.layers):
        attn = layer.self_attn
        scaling = getattr(attn, "scaling", None)
        if scaling is None or not math.isclose(float(scaling), recipe.attn_scale, rel_tol=1e-6):
            return f"layer {i}'s attention scale {scaling} is not its recipe's {recipe.attn_scale}"
        has_qk = {getattr(attn, n, None) is not None for n in ("q_norm", "k_norm")}
        if has_qk != {recipe.layer.qk_norm != "none"}:
            return f"layer {i}'s q/k norms do not match the recipe's qk_norm {recipe.layer.qk_norm!r}"
        for position, name in recipe.layer.norms.items():
            if getattr(getattr(layer, name, None), "weight", None) is None:
                return f"layer {i} has no {name} ({position} norm)"
    return None


class CpuDecodePath:
    """The fused decoder of one engine (its KV caches) and the model modules it runs beside."""

    def __init__(self, runner: Runner, fused: FusedDecoder, prefill: bool = False, recipe: Recipe | None = None,
                 lora_modules: frozenset[str] = frozenset(), gather: cpu_decode_tp.HeadGather | None = None) -> None:
        decoder = runner.model.get_decoder()
        self._embed = decoder.embed_tokens
        self._rotary = decoder.rotary_emb
        self.recipe = recipe if recipe is not None else recipe_for(runner.hf_config)
        """The model's layer recipe (:mod:`kvfleet.runtime.worker.recipes`)."""
        self._logit_scale = runner.logit_scale
        self._softcap = self.recipe.logit_softcap
        self._fused = fused
        self._compute_logits, self._gather = runner.compute_logits, gather   # (gather: tensor parallelism's vocab)
        self.prefill = prefill
        """Whether prefill chunks and mixed steps run fused too (the module docstring)."""
        self.matmul = fused.matmul
        """The fused decoder's matmul kernels (:data:`~kvfleet.kernels.cpu_decoder.MATMULS`)."""
        self._lora = runner.lora
        self.lora_modules = lora_modules
        """The LoRA-wrapped module paths whose slot tensors the C step reads (empty without LoRA)."""

    def profile(self) -> dict[str, float]:
        """The C step's milliseconds per phase since the last call (:meth:`FusedDecoder.profile`)."""
        return self._fused.profile()

    def applies(self, num_tokens: int, num_seqs: int, prompt_logprobs: bool, padded: bool, max_query_len: int = 1,
                max_query: int = 1) -> bool:
        """Whether a step with these properties runs fused: no prompt logprobs, no padding rows,
        and with :attr:`prefill` at most ``MAX_ROWS`` tokens; without it at most ``DECODE_ROWS``
        rows, each sequence with one new token (decode) or with speculative decoding up to
        ``max_query`` (its last token and the drafts it verifies)."""
        if prompt_logprobs or padded:
            return False
        if self.prefill:
            return num_tokens <= MAX_ROWS
        return num_tokens <= DECODE_ROWS and (num_tokens == num_seqs or 1 < max_query_len <= max_query)

    def lora_slots(self, scheduled) -> torch.Tensor | None:
        """For a step with adapter tokens (``scheduled``: the runner's rows): each token's slot, ``[T]``
        int64, -1 for the base model's (the adapters put into their slots), to pass to :meth:`execute`;
        None when one of the step's adapters adapts a layer the C step has no table for (the step then
        runs transformers' modules)."""
        if self._lora is None or not self.lora_modules:
            return None
        ids = {s.request.lora_int_id for s in scheduled} - {0}
        if any(not self._lora.adapted_modules(i) <= self.lora_modules for i in ids):
            return None
        slots = self._lora.token_slots(scheduled)
        return slots[0] if slots is not None else None

    def execute(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, logits_indices: torch.Tensor,
                lora_slots: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[S, V]`` float32 of the rows ``logits_indices`` (the LM head runs on those
        only) for a step that :meth:`applies`; writes every row's key and value into the caches.
        A sequence with several new tokens (a prompt chunk, or a last token and its drafts) runs
        as that many rows, row ``j`` attending over the positions up to its own (the C step
        writes every row's key and value before any row's attention), so each row's numbers are
        those of a one-token decode at its position. ``lora_slots``: :meth:`lora_slots` (None: no
        adapter tokens)."""
        num_tokens = input_ids.shape[1]
        block_tables, seq_lens = meta.block_tables, meta.seq_lens
        if num_tokens != seq_lens.shape[0]:
            per_seq = torch.diff(meta.query_start_loc)
            block_tables = block_tables.repeat_interleave(per_seq, dim=0)
            seq_lens = (positions[0] + 1).to(torch.int32)
        x = self._embed(input_ids[0]).float()
        if self.recipe.embed_scale != 1.0:
            x = x * self.recipe.embed_scale
        x = x.contiguous()
        cos, sin = self._rope(x, positions)
        hidden, logits = self._fused.step(x, cos, sin, meta.slot_mapping.contiguous(), block_tables,
                                          seq_lens.contiguous(), logits_indices.contiguous(), lora_slots)
        if logits is None:
            return self._compute_logits(hidden.index_select(0, logits_indices))
        logits = self._gather(logits) if self._gather is not None else logits
        if self._logit_scale != 1.0:   # as the engine's compute_logits finishes the torch path's
            logits = logits * self._logit_scale
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[R, M, rotary_dim]`` (one table per recipe rope key) from the model's rotary module."""
        keys = self.recipe.rope_keys
        tables = [self._rotary(x.unsqueeze(0), positions) if key is None else
                  self._rotary(x.unsqueeze(0), positions, key) for key in keys]
        cos = torch.stack([c[0] for c, _ in tables]).float().contiguous()
        sin = torch.stack([s[0] for _, s in tables]).float().contiguous()
        return cos, sin


def matmul_asked(runner: Runner) -> str:
    """The fused decoder's matmul kernels for ``runner`` (:data:`~kvfleet.kernels.cpu_decoder.MATMULS`):
    the CPU plan's, or ``$KVFLEET_CPU_MATMUL``'s where the plan chose bf16 ones (the policy), then
    :func:`~kvfleet.kernels.cpu_decoder.resolve_matmul` (the capability: ``float32`` where the
    library or CPU lacks them; :class:`~kvfleet.kernels.cpu_decoder.FusedDecoder` applies it again
    with the model's shapes)."""
    plan = runner.cpu_plan
    if plan is None or not plan.bf16_matmuls:
        return "float32"
    return resolve_matmul(env.CPU_MATMUL.get() or plan.matmul)  # the registry checks the name


def fused_prefill(matmul: str) -> bool:
    """Whether a fused path built now runs prefill and mixed steps too: ``$KVFLEET_CPU_FUSED_PREFILL``
    (``1`` / ``0``), else where its matmuls run in bf16 (``matmul`` not ``float32``): there the
    whole step is one code path (bitwise batch-invariant from the prompt on) and faster than
    torch's prefill; with the float32 kernels the fused prefill was 2.2-2.6x slower than torch's
    (docs/performance.md, "Fused prefill"), so those engines keep prefill in torch."""
    value = env.CPU_FUSED_PREFILL.get()
    return value == "1" if value else matmul != "float32"


def build(runner: Runner) -> CpuDecodePath | None:
    """The fused decode path for ``runner`` (a :class:`~kvfleet.runtime.worker.model_runner.ModelRunner` whose KV
    caches exist), or None with the reason logged at INFO; under tensor parallelism on at every rank or none."""
    path = _build(runner)   # (agree: a gloo collective, CPU ranks only; every rank's device is alike)
    return path if runner.tp_size == 1 or runner.device.type != "cpu" or cpu_decode_tp.agree(path is not None) else None


def _build(runner: Runner) -> CpuDecodePath | None:
    tp = runner.tp_size > 1
    reason = unsupported(runner)
    decoder = runner.model.get_decoder() if reason is None else None
    recipe = recipe_for(runner.hf_config) if reason is None else None
    layers = []
    if decoder is not None:
        fam, offset = recipe.layer, recipe.layer.norm_offset
        for i, layer in enumerate(decoder.layers):
            moe = moe_layer(layer.mlp, _linear) if fam.moe and is_moe_block(layer.mlp) else None
            if isinstance(moe, str):
                reason = f"layer {i}'s mixture of experts: {moe}"
                break
            try:
                fused = _fused_layer(layer, recipe)
            except ValueError as exc:
                reason = f"layer {i}: {exc}"
                break
            o = _linear(getattr(layer.self_attn, fam.o))
            down = None if moe else _linear(getattr(layer.mlp, fam.down, None))
            o, down = cpu_decode_tp.bias_once(o, down) if tp else (o, down)
            if fused is None or o is None or (down is None and moe is None):
                reason = f"layer {i}'s linear layers are not float32, kvfleet bf16, int8 or int4 (act-order int4)"
                break
            k_cache, v_cache = runner.kv_caches[i]
            norms = {p: _norm(getattr(layer, name), offset) for p, name in fam.norms.items()}
            qk = [_norm(getattr(layer.self_attn, n), offset) if fam.qk_norm != "none" else None
                  for n in ("q_norm", "k_norm")]
            layers.append(Layer(norms.get("attn_in"), norms.get("mlp_in"), fused[0], o, fused[1], down, k_cache,
                                v_cache, norms.get("attn_out"), norms.get("mlp_out"), qk[0], qk[1],
                                recipe.windows[i], recipe.layer_rope[i], moe,
                                _lora_tables(layer, recipe, moe is not None) or None))
    if reason is not None:
        logger.info("fused CPU decode: off (%s)", reason)
        return None
    head, gather = cpu_decode_tp.head(runner, _linear) if tp else (_linear(runner.model.get_output_embeddings()), None)
    eps = float(getattr(runner.hf_config, "rms_norm_eps", 1e-6))
    weights = DecoderWeights(runner.num_heads, runner.num_kv_heads, runner.head_size, eps,
                             float(decoder.layers[0].self_attn.scaling), layers, _norm(decoder.norm, offset), head,
                             qk_norm=fam.qk_norm, act=recipe.act, rotary_dim=recipe.rotary_dim,
                             rotary_interleaved=recipe.rotary_interleaved, residual_scale=recipe.residual_scale)
    asked = matmul_asked(runner)
    if head is not None:   # the plan's per-matrix choice (the layers keep the decoder's kernels)
        head.matmul = matrix_matmul(asked, "head", head.fmt, _weights(head), _step_weights(layers, head))
    try:
        fused = FusedDecoder(weights, matmul=asked, all_reduce=cpu_decode_tp.all_reduce() if tp else None)
    except (ValueError, RuntimeError) as exc:
        logger.info("fused CPU decode: off (%s)", exc)
        return None
    tables = {id(t.a) for layer in layers for t in (layer.lora or {}).values()}
    lora_modules = frozenset(name for name, m in (runner.lora.layers.items() if runner.lora is not None else ())
                             if id(m.lora_a) in tables)
    path = CpuDecodePath(runner, fused, fused_prefill(fused.matmul), recipe, lora_modules, gather)
    cos, _ = path._rope(torch.zeros(1, fused.hidden), torch.zeros(1, 1, dtype=torch.long))
    if tuple(cos.shape) != (fused.num_ropes, 1, fused.rotary_dim):
        logger.info("fused CPU decode: off (the rotary embedding gives %s tables of width %d, the recipe "
                    "asks %d of %d)", cos.shape[0], cos.shape[-1], fused.num_ropes, fused.rotary_dim)
        return None
    prefill = path.prefill
    experts = [layer.moe for layer in layers if layer.moe is not None]
    moe = f" ({len(experts)} with {len(experts[0].gate_up)} experts, top {experts[0].top_k})" if experts else ""
    on = f" on {MATMUL_NAMES[fused.head_matmul]}" if head is not None and fused.head_matmul != fused.matmul else ""
    on += f"; tensor-parallel rank {cpu_decode_tp.rank()} of {runner.tp_size}" if tp else ""
    logger.info("fused CPU decode: on (%s, %d layers%s, weights %s, LM head %s%s, KV cache %s, matmuls %s, prefill %s)",
                recipe.family, len(layers), moe, layers[0].qkv.fmt, head.fmt if head is not None else "in torch", on,
                str(fused.cache_dtype).removeprefix("torch."), MATMUL_NAMES[fused.matmul],
                "fused" if prefill else "in torch")
    return path


def _weights(m: Linear) -> int:
    return m.shape[0] * m.shape[1]


def _step_weights(layers: list[Layer], head: Linear | None) -> int:
    """The weights a one-row step reads: every dense matrix, ``top_k`` experts' worth of each
    mixture of experts, and the head."""
    total = _weights(head) if head is not None else 0
    for layer in layers:
        total += _weights(layer.qkv) + _weights(layer.o)
        if layer.moe is not None:
            total += sum(map(_weights, layer.moe.gate_up + layer.moe.down)) * layer.moe.top_k // len(layer.moe.gate_up)
        else:
            total += _weights(layer.gate_up) + _weights(layer.down)
    return total
