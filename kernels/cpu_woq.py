"""Weight-only linear layers on x86-64 CPUs with AVX2 + FMA: int8 (per output channel), int4
(groupwise, asymmetric) and bf16 weights, as the custom ops ``kvfleet::woq_int8_linear``,
``kvfleet::woq_int4_linear`` and ``kvfleet::woq_bf16_linear``.

Why our own kernel: torch's CPU kernels for weight-only int8/int4 (``aten._weight_int8pack_mm``,
``aten._weight_int4pack_mm_for_cpu``, ``torch._int_mm``) are vectorised for AVX-512; on an AVX2
machine they ran 5-10x slower than the fp32 matmul they replace (docs/performance.md,
"Weight-only quantization"), and torchao 0.18's wheels carry no x86 low-bit kernels. A decode
step is bound by reading weights, so the kernel reads each weight once, widens it to float32 in
registers and sums every row of ``x`` in one order, whatever their number (``kernels/cpu_gemv.h``
states the layouts and the order).

Build and load: :mod:`kvfleet.kernels.cpu_lib` (one library per ISA level, chosen at run time;
``cpu_woq.c`` holds these ops, ``cpu_decoder.c`` the fused decode step). :func:`load`,
:func:`available` and :func:`unavailable_reason` are its; callers fall back to torch/torchao's
kernels when :func:`available` is False.

Shapes and dtypes (the ops check them and raise ``ValueError``):

- ``int8_linear(x [..., K] float, qdata [N, K] int8, scale [N] float32, bias [N] | None)``
  -> ``[..., N]`` in ``x.dtype``: ``x @ (qdata * scale[:, None]).T + bias``.
- ``bf16_linear(x [..., K] float, w [N, K] bfloat16, bias [N] | None)`` -> ``[..., N]`` in
  ``x.dtype``: ``x @ w.float().T + bias`` (bf16 weights, float32 arithmetic). A step of up to
  :data:`KERNEL_ROWS` rows runs the C kernel (each bf16 weight widened exactly in registers);
  a larger one (prefill) runs torch's matmul, the way :func:`bf16_path` names: ``native_bf16``
  (``F.linear`` on bf16 activations, oneDNN's AVX512-BF16 / AMX kernels; the activations and
  each output, before the float32 bias, are rounded to bf16) where the CPU multiplies bf16
  natively, else ``fp32`` (the weight widened into this thread's :func:`dequant_scratch`,
  torch's fp32 matmul).
- ``int4_linear(x [..., K], packed [N, K/2] uint8, scale [N, K/G], shift [N, K/G], G, bias)``
  -> ``x @ W.T + bias`` with ``W[n, k] = q[n, k] * scale[n, k//G] + shift[n, k//G]``,
  ``q = unpack_int4(packed)`` in 0..15, ``G`` a multiple of 32 dividing ``K``.
  :func:`pack_int4` makes ``packed`` from ``q [N, K]`` (uint8 0..15).

Scales and shifts (int4's, and grouped int8's: :func:`int8g_linear_unchecked`) in one of three forms
(:func:`scale_form`): float32, float16 (GGUF's own ``d`` / ``m``), or factored (GGUF K-quants as
stored: ``scale`` / ``shift [N, K/G]`` int8 factors and ``scale_d`` / ``shift_d [N, K/S]`` float16,
one per super-block of ``S`` weights; the scale is ``float32(d) * factor``, an exact product:
:func:`group_scales`; :func:`scaled_linear_unchecked` runs every form).

Computed in float32 (``x`` is converted when it is bf16/fp16); the sums run in a different
order than a BLAS matmul, so results match ``x @ W.T`` to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import torch

from kvfleet.kernels import cpu_features, cpu_lib

KERNEL_ROWS = 32
"""Rows (tokens) up to which :func:`bf16_linear` runs the C kernel; above, torch's matmul
(:func:`bf16_path`). The int8 layers' threshold (``woq_linear.MAX_KERNEL_ROWS``), measured for bf16
too (docs/performance.md, "bf16 weights")."""

load, available, unavailable_reason = cpu_lib.load, cpu_lib.available, cpu_lib.unavailable_reason


def cpu_supported(cpuinfo: str | None = None) -> bool:
    """Whether a CPU (``/proc/cpuinfo`` text, or this machine's) reaches kvfleet's floor, the
    ``avx2`` level (AVX2, FMA, F16C on Linux x86-64)."""
    if cpuinfo is None:
        return cpu_lib.variant_for(cpu_features.detect()) is not None
    return cpu_lib.variant_for(cpu_features.CpuFeatures.from_cpuinfo(cpuinfo)) is not None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check(x: torch.Tensor, w: torch.Tensor, wdtype: torch.dtype, K: int, N: int, bias) -> None:
    if x.device.type != "cpu" or w.device.type != "cpu":
        raise ValueError("kvfleet woq kernels run on CPU tensors only")
    if not x.is_floating_point():
        raise ValueError(f"x must be floating point, got {x.dtype}")
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight {K}")
    if w.dtype != wdtype or not w.is_contiguous():
        raise ValueError(f"weight must be a contiguous {wdtype} tensor, got {w.dtype}")
    if bias is not None and (bias.shape != (N,) or bias.dtype != torch.float32):
        raise ValueError(f"bias must be float32 [{N}], got {bias.dtype} {tuple(bias.shape)}")


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype != torch.float32:
        x2 = x2.float()
    return x2.contiguous()


def _as_input(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The kernel's float32 ``[rows, N]`` output shaped and typed like ``x`` (``[..., N]``)."""
    y = y.view(*x.shape[:-1], y.shape[-1])
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def _lib_or_raise() -> ctypes.CDLL:
    lib = cpu_lib.load()
    if lib is None:
        raise RuntimeError(f"kvfleet woq kernels unavailable: {cpu_lib.unavailable_reason()}")
    return lib


def int8_linear(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ (qdata * scale[:, None]).T + bias`` (see the module docstring); ``x`` [..., K].
    Under ``torch.compile`` it is the opaque op ``kvfleet::woq_int8_linear``; eagerly a plain
    call (a custom op's Python dispatch costs tens of microseconds a call)."""
    if torch.compiler.is_compiling():
        return torch.ops.kvfleet.woq_int8_linear(x, qdata, scale, bias)
    return _int8_linear(x, qdata, scale, bias)


def _int8_linear(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    N, K = qdata.shape
    _check(x, qdata, torch.int8, K, N, bias)
    if scale.shape != (N,) or scale.dtype != torch.float32 or not scale.is_contiguous():
        raise ValueError(f"scale must be contiguous float32 [{N}], got {scale.dtype} {tuple(scale.shape)}")
    x2 = _rows(x)
    y = torch.empty((x2.shape[0], N), dtype=torch.float32)
    if x2.shape[0]:
        _lib_or_raise().kv_woq_int8_linear(x2.data_ptr(), x2.shape[0], K, K, qdata.data_ptr(), N,
                                          scale.data_ptr(), _ptr(bias), y.data_ptr())
    return _as_input(y, x)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, group_size: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` for groupwise int4 ``W`` (see the module docstring); ``x`` [..., K].
    ``kvfleet::woq_int4_linear`` under ``torch.compile``, a plain call eagerly."""
    if torch.compiler.is_compiling():
        return torch.ops.kvfleet.woq_int4_linear(x, packed, scale, shift, group_size, bias)
    return _int4_linear(x, packed, scale, shift, group_size, bias)


def _int4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None) -> torch.Tensor:
    N, half = packed.shape
    K = 2 * half
    _check(x, packed, torch.uint8, K, N, bias)
    if group_size % 32 or K % group_size:
        raise ValueError(f"group_size must be a multiple of 32 dividing K={K}, got {group_size}")
    for name, t in (("scale", scale), ("shift", shift)):
        if t.shape != (N, K // group_size) or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32 [{N}, {K // group_size}], got "
                             f"{t.dtype} {tuple(t.shape)}")
    x2 = _rows(x)
    y = torch.empty((x2.shape[0], N), dtype=torch.float32)
    if x2.shape[0]:
        _lib_or_raise().kv_woq_int4_linear(x2.data_ptr(), x2.shape[0], K, K, packed.data_ptr(), N, scale.data_ptr(),
                                          shift.data_ptr(), group_size, _ptr(bias), y.data_ptr())
    return _as_input(y, x)


_scratch = threading.local()


def dequant_scratch(rows: int, cols: int) -> torch.Tensor:
    """A float32 ``[rows, cols]`` view of this thread's dequantization buffer (grown, never
    shrunk; the largest layer's weight). One buffer for every layer: a fresh ``torch.empty`` of
    a whole weight per layer per prefill came from new pages (mmap-sized allocations), and
    faulting them in cost more than the dequantization (the first token of a 128-token int4
    prompt: 0.70 s with fresh tensors, 0.45 s with the buffer; docs/performance.md). Overwritten
    by the next layer: the caller uses it before the next call.

    Made with inference mode off, so it can be written in and out of inference mode."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < rows * cols:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode
            buf = _scratch.buf = torch.empty(rows * cols, dtype=torch.float32)
    return buf[: rows * cols].view(rows, cols)


@functools.cache
def _native_bf16() -> bool:
    return cpu_features.detect().native_bf16


def bf16_path(rows: int, native_bf16: bool | None = None) -> str:
    """How :func:`bf16_linear` runs a step of ``rows`` rows: ``kernel`` (the C kernel, up to
    :data:`KERNEL_ROWS` rows: decode, bound by reading weights), else ``native_bf16`` when the CPU
    multiplies bf16 natively (``native_bf16``; None: this machine's
    :attr:`~kvfleet.kernels.cpu_features.CpuFeatures.native_bf16`, read once), else ``fp32``."""
    if rows <= KERNEL_ROWS:
        return "kernel"
    if native_bf16 is None:
        native_bf16 = _native_bf16()
    return "native_bf16" if native_bf16 else "fp32"


def bf16_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, path: str | None = None) -> torch.Tensor:
    """``x @ w.float().T + bias`` for bf16 ``w [N, K]`` (see the module docstring); ``x`` [..., K].
    ``path`` forces one of :func:`bf16_path`'s answers (tests, benchmarks). Under ``torch.compile``
    the opaque op ``kvfleet::woq_bf16_linear``; eagerly a plain call."""
    if torch.compiler.is_compiling():
        return torch.ops.kvfleet.woq_bf16_linear(x, w, bias)
    N, K = w.shape
    _check(x, w, torch.bfloat16, K, N, bias)
    return bf16_linear_unchecked(x, w, bias, path)


def bf16_linear_unchecked(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                          path: str | None = None) -> torch.Tensor:
    """:func:`bf16_linear` without the argument checks or the op dispatch (see
    :func:`int8_linear_unchecked`)."""
    N, K = w.shape
    rows = x.numel() // K if K else 0
    path = path or bf16_path(rows)
    if path == "native_bf16":
        y = torch.nn.functional.linear(x.to(torch.bfloat16), w).float()
        return _as_input(y if bias is None else y.add_(bias), x)
    if path == "fp32":
        y = torch.nn.functional.linear(x.float(), dequant_scratch(N, K).copy_(w), bias)
        return y if x.dtype == torch.float32 else y.to(x.dtype)
    x2 = _rows(x)
    y = torch.empty((x2.shape[0], N), dtype=torch.float32)
    if x2.shape[0]:
        _lib_or_raise().kv_woq_bf16_linear(x2.data_ptr(), x2.shape[0], K, K, w.data_ptr(), N, _ptr(bias),
                                          y.data_ptr())
    return _as_input(y, x)


def _bf16_op(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return bf16_linear(x, w, bias)


def _int8_fake(x, qdata, scale, bias):
    return x.new_empty((*x.shape[:-1], qdata.shape[0]))


def _bf16_fake(x, w, bias):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def _int4_fake(x, packed, scale, shift, group_size, bias):
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


torch.library.custom_op("kvfleet::woq_int8_linear", _int8_linear, mutates_args=()).register_fake(_int8_fake)
torch.library.custom_op("kvfleet::woq_int4_linear", _int4_linear, mutates_args=()).register_fake(_int4_fake)
torch.library.custom_op("kvfleet::woq_bf16_linear", _bf16_op, mutates_args=()).register_fake(_bf16_fake)


def int8_linear_unchecked(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`int8_linear` without the argument checks or the op dispatch, for a layer whose
    weights were checked once (``kvfleet.runtime.worker.woq_linear``); call :func:`load` first."""
    N, K = qdata.shape
    x2 = _rows(x)
    y = torch.empty((x2.shape[0], N), dtype=torch.float32)
    _lib_or_raise().kv_woq_int8_linear(x2.data_ptr(), x2.shape[0], K, K, qdata.data_ptr(), N, scale.data_ptr(),
                                       _ptr(bias), y.data_ptr())
    return _as_input(y, x)


def int8g_linear_unchecked(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None,
                           group_size: int, bias: torch.Tensor | None,
                           qhigh: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for grouped int8 weights, ``W = qdata * scale (+ shift)`` per group of
    ``group_size`` along K (``qdata [N, K]`` int8, ``scale`` and ``shift [N, K/G]`` float32 or both
    float16, ``shift`` None for none; G a multiple of 16, K of 32: GGUF Q8_0, Q6_K and Q5_K tensors'
    layouts), each weight multiplied (then shifted) in float32 before the sum. With ``qhigh`` the
    5-bit form (GGUF Q5_0 as stored): ``qdata [N, K/2]`` uint8 the low nibbles (:func:`pack_int4`'s
    layout) and ``qhigh [N, K/8]`` uint8 the fifth bits, ``q = (nibble | bit << 4) - 16``
    (:func:`unpack_int8g5`). Unchecked (see :func:`int8_linear_unchecked`; :func:`check_int8g` checks)."""
    N, K = qdata.shape[0], qdata.shape[1] * (1 if qhigh is None else 2)
    x2 = _rows(x)
    y = torch.empty((x2.shape[0], N), dtype=torch.float32)
    _lib_or_raise().kv_woq_int8g_linear(x2.data_ptr(), x2.shape[0], K, K, qdata.data_ptr(), N, scale.data_ptr(),
                                        _ptr(shift), group_size, _ptr(bias), y.data_ptr(),
                                        int(scale.dtype == torch.float16), _ptr(qhigh))
    return _as_input(y, x)


SCALE_FORMS = {torch.float32: 0, torch.float16: 1, torch.int8: 2}
"""A scale tensor's dtype -> its form (``kv_matrix.scale_f16``): float32, float16, factored."""


def scale_form(scale: torch.Tensor | None) -> int:
    """0 float32 (or no scale), 1 float16, 2 factored (int8 factors of a float16 ``d``)."""
    return 0 if scale is None else SCALE_FORMS.get(scale.dtype, 0)


def super_group(k: int, scale_d: torch.Tensor | None) -> int:
    """Weights per factored super-block (``scale_d [N, K/S]``: ``S``), 0 when not factored."""
    return 0 if scale_d is None else k // max(scale_d.shape[-1], 1)


def group_scales(scale: torch.Tensor | None, d: torch.Tensor | None = None) -> torch.Tensor | None:
    """A scale (or shift) ``[N, K/G]`` in any form as float32: float32 as it is, float16 widened,
    int8 factors times their super-block's float16 ``d [N, K/S]`` (``float32(d) * factor``: exact,
    the kernels' ``kv_groups``)."""
    if scale is None or d is None:
        return None if scale is None else scale.float()
    return d.float().repeat_interleave(scale.shape[-1] // d.shape[-1], -1) * scale.float()


def scaled_linear_unchecked(x: torch.Tensor, fmt: str, w: torch.Tensor, scale: torch.Tensor,
                            shift: torch.Tensor | None, group_size: int, bias: torch.Tensor | None,
                            scale_d: torch.Tensor | None = None, shift_d: torch.Tensor | None = None,
                            qhigh: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for an ``int4`` (:func:`int4_linear`'s layout) or ``int8g``
    (:func:`int8g_linear_unchecked`'s) weight with its scales in any form (the module docstring;
    factored: with ``scale_d`` / ``shift_d``); unchecked (:func:`matrix_fields` checks)."""
    N, K = w.shape[0], w.shape[1] * (2 if fmt == "int4" or qhigh is not None else 1)
    x2 = _rows(x)
    y = torch.empty((x2.shape[0], N), dtype=torch.float32)
    _lib_or_raise().kv_woq_scaled_linear(x2.data_ptr(), x2.shape[0], K, K, 2 if fmt == "int4" else 4, w.data_ptr(),
                                         N, scale.data_ptr(), _ptr(shift), group_size, _ptr(bias), y.data_ptr(),
                                         scale_form(scale), _ptr(scale_d), _ptr(shift_d), super_group(K, scale_d),
                                         _ptr(qhigh))
    return _as_input(y, x)


def scale_fields(fmt: str, scale: torch.Tensor | None, scale_d: torch.Tensor | None, shift_d: torch.Tensor | None,
                 k: int) -> dict[str, int | None]:
    """``kv_matrix``'s scale-form fields (``scale_f16``, ``scale_d``, ``shift_d``, ``super_group``)."""
    return {"scale_f16": scale_form(scale) if fmt in ("int4", "int8g") else 0, "super_group": super_group(k, scale_d),
            "scale_d": _ptr(scale_d), "shift_d": _ptr(shift_d)}


def without_five_bit(m):
    """A matrix (``kernels.cpu_decoder.Linear``) with int8g's 5-bit form as int8 (:func:`unpack_int8g5`;
    the same weights, one byte each); others as they are."""
    import dataclasses

    return m if m.high is None else dataclasses.replace(m, w=unpack_int8g5(m.w, m.high), high=None)


def stack_scales(fmt: str, parts: list) -> dict[str, torch.Tensor | None]:
    """The scale tensors of matrices of one form (``kernels.cpu_decoder.Linear``) stacked along the
    output features: ``scale``, ``shift`` (a part without one: zeros; factored: zero factors of a
    zero ``d``), ``high``, ``scale_d``, ``shift_d`` (None where the form has none)."""
    def cat(ts: list) -> torch.Tensor | None:
        return None if ts[0] is None else torch.cat(ts)

    out = {"scale": cat([p.scale for p in parts]) if fmt in ("int8", "int4", "int8g") else None, "shift": None,
           "high": cat([p.high for p in parts]), "scale_d": cat([p.scale_d for p in parts]), "shift_d": None}
    if fmt == "int4" or (fmt == "int8g" and any(p.shift is not None for p in parts)):
        out["shift"] = torch.cat([p.shift if p.shift is not None else torch.zeros_like(p.scale) for p in parts])
        if out["scale_d"] is not None:
            out["shift_d"] = torch.cat([p.shift_d if p.shift_d is not None else torch.zeros_like(p.scale_d)
                                        for p in parts])
    return out


def matrix_fields(name: str, fmt: str, group: int, scale: torch.Tensor | None, shift: torch.Tensor | None,
                  high: torch.Tensor | None, n: int, k: int, scale_d: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """A matrix's (``kernels.cpu_decoder.Linear``, the GGUF layers) group size, shift, 5-bit high
    bits and factored super-block checked for its format ``fmt`` (ValueError), and ``{field: (shape,
    dtype)}`` its ``scale``, ``shift``, ``scale_d`` and ``shift_d`` must have (float32, both float16,
    or factored: int8 with float16 ``*_d``), and ``bias`` when given; the caller checks those tensors."""
    g = k // max(group, 1)
    wanted = {"fp32": {}, "bf16": {}, "int8": {"scale": (n,)}, "int8g": {"scale": (n, g)},
              "int4": {"scale": (n, g), "shift": (n, g)}}[fmt]
    if fmt == "int4" and (group <= 0 or group % 32 or k % group):
        raise ValueError(f"{name}: int4 group size {group} must be a multiple of 32 dividing {k}")
    if fmt == "int8g" and (group <= 0 or group % 16 or k % group or k % 32):
        raise ValueError(f"{name}: int8g group size {group} must be a multiple of 16 dividing {k} "
                         f"({k} a multiple of 32)")
    if fmt == "int8g" and shift is not None:
        wanted = {**wanted, "shift": (n, g)}
    elif fmt != "int4" and shift is not None:
        raise ValueError(f"{name}: {fmt} takes no shift")
    if high is not None and (fmt != "int8g" or high.shape != (n, k // 8) or high.dtype != torch.uint8
                             or not high.is_contiguous()):
        raise ValueError(f"{name}: high bits must be a contiguous uint8 ({n}, {k // 8}) tensor of an int8g matrix")
    form = scale_form(scale) if fmt in ("int4", "int8g") else 0
    out = {f: (shape, (torch.float32, torch.float16, torch.int8)[form]) for f, shape in wanted.items()}
    if form == 2:
        s = super_group(k, scale_d)
        if s <= 0 or s % group or k % s:
            raise ValueError(f"{name}: factored scales need scale_d [{n}, K/S], S a multiple of {group} dividing {k}")
        out.update({f"{f}_d": ((n, k // s), torch.float16) for f in wanted if f in ("scale", "shift")})
    elif scale_d is not None:
        raise ValueError(f"{name}: scale_d is only for factored (int8) scales")
    if bias is not None:
        out["bias"] = ((n,), torch.float32)
    return out


def check_int8g(qdata: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None, group_size: int,
                bias: torch.Tensor | None, qhigh: torch.Tensor | None = None, scale_d: torch.Tensor | None = None,
                shift_d: torch.Tensor | None = None) -> None:
    """ValueError unless ``qdata``, ``scale``, ``shift``, ``bias`` and ``qhigh`` are a valid grouped
    int8 layer for :func:`int8g_linear_unchecked` (with ``scale_d`` / ``shift_d``: factored, for
    :func:`scaled_linear_unchecked`)."""
    wdtype = torch.int8 if qhigh is None else torch.uint8
    if qdata.dim() != 2 or qdata.dtype != wdtype or not qdata.is_contiguous() or qdata.device.type != "cpu":
        raise ValueError(f"int8g weight must be a contiguous 2-D CPU {wdtype} tensor, got {qdata.dtype} "
                         f"{tuple(qdata.shape)}")
    N, K = qdata.shape[0], qdata.shape[1] * (1 if qhigh is None else 2)
    if group_size <= 0 or group_size % 16 or K % group_size or K % 32:
        raise ValueError(f"int8g group size {group_size} must be a multiple of 16 dividing K={K} (K a multiple "
                         f"of 32)")
    if qhigh is not None and (qhigh.shape != (N, K // 8) or qhigh.dtype != torch.uint8 or not qhigh.is_contiguous()):
        raise ValueError(f"int8g high bits must be contiguous uint8 [{N}, {K // 8}]")
    factored = scale is not None and scale.dtype == torch.int8
    if factored:
        fields = matrix_fields("int8g", "int8g", group_size, scale, shift, qhigh, N, K, scale_d)
        for name, (shape, dtype) in fields.items():
            t = {"scale": scale, "shift": shift, "scale_d": scale_d, "shift_d": shift_d}[name]
            if t is None or t.shape != shape or t.dtype != dtype or not t.is_contiguous():
                raise ValueError(f"int8g {name} must be contiguous {str(dtype)[6:]} {list(shape)}")
        if shift_d is not None and shift is None:
            raise ValueError("int8g shift_d without a shift")
    elif scale_d is not None or shift_d is not None:
        raise ValueError("int8g scale_d / shift_d are only for factored (int8) scales")
    dtype = scale.dtype if scale is not None and scale.dtype in (torch.float32, torch.float16) else torch.float32
    for name, t in (("scale", scale), ("shift", shift)) if not factored else ():
        if (t is not None or name == "scale") and (t is None or t.shape != (N, K // group_size)
                                                   or t.dtype != dtype or not t.is_contiguous()):
            raise ValueError(f"int8g {name} must be contiguous float32 (or, scale and shift both, float16) "
                             f"[{N}, {K // group_size}]")
    if bias is not None and (bias.shape != (N,) or bias.dtype != torch.float32 or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous float32 [{N}]")


def int4_linear_unchecked(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                          group_size: int, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`int4_linear` without the argument checks or the op dispatch (see
    :func:`int8_linear_unchecked`)."""
    N, half = packed.shape
    x2 = _rows(x)
    y = torch.empty((x2.shape[0], N), dtype=torch.float32)
    _lib_or_raise().kv_woq_int4_linear(x2.data_ptr(), x2.shape[0], 2 * half, 2 * half, packed.data_ptr(), N,
                                       scale.data_ptr(), shift.data_ptr(), group_size, _ptr(bias), y.data_ptr())
    return _as_input(y, x)


def int4_dequantize(packed: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, group_size: int,
                    out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``[N, K]`` weight of an int4 layer (``q * scale + shift`` per group), for steps with many
    rows (unchecked, like :func:`int4_linear_unchecked`): ``dtype`` float32, or bfloat16 rounded to
    nearest even (the weight of a native bf16 matmul on AVX512-BF16 / AMX CPUs), written into ``out``
    (a contiguous ``[N, K]`` tensor of ``dtype``) when given."""
    N, half = packed.shape
    if out is None:
        out = torch.empty((N, 2 * half), dtype=dtype)
    lib = _lib_or_raise()
    dequant = lib.kv_woq_int4_dequant_bf16 if dtype == torch.bfloat16 else lib.kv_woq_int4_dequant
    dequant(packed.data_ptr(), N, 2 * half, scale.data_ptr(), shift.data_ptr(), group_size, out.data_ptr())
    return out


def bf16_scratch(rows: int, cols: int) -> torch.Tensor:
    """A bf16 ``[rows, cols]`` view of this thread's :func:`dequant_scratch` buffer (the same
    memory: overwritten by the next layer)."""
    return dequant_scratch((rows * cols + 1) // 2, 1).view(-1).view(torch.bfloat16)[: rows * cols].view(rows, cols)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``q [N, K]`` (integers 0..15, K a multiple of 32) -> ``[N, K/2]`` uint8 in the kernel's
    layout: per block of 32, byte ``j`` = ``q[32b + j] | q[32b + 16 + j] << 4``.

    Raises: ValueError: K not a multiple of 32, or values outside 0..15."""
    N, K = q.shape
    if K % 32:
        raise ValueError(f"K={K} is not a multiple of 32")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ValueError("int4 values must lie in 0..15")
    blocks = q.to(torch.uint8).reshape(N, K // 32, 2, 16)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(N, K // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``[N, K/2]`` uint8 -> ``[N, K]`` uint8 in 0..15."""
    N, half = packed.shape
    blocks = packed.reshape(N, half // 16, 16)
    return torch.stack([blocks & 0x0F, blocks >> 4], dim=2).reshape(N, 2 * half)


def unpack_bits(bits: torch.Tensor) -> torch.Tensor:
    """``[N, K/8]`` uint8 -> ``[N, K]`` uint8 0 / 1: bit ``k`` of a row (least significant first)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((bits[..., None] >> shifts) & 1).reshape(*bits.shape[:-1], bits.shape[-1] * 8)


def unpack_int8g5(nibbles: torch.Tensor, qhigh: torch.Tensor) -> torch.Tensor:
    """int8g's 5-bit form -> its int8 ``q [N, K]``: ``(nibble | bit << 4) - 16`` (:func:`unpack_int4`'s
    nibbles, :func:`unpack_bits`' bits), -16 .. 15."""
    q = unpack_int4(nibbles)
    q |= unpack_bits(qhigh) << 4
    return q.view(torch.int8).sub_(16)   # 0..31 are the same bytes in int8
