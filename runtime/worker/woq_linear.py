"""Linear layers that run kvfleet's AVX2 weight-only kernels (:mod:`kvfleet.kernels.cpu_woq`).

:func:`convert_model` swaps a model's linear layers for :class:`Int8Linear` / :class:`Int4Linear`,
and :func:`to_bf16_weights` for :class:`Bf16Linear` (subclasses of ``nn.Linear``, so code that
finds layers by type or name, LoRA included, keeps working). The quantization itself is torchao's:

- ``int8``: the layer already holds torchao's ``Int8WeightOnlyConfig`` tensor (symmetric, per
  output channel); :class:`Int8Linear` keeps its ``qdata`` (as ``weight``) and ``scale``.
- ``int4``: the float weight is quantized with torchao's tinygemm parameter choice (the one its
  CPU int4 tensor uses: asymmetric, groupwise, ``W = (q - 8) * scale + zero``); the 4-bit values
  are packed in the kernel's layout. ``weight`` is then the packed ``[N, K/2]`` uint8 buffer.
- The LM head (``lm_head=True``) becomes an :class:`Int8Linear` over an untied int8 copy of the
  output embedding (the input embedding stays in the model dtype for the lookups): decode at a
  few rows reads it once per token, 4x fewer bytes than fp32.

- ``bf16`` (:func:`to_bf16_weights`, on a float32 model): each decoder linear and the LM head
  keep their weights in bf16 (half the bytes a decode step reads; rounded to nearest even, the
  only loss), activations stay float32. The LM head becomes an untied bf16 copy, as for int8.

Rows: a step of at most :data:`MAX_KERNEL_ROWS` rows runs the kernel (decode); a larger one
(prefill, large batches, where the matmul is compute-bound) dequantizes the weight into a
per-thread float32 scratch buffer (:func:`dequant_scratch`) and runs torch's matmul, or, with
``prefill_bf16`` (:func:`set_bf16_prefill`, the CPU plan's ``--no-batch-invariant`` choice), a
bf16 weight and oneDNN's native bf16 matmul.
Activations may be fp32, bf16 or fp16; the kernel computes in fp32. :class:`Bf16Linear`'s
large steps run :func:`kvfleet.kernels.cpu_woq.bf16_linear`'s choice (native bf16 matmul on
CPUs with AVX512-BF16 / AMX, else the fp32 matmul on the widened weight).
"""

from __future__ import annotations

import torch

from kvfleet.kernels import cpu_woq
from kvfleet.kernels.cpu_woq import dequant_scratch

MAX_KERNEL_ROWS = 32
"""Rows (tokens) up to which the kernel runs; above, dequantize + torch matmul (measured on an
AVX2 EPYC: the kernel is faster up to ~32 rows, docs/performance.md)."""


def _shell(cls, linear: torch.nn.Linear) -> torch.nn.Linear:
    new = cls.__new__(cls)
    torch.nn.Module.__init__(new)
    new.in_features, new.out_features = linear.in_features, linear.out_features
    return new


class Int8Linear(torch.nn.Linear):
    """``nn.Linear`` over int8 weights, per-output-channel scales (see the module docstring).

    Buffers: ``weight [N, K]`` int8 (torchao's ``qdata``), ``qscale [N]`` float32, ``bias32 [N]``
    float32 or None. ``prefill_bf16``: as :class:`Int4Linear`'s."""

    prefill_bf16 = False

    @classmethod
    def from_torchao(cls, linear: torch.nn.Linear) -> Int8Linear:
        """From a layer holding torchao's ``Int8Tensor`` weight."""
        w = linear.weight
        new = _shell(cls, linear)
        new.register_buffer("weight", w.qdata.contiguous(), persistent=False)
        new.register_buffer("qscale", w.scale.reshape(-1).float().contiguous(), persistent=False)
        bias = linear.bias
        new.register_buffer("bias32", None if bias is None else bias.detach().float().contiguous(), persistent=False)
        new.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)
        return new

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        """Quantize a float ``weight [N, K]`` symmetrically per output channel (torchao's
        ``Int8WeightOnlyConfig`` numerics); the float weight is not kept."""
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype)
        with torch.no_grad():
            lin.weight.copy_(weight)
            if bias is not None:
                lin.bias.copy_(bias)
        holder = torch.nn.Sequential(lin)
        quantize_(holder, Int8WeightOnlyConfig(set_inductor_config=False))
        return cls.from_torchao(holder[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.kvfleet.woq_int8_linear(x, self.weight, self.qscale, self.bias32)
        if x.numel() <= MAX_KERNEL_ROWS * self.in_features:
            return cpu_woq.int8_linear_unchecked(x, self.weight, self.qscale, self.bias32)
        if self.prefill_bf16:  # int8 values are exact in bf16; oneDNN's native bf16 matmul
            w = cpu_woq.bf16_scratch(*self.weight.shape).copy_(self.weight)
            y = torch.nn.functional.linear(x.to(torch.bfloat16), w).to(x.dtype) * self.qscale.to(x.dtype)
        else:
            w = dequant_scratch(*self.weight.shape).copy_(self.weight)  # int8 values as floats
            y = torch.nn.functional.linear(x, w.to(x.dtype)) * self.qscale.to(x.dtype)
        return y if self.bias32 is None else y + self.bias32.to(x.dtype)


class Int4Linear(torch.nn.Linear):
    """``nn.Linear`` over groupwise int4 weights (see the module docstring).

    ``prefill_bf16``: steps of more than :data:`MAX_KERNEL_ROWS` rows run oneDNN's native bf16
    matmul (set by :func:`set_bf16_prefill`).

    Buffers: ``weight [N, K/2]`` uint8 (packed, :func:`kvfleet.kernels.cpu_woq.pack_int4`),
    ``qscale`` and ``qshift [N, K/G]`` float32 (or both float16: GGUF Q4_0 / Q4_1's own ``d``, ``m``; or
    factored: int8 factors of ``qscale_d`` / ``qshift_d [N, K/S]`` float16, GGUF Q4_K as stored; else
    those are None), ``bias32 [N]`` float32 or None; ``group_size``."""

    prefill_bf16 = False

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, group_size: int) -> Int4Linear:
        """Quantize ``linear``'s float weight with torchao's tinygemm parameters (groups of
        ``group_size`` along K)."""
        from torchao.quantization.quant_primitives import (
            MappingType,
            _choose_qparams_affine_tinygemm,
            _quantize_affine_tinygemm,
        )

        w = linear.weight.detach().float()
        block = [1, group_size]
        scale, zero = _choose_qparams_affine_tinygemm(w, MappingType.ASYMMETRIC, block, torch.int32, 0, 15, 1e-6,
                                                      None, w.dtype)
        q = _quantize_affine_tinygemm(w, block, scale, zero, torch.int32, 0, 15)
        scale = scale.reshape(w.shape[0], -1).float()
        zero = zero.reshape(w.shape[0], -1).float()
        return cls.from_blocks(linear, cpu_woq.pack_int4(q), scale, zero - 8 * scale, group_size)

    @classmethod
    def from_blocks(cls, linear: torch.nn.Linear, packed: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                    group_size: int, scale_d: torch.Tensor | None = None,
                    shift_d: torch.Tensor | None = None) -> Int4Linear:
        """From weights already in the kernel's layout: ``packed [N, K/2]`` uint8 (byte ``j`` of each
        32-weight run holds weight ``j`` low, ``16 + j`` high), ``scale`` and ``shift [N, K/G]``
        (``w = q * scale + shift``; a GGUF Q4_1 block's ``d`` and ``m``: float16 kept as it is, both or
        neither, else float32), or with ``scale_d`` and ``shift_d`` their factored form (int8 ``scale``
        / ``shift``: ValueError on a bad layout, :func:`kvfleet.kernels.cpu_woq.matrix_fields`);
        ``linear`` gives the bias."""
        new = _shell(cls, linear)
        new.group_size = group_size
        new.register_buffer("weight", packed.contiguous(), persistent=False)
        factored = scale_d is not None or scale.dtype == shift.dtype == torch.float16   # (kept as they are)
        if scale_d is not None:
            n, k = packed.shape[0], 2 * packed.shape[1]
            want = cpu_woq.matrix_fields("int4", "int4", group_size, scale, shift, None, n, k, scale_d)
            for name, t in (("scale", scale), ("shift", shift), ("scale_d", scale_d), ("shift_d", shift_d)):
                if t is None or tuple(t.shape) != want[name][0] or t.dtype != want[name][1]:
                    raise ValueError(f"int4 {name} must be {str(want[name][1])[6:]} {list(want[name][0])}")
        new.register_buffer("qscale", scale.contiguous() if factored else scale.float().contiguous(), persistent=False)
        new.register_buffer("qshift", shift.contiguous() if factored else shift.float().contiguous(), persistent=False)
        new.register_buffer("qscale_d", None if scale_d is None else scale_d.contiguous(), persistent=False)
        new.register_buffer("qshift_d", None if shift_d is None else shift_d.contiguous(), persistent=False)
        bias = linear.bias
        new.register_buffer("bias32", None if bias is None else bias.detach().float().contiguous(), persistent=False)
        new.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)
        return new

    def dequantized(self) -> torch.Tensor:
        """The float32 weight ``[N, K]`` the kernel computes with (torch ops: the reference)."""
        q = cpu_woq.unpack_int4(self.weight).float()
        g = self.group_size
        scale, shift = self.scales()
        return q * scale.repeat_interleave(g, 1) + shift.repeat_interleave(g, 1)

    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(qscale, qshift)`` as float32 (float16 widened, the factored form's exact products)."""
        if getattr(self, "qscale_d", None) is None:
            return self.qscale.float(), self.qshift.float()
        return cpu_woq.group_scales(self.qscale, self.qscale_d), cpu_woq.group_scales(self.qshift, self.qshift_d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.kvfleet.woq_int4_linear(x, self.weight, *self.scales(), self.group_size, self.bias32)
        if not cpu_woq.available():  # the torch fallback: the same float32 weights
            y = torch.nn.functional.linear(x, self.dequantized().to(x.dtype))
            return y if self.bias32 is None else y + self.bias32.to(x.dtype)
        if x.numel() <= MAX_KERNEL_ROWS * self.in_features:
            if self.qscale.dtype != torch.float32:   # float16 or factored
                return cpu_woq.scaled_linear_unchecked(x, "int4", self.weight, self.qscale, self.qshift,
                                                       self.group_size, self.bias32, self.qscale_d, self.qshift_d)
            return cpu_woq.int4_linear_unchecked(x, self.weight, self.qscale, self.qshift, self.group_size,
                                                 self.bias32)
        N, K = self.weight.shape[0], 2 * self.weight.shape[1]
        if self.prefill_bf16:  # the dequantized weight rounded to bf16; oneDNN's native bf16 matmul
            w = cpu_woq.int4_dequantize(self.weight, *self.scales(), self.group_size,
                                        out=cpu_woq.bf16_scratch(N, K), dtype=torch.bfloat16)
            y = torch.nn.functional.linear(x.to(torch.bfloat16), w).to(x.dtype)
        else:
            w = cpu_woq.int4_dequantize(self.weight, *self.scales(), self.group_size, out=dequant_scratch(N, K))
            y = torch.nn.functional.linear(x, w.to(x.dtype))
        return y if self.bias32 is None else y + self.bias32.to(x.dtype)


class Int8GroupLinear(torch.nn.Linear):
    """``nn.Linear`` over grouped int8 weights: ``weight [N, K]`` int8, ``qscale [N, K/G]`` float32,
    ``qshift [N, K/G]`` float32 or None (or both float16: GGUF's own ``d`` and ``m``; or factored:
    int8 factors of ``qscale_d`` / ``qshift_d [N, K/S]`` float16, GGUF K-quants), ``qhigh`` None
    or the 5-bit form's high bits (``weight`` then ``[N, K/2]`` uint8 nibbles: GGUF Q5_0 as stored),
    ``W = weight * qscale (+ qshift)`` per group of
    ``group_size`` (a multiple of 16) along K, multiplied then added in float32 (GGUF Q8_0: G 32;
    Q6_K: G 16; Q5_K: G 32 with a shift -- each bit for bit as ``gguf`` dequantizes it),
    ``bias32 [N]`` or None. :meth:`from_blocks` takes weights already in the layout
    (:mod:`kvfleet.runtime.worker.gguf_tensors`); :meth:`from_exact` builds one from a float32 weight
    only where that factorization is exact (the same weights in a quarter of the bytes)."""

    @classmethod
    def from_blocks(cls, linear: torch.nn.Linear | tuple[int, int], q: torch.Tensor, scale: torch.Tensor,
                    shift: torch.Tensor | None, group_size: int,
                    bias: torch.Tensor | None = None, qhigh: torch.Tensor | None = None,
                    scale_d: torch.Tensor | None = None, shift_d: torch.Tensor | None = None) -> Int8GroupLinear:
        """From ``q [N, K]`` int8, ``scale`` / ``shift [N, K/G]`` (``shift`` None: none; float16 kept
        as it is, both or neither, else float32), or with ``qhigh`` the 5-bit form (``q [N, K/2]``
        uint8 nibbles, ``qhigh [N, K/8]``: :func:`kvfleet.kernels.cpu_woq.int8g_linear_unchecked`);
        ``linear`` gives the features and bias, or is ``(in_features, out_features)`` with
        ``bias``. Raises ValueError on a bad layout (:func:`kvfleet.kernels.cpu_woq.check_int8g`)."""
        if isinstance(linear, tuple):
            new = cls.__new__(cls)
            torch.nn.Module.__init__(new)
            new.in_features, new.out_features = linear
        else:
            new = _shell(cls, linear)
            bias = None if linear.bias is None else linear.bias.detach()
        q = q.contiguous()
        half = scale.dtype in (torch.float16, torch.int8) and (shift is None or shift.dtype == scale.dtype)
        scale = scale.contiguous() if half else scale.float().contiguous()
        shift = None if shift is None else shift.contiguous() if half else shift.float().contiguous()
        qhigh = None if qhigh is None else qhigh.contiguous()
        bias32 = None if bias is None else bias.float().contiguous()
        scale_d = None if scale_d is None else scale_d.contiguous()
        shift_d = None if shift_d is None else shift_d.contiguous()
        cpu_woq.check_int8g(q, scale, shift, group_size, bias32, qhigh, scale_d, shift_d)
        shape = (q.shape[0], q.shape[1] * (1 if qhigh is None else 2))
        if shape != (new.out_features, new.in_features):
            raise ValueError(f"int8g weight is {shape}, the layer {(new.out_features, new.in_features)}")
        new.group_size = group_size
        new.register_buffer("weight", q, persistent=False)
        new.register_buffer("qhigh", qhigh, persistent=False)
        new.register_buffer("qscale", scale, persistent=False)
        new.register_buffer("qshift", shift, persistent=False)
        new.register_buffer("qscale_d", scale_d, persistent=False)
        new.register_buffer("qshift_d", shift_d, persistent=False)
        new.register_buffer("bias32", bias32, persistent=False)
        new.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)
        return new

    @classmethod
    def from_exact(cls, linear: torch.nn.Linear, group_size: int = 32) -> Int8GroupLinear | None:
        """``linear``'s float32 weight as int8 x per-group scale, or None unless exact: each group's
        scale is its largest magnitude / 127 (Q8_0's choice), and every ``q * scale`` must give
        back the weight bit for bit."""
        w = linear.weight.detach()
        N, K = w.shape
        if w.dtype != torch.float32 or K % group_size or group_size % 16 or K % 32:
            return None
        g = w.reshape(N, K // group_size, group_size)
        scale = g.abs().amax(-1) / 127
        q = torch.where(scale[..., None] > 0, g / scale[..., None].clamp_min(1e-38), torch.zeros_like(g))
        if not torch.equal(q, q.round()) or q.abs().max() > 127:
            return None
        q8 = q.to(torch.int8)
        if not torch.equal(q8.float() * scale[..., None], g):
            return None
        return cls.from_blocks(linear, q8.reshape(N, K), scale, None, group_size)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight ``[N, K]``: ``q * scale``, then ``+ shift``, each rounded in float32
        (the kernels' arithmetic, and gguf's)."""
        q = self.weight if self.qhigh is None else cpu_woq.unpack_int8g5(self.weight, self.qhigh)
        scale_d, shift_d = getattr(self, "qscale_d", None), getattr(self, "qshift_d", None)
        w = q.float() * cpu_woq.group_scales(self.qscale, scale_d).repeat_interleave(self.group_size, 1)
        return w if self.qshift is None else w + cpu_woq.group_scales(self.qshift, shift_d).repeat_interleave(
            self.group_size, 1)

    KERNEL_ROWS = 256
    """Rows up to which the C kernel runs (an LM head's rows: one per sequence; measured on a Xeon
    with AMX, 49152 x 576: 17 ms at 48 rows against 16 for torch's fp32 matmul on the widened weight,
    100 against ~60 at 256); more (prompt logprobs of long prompts) widen the weight for torch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= self.KERNEL_ROWS * self.in_features and cpu_woq.available():
            if getattr(self, "qscale_d", None) is not None:
                return cpu_woq.scaled_linear_unchecked(x, "int8g", self.weight, self.qscale, self.qshift,
                                                       self.group_size, self.bias32, self.qscale_d, self.qshift_d,
                                                       self.qhigh)
            return cpu_woq.int8g_linear_unchecked(x, self.weight, self.qscale, self.qshift, self.group_size,
                                                  self.bias32, self.qhigh)
        # the torch fallback (many rows, or no C kernels here): the same float32 weights
        y = torch.nn.functional.linear(x, self.dequantized().to(x.dtype))
        return y if self.bias32 is None else y + self.bias32.to(x.dtype)


class Bf16Linear(torch.nn.Linear):
    """``nn.Linear`` over bf16 weights, float32 activations in and out (see the module docstring).

    Buffers: ``weight [N, K]`` bfloat16, ``bias32 [N]`` float32 or None."""

    prefill_bf16 = True  # bf16_path's choice: native bf16 prefill where the CPU has it (set_bf16_prefill)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> Bf16Linear:
        """Round ``linear``'s float weight to bf16 (nearest even); the float weight is not kept."""
        new = _shell(cls, linear)
        new.register_buffer("weight", linear.weight.detach().to(torch.bfloat16).contiguous(), persistent=False)
        bias = linear.bias
        new.register_buffer("bias32", None if bias is None else bias.detach().float().contiguous(), persistent=False)
        new.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.kvfleet.woq_bf16_linear(x, self.weight, self.bias32)
        path = None if self.prefill_bf16 else cpu_woq.bf16_path(x.numel() // self.in_features, native_bf16=False)
        return cpu_woq.bf16_linear_unchecked(x, self.weight, self.bias32, path)


def _replace(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def convert_model(model: torch.nn.Module, layers: dict[str, torch.nn.Linear], method: str,
                  group_size: int | None, lm_head: bool) -> int:
    """Swap ``layers`` (name -> layer of ``model``) for the kernel's layers, and the LM head
    when ``lm_head``; returns the number of layers swapped. ``int8`` layers must already hold
    torchao ``Int8Tensor`` weights; ``int4`` layers hold float weights."""
    for name, linear in layers.items():
        new = Int8Linear.from_torchao(linear) if method == "int8" else Int4Linear.from_linear(linear, group_size)
        _replace(model, name, new)
    count = len(layers)
    if lm_head:
        head = model.get_output_embeddings()
        name = next(n for n, m in model.named_modules() if m is head)
        _replace(model, name, Int8Linear.from_float(head.weight.detach(), head.bias))
        if getattr(model.config, "tie_word_embeddings", False):
            model.config.tie_word_embeddings = False  # the head is its own (int8) copy now
        count += 1
    return count


def to_bf16_weights(model: torch.nn.Module) -> int:
    """Swap a loaded float32 model's ``nn.Linear`` layers (the decoder's and the LM head) for :class:`Bf16Linear`
    (the head an untied bf16 copy: the input embedding stays float32 for the lookups); returns
    the number of layers swapped. The model keeps float32 activations, so the fused decode path
    (:mod:`kvfleet.runtime.worker.cpu_decode`) still runs it, reading half the weight bytes.

    Raises:
        ValueError: a layer to convert does not hold float32 weights on the CPU, or the C
            kernels are unavailable here (:func:`kvfleet.kernels.cpu_woq.available`).
    """
    if not cpu_woq.available():
        raise ValueError(f"bf16 weights need kvfleet's CPU kernels: {cpu_woq.unavailable_reason()}")
    from kvfleet.runtime.worker.moe_experts import split_experts

    split_experts(model)  # fused 3-D experts as one linear per expert, stored in bf16 like the dense layers
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    layers = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    for name, linear in layers.items():
        if type(linear) is not torch.nn.Linear or linear.weight.dtype != torch.float32 \
                or linear.weight.device.type != "cpu":
            raise ValueError(f"bf16 weights: {name} is a {type(linear).__name__} with {linear.weight.dtype} weights "
                             f"on {linear.weight.device}, not a float32 nn.Linear on the CPU")
    for name, linear in layers.items():
        _replace(model, name, Bf16Linear.from_linear(linear))
    if any(m is head for m in layers.values()) and getattr(model.config, "tie_word_embeddings", False):
        model.config.tie_word_embeddings = False  # the head is its own (bf16) copy now
    return len(layers)


def set_bf16_prefill(model: torch.nn.Module, enabled: bool) -> int:
    """Whether ``model``'s kernel layers run steps of more than :data:`MAX_KERNEL_ROWS` rows
    (prefill) as oneDNN's native bf16 matmul; the :class:`~kvfleet.runtime.worker.cpu_plan.CpuPlan`
    decides (``native_bf16_prefill``), for CPUs with native bf16 only. :class:`Int8Linear` and
    :class:`Int4Linear`: the weight dequantized to bf16 (int8 values exactly; int4's ``q * scale +
    shift`` rounded to nearest even), the activations rounded to bf16, float32 sums (AMX /
    AVX512-BF16); :class:`Bf16Linear`: :func:`kvfleet.kernels.cpu_woq.bf16_path`'s choice, or the
    float32 matmul when off. Decode (up to :data:`MAX_KERNEL_ROWS` rows) keeps the float32 C kernels
    either way. Returns the number of layers set."""
    count = 0
    for module in model.modules():
        if isinstance(module, (Int8Linear, Int4Linear, Bf16Linear)):
            module.prefill_bf16 = enabled
            count += 1
    return count
