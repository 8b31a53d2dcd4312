"""GGUF tensors as stored: each ggml tensor type mapped exactly onto one of kvfleet's weight formats.

Contract: :func:`from_gguf` takes a tensor's raw data as the ``gguf`` package's reader gives it
(quantized types: ``uint8 [N, bytes per row]``; ``F32`` / ``F16``: ``[N, K]`` floats) and returns a
:class:`Stored` weight in a format the kernels read (:mod:`kvfleet.kernels.cpu_gemv` layouts,
INTERFACE §1), whose float32 dequantization (:meth:`Stored.dequantize`: ``q * scale``, then
``+ shift``, each rounded in float32) equals ``gguf.quants.dequantize`` of the same bytes bit for
bit. Where the scale is GGUF's own fp16 ``d`` (and ``m``) of a grouped int8 weight it stays float16
(the kernels widen it, exactly; int4's stay float32: widening them per row cost the default model's
one-row step 9 %, docs/performance.md); K-quants' ``d * sc`` (and ``-dmin * m``) stay factored as
stored (``d`` float16 per 256 weights in ``scale_d`` / ``shift_d``, ``-dmin`` negated exactly; the
6-bit / int8 factors per group in ``scale`` / ``shift`` as int8), the product formed in float32 by
the kernels. Every product below is exact in float32 (an fp16 ``d`` has 11 significant bits, a 6-bit
scale or an int8 one adds at most 7, a 4- to 6-bit ``q`` at most 6: under float32's 24), so the
kernels' own float32 widening (FMA or not) gives the same bits:

========  ==============================================================================
Q4_0      int4 G32: ``q`` the block's nibbles as stored, scale ``d``, shift ``-8 d`` (float32)
Q4_1      int4 G32: scale ``d``, shift ``m`` (float32)
Q4_K      int4 G32: per 32-weight sub-block scale ``d * sc``, shift ``-dmin * m`` (6-bit sc, m), factored
Q5_K      int8g G32 with shift: ``q`` in 0..31, scale ``d * sc``, shift ``-dmin * m``, factored
Q5_0      int8g G32 in the 5-bit form (the block's high bits and nibbles as stored): ``q - 16`` in
          -16..15, scale ``d`` (float16)
Q5_1      int8g G32 with shift: ``q`` in 0..31, scale ``d``, shift ``m`` (float16)
Q6_K      int8g G16: ``q - 32`` in -32..31, scale ``d * scale`` (int8 scales), factored
Q8_0      int8g G32: ``q`` int8, scale ``d`` (float16)
F32, F16  fp32 (F16 widened exactly)
BF16      bf16 as stored
others    (Q2_K, Q3_K, Q8_1, IQ*, TQ*, MXFP4, ...) dequantized by ``gguf.quants`` to float32, then
          rounded to bf16 -- the one lossy case, logged per tensor
========  ==============================================================================

The int4 layout (per 32 weights, byte ``j`` holds weight ``j`` in its low nibble and ``16 + j`` in
its high one) is Q4_0's and Q4_1's own block layout, so those nibbles are copied as they are;
Q4_K's (two 32-weight sub-blocks per 32 bytes, low then high nibbles) is repacked. Block layouts
are ggml's (``ggml-common.h``), as ``gguf.quants`` reads them; the Q4_K / Q5_K 6-bit scales are
unpacked with ``gguf.quants.Q4_K.get_scale_min`` itself.

:meth:`Stored.module` turns a weight into the layer that runs it (``Int4Linear``,
``Int8GroupLinear``, ``Bf16Linear`` or a float32 ``nn.Linear``), :meth:`Stored.rows` dequantizes
rows (embedding lookups), :meth:`Stored.take` reorders rows (llama.cpp's q/k permutation), and
:meth:`Stored.tensors` / :meth:`Stored.from_tensors` give the flat tensors a cache file holds.
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass

import numpy as np
import torch

from kvfleet.kernels.cpu_woq import group_scales

logger = logging.getLogger(__name__)

QK_K = 256
"""Weights per K-quant super-block."""


@dataclass
class Stored:
    """A weight ``[N, K]`` in one of the kernels' formats: ``fmt`` ``fp32`` (``w`` float32),
    ``bf16`` (``w`` bfloat16), ``int4`` (``w [N, K/2]`` uint8 packed, ``scale`` and ``shift [N, K/G]``),
    ``int8g`` (``w [N, K]`` int8, ``scale [N, K/G]``, ``shift [N, K/G]`` or None), or int8g's 5-bit
    form (``high [N, K/8]`` uint8 the fifth bits, ``w [N, K/2]`` uint8 the low nibbles in int4's
    layout: ``q = (nibble | bit << 4) - 16``); int4's and int8g's ``scale`` and ``shift`` float32,
    (both) float16, or factored: int8 factors with ``scale_d`` / ``shift_d [N, K/S]`` float16
    (:func:`kvfleet.kernels.cpu_woq.group_scales`); ``source`` the GGUF type it came from (for logs)."""

    fmt: str
    w: torch.Tensor
    scale: torch.Tensor | None = None
    shift: torch.Tensor | None = None
    group: int = 0
    source: str = ""
    high: torch.Tensor | None = None
    scale_d: torch.Tensor | None = None
    shift_d: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.w.shape
        return n, 2 * k if self.fmt == "int4" or self.high is not None else k

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w, self.scale, self.shift, self.high, self.scale_d,
                                                          self.shift_d) if t is not None)

    def q(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """The int8g / int4 ``q`` of rows ``index`` (all when None), one per weight (int8 / uint8)."""
        from kvfleet.kernels.cpu_woq import unpack_int4, unpack_int8g5

        w = self.w if index is None else self.w[index]
        w = w.reshape(-1, w.shape[-1])
        if self.fmt == "int4":
            return unpack_int4(w)
        if self.high is None:
            return w
        high = self.high if index is None else self.high[index]
        return unpack_int8g5(w, high.reshape(-1, high.shape[-1]))

    def unpacked(self) -> Stored:
        """This weight with int8g's 5-bit form as int8 (one byte per weight; scales as they are)."""
        if self.high is None:
            return self
        return Stored(self.fmt, self.q().contiguous(), self.scale, self.shift, self.group, self.source,
                      scale_d=self.scale_d, shift_d=self.shift_d)

    def scales(self, index: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The float32 ``(scale, shift)`` of rows ``index`` (all when None), whatever their form."""
        pick = (lambda t: t if t is None or index is None else t[index])
        return (group_scales(pick(self.scale), pick(self.scale_d)), group_scales(pick(self.shift), pick(self.shift_d)))

    def plain(self) -> Stored:
        """This weight without the compact forms: int8g's 5-bit form as int8, float16 and factored
        scales and shifts as float32 (the same float32 weights)."""
        return Stored(self.fmt, self.unpacked().w, *self.scales(), self.group, self.source)

    def rows(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``index`` (all when None) dequantized to float32: ``q * scale``, then ``+ shift``."""
        w = self.w if index is None else self.w[index]
        if self.fmt in ("fp32", "bf16"):
            return w.float()
        scale, shift = self.scales(index)
        q = self.q(index)
        g = self.group
        out = q.float() * scale.reshape(q.shape[0], -1).repeat_interleave(g, 1)
        if shift is not None:
            out = out + shift.reshape(q.shape[0], -1).repeat_interleave(g, 1)
        return out.reshape(*w.shape[:-1], out.shape[-1])

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[N, K]`` (equal to ``gguf.quants.dequantize`` of its bytes)."""
        return self.rows()

    def take(self, order: torch.Tensor) -> Stored:
        """The weight with its rows reordered (``row i`` <- ``row order[i]``)."""
        pick = (lambda t: None if t is None else t[order].contiguous())
        return Stored(self.fmt, pick(self.w), pick(self.scale), pick(self.shift), self.group, self.source,
                      pick(self.high), pick(self.scale_d), pick(self.shift_d))

    def as_int8g(self, group: int) -> Stored:
        """This int4 or int8g weight as int8g with groups of ``group`` (dividing its own): the same
        float32 weights (``q * scale + shift`` per weight), one byte per weight, float32 scales."""
        if self.fmt not in ("int4", "int8g") or self.group % group:
            raise ValueError(f"{self.fmt} G{self.group} has no int8g G{group} form")
        q = self.q().to(torch.int8)
        r = self.group // group
        scale, shift = self.scales()
        scale = scale.repeat_interleave(r, 1).contiguous()
        shift = None if shift is None else shift.repeat_interleave(r, 1).contiguous()
        return Stored("int8g", q.contiguous(), scale, shift, group, self.source)

    def module(self, bias: torch.Tensor | None = None) -> torch.nn.Linear:
        """The layer that runs this weight: ``Int4Linear`` / ``Int8GroupLinear`` (kernels' layouts,
        no copy), ``Bf16Linear``, or a float32 ``nn.Linear``."""
        from kvfleet.runtime.worker.woq_linear import Bf16Linear, Int4Linear, Int8GroupLinear

        n, k = self.shape
        if self.fmt == "int4":
            shell = types.SimpleNamespace(in_features=k, out_features=n, bias=bias)
            return Int4Linear.from_blocks(shell, self.w, self.scale, self.shift, self.group, self.scale_d, self.shift_d)
        if self.fmt == "int8g":
            return Int8GroupLinear.from_blocks((k, n), self.w, self.scale, self.shift, self.group, bias, self.high,
                                               self.scale_d, self.shift_d)
        if self.fmt == "bf16":
            shell = torch.nn.Linear(k, n, bias=False, device="meta")
            shell.weight = torch.nn.Parameter(self.w, requires_grad=False)
            if bias is not None:
                shell.bias = torch.nn.Parameter(bias, requires_grad=False)
            return Bf16Linear.from_linear(shell)
        lin = torch.nn.Linear(k, n, bias=bias is not None, device="meta")
        lin.weight = torch.nn.Parameter(self.w, requires_grad=False)
        if bias is not None:
            lin.bias = torch.nn.Parameter(bias.float(), requires_grad=False)
        return lin

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Flat tensors for a cache file (``<prefix>.w`` etc.; :meth:`from_tensors` reads them)."""
        out = {f"{prefix}.w": self.w}
        for name in ("scale", "shift", "high", "scale_d", "shift_d"):
            if getattr(self, name) is not None:
                out[f"{prefix}.{name}"] = getattr(self, name)
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str, fmt: str, group: int) -> Stored:
        return cls(fmt, tensors[f"{prefix}.w"], tensors.get(f"{prefix}.scale"), tensors.get(f"{prefix}.shift"),
                   group, high=tensors.get(f"{prefix}.high"), scale_d=tensors.get(f"{prefix}.scale_d"),
                   shift_d=tensors.get(f"{prefix}.shift_d"))


FIELDS = ("w", "scale", "shift", "high", "scale_d", "shift_d")
"""A :class:`Stored` weight's tensors (those not None are its data)."""

FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Linear layers of one module that the fused CPU decoder stacks into one matrix (one format)."""


def unify_siblings(linears: dict[str, Stored], log: bool = True, in_place: bool = False,
                   after_each=None) -> dict[str, Stored]:
    """``linears`` (module name -> weight) with each set of :data:`FUSED_SIBLINGS` under one parent
    in one format, so the fused decoder can stack them: a Q4_K_M file keeps a layer's q and k in
    Q4_K (int4) and its v in Q6_K (int8g G16); mixed int4 / int8g siblings all become int8g with the
    smallest group and float32 scales (the same float32 weights; the int4 ones take one byte per
    weight); int8g siblings that differ only in the 5-bit form (Gemma 3's q, k in Q5_0, v in Q8_0)
    stay as stored (the fused decoder's stacking, ``cpu_decode._fuse``, takes the 5-bit ones as int8
    into its stacked matrix, whose views the modules become: the load holds the file's 0.69 bytes a
    weight, not one). ``log``: one info line per unified set (off
    for a caller that logs once for many, as each expert's gate / up). ``in_place``: ``linears``
    itself is changed and returned (each replaced weight freed as the next is made), and
    ``after_each`` (a function, or None) is called after each unified set (the loader hands the
    heap back)."""
    out = linears if in_place else dict(linears)
    parents = {name.rpartition(".")[0] for name in linears}
    for parent in parents:
        for names in FUSED_SIBLINGS:
            full = [f"{parent}.{n}" if parent else n for n in names]
            parts = [out.get(n) for n in full]
            if any(p is None for p in parts) or len({_kind(p) for p in parts}) == 1:
                continue
            if not all(p.fmt in ("int4", "int8g") for p in parts):
                continue
            if len({_kind(p)[:3] + _kind(p)[4:] for p in parts}) == 1:   # int8g, all alike but the 5-bit form:
                continue   # kept as stored; the fused decoder's stacking takes the 5-bit ones as int8
            group = min(p.group for p in parts)
            if any(p.group % group for p in parts):
                continue
            sources = "/".join(p.source or p.fmt for p in parts)
            for n, p in zip(full, parts):
                out[n] = p.as_int8g(group)
            del parts, p
            if after_each is not None:
                after_each()
            if log:
                logger.info("%s: %s stored as %s; all as grouped int8 (G%d) for the fused decoder", parent,
                            "/".join(names), sources, group)
    return out


def _kind(p: Stored) -> tuple:
    """What siblings stacked into one matrix must share: format, group, scale dtype, the 5-bit form,
    the factored scales' super-block (and whether a shift, which a factored form cannot zero-fill)."""
    return (p.fmt, p.group, None if p.scale is None else p.scale.dtype, p.high is not None,
            0 if p.scale_d is None else (p.shape[1] // p.scale_d.shape[1], p.shift is not None))


def _f16h(b: np.ndarray) -> torch.Tensor:
    """``[..., 2]`` uint8 (little-endian fp16) -> float16 ``[...]`` (GGUF's own d, m: the kernels
    widen them exactly)."""
    return torch.from_numpy(np.ascontiguousarray(b).view(np.float16)[..., 0].copy())


def _pack_nibbles(q: np.ndarray) -> torch.Tensor:
    """``q [N, K]`` (0..15) -> the int4 layout ``[N, K/2]`` (byte j of each 32: ``q[j] | q[16 + j] << 4``)."""
    n, k = q.shape
    v = q.reshape(n, k // 32, 2, 16)
    return torch.from_numpy(np.ascontiguousarray(v[:, :, 0] | (v[:, :, 1] << np.uint8(4))).reshape(n, k // 2))


def _blocks(data: np.ndarray, n: int, k: int, qtype) -> np.ndarray:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if k % block:
        raise ValueError(f"{k} weights per row is not a multiple of {qtype.name}'s block of {block}")
    raw = np.asarray(data).reshape(n, -1)
    if raw.dtype != np.uint8 or raw.shape[1] != k // block * size:
        raise ValueError(f"{qtype.name} data is {raw.dtype} {tuple(raw.shape)}, expected uint8 [{n}, "
                         f"{k // block * size}]")
    return raw.reshape(n, k // block, size)


def _k_scales(scales: np.ndarray, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and mins -> ``[n, nb * 8]`` each (int8, 0..63)."""
    import gguf

    sc, m = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(scales).reshape(-1, 12))
    return (torch.from_numpy(sc.reshape(n, -1).astype(np.int8)), torch.from_numpy(m.reshape(n, -1).astype(np.int8)))


def from_gguf(qtype: int, data: np.ndarray, shape: tuple[int, int], name: str = "") -> Stored:
    """A GGUF tensor ``[N, K]`` (numpy order: ``N`` rows of ``K``) in kvfleet's format for it (the
    module docstring's table). ``data`` may be a memory map: only the result is copied.

    Raises:
        ValueError: an unknown tensor type, or data of the wrong size for the type and shape.
    """
    import gguf

    try:
        qtype = gguf.GGMLQuantizationType(int(qtype))
    except ValueError:
        raise ValueError(f"{name or 'tensor'}: unknown GGUF tensor type {int(qtype)}") from None
    n, k = shape
    T = gguf.GGMLQuantizationType
    if qtype in (T.F32, T.F16):
        arr = np.asarray(data).reshape(n, k)
        return Stored("fp32", torch.from_numpy(arr.astype(np.float32)), source=qtype.name)
    if qtype == T.BF16:
        raw = np.ascontiguousarray(np.asarray(data)).reshape(n, -1).view(np.uint16).reshape(n, k)
        return Stored("bf16", torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16), source="BF16")
    if qtype in (T.Q4_0, T.Q4_1):
        b = _blocks(data, n, k, qtype)
        d = _f16h(b[..., 0:2]).float()   # float32: Int4Linear's float16 scales cost its small rows 9 % at one row
        if qtype == T.Q4_0:
            shift, qs = -8 * d, b[..., 2:]
        else:
            shift, qs = _f16h(b[..., 2:4]).float(), b[..., 4:]
        packed = torch.from_numpy(np.ascontiguousarray(qs).reshape(n, k // 2))
        return Stored("int4", packed, d.contiguous(), shift.contiguous(), 32, qtype.name)
    if qtype == T.Q5_0:  # d, 32 high bits (little-endian), 16 bytes of low nibbles: the 5-bit form as it is
        b = _blocks(data, n, k, qtype)
        nib = torch.from_numpy(np.ascontiguousarray(b[..., 6:]).reshape(n, k // 2))
        high = torch.from_numpy(np.ascontiguousarray(b[..., 2:6]).reshape(n, k // 8))
        return Stored("int8g", nib, _f16h(b[..., 0:2]), None, 32, "Q5_0", high)
    if qtype == T.Q5_1:  # d, m, 32 high bits (little-endian), 16 bytes of low nibbles
        b = _blocks(data, n, k, qtype)
        qh = np.unpackbits(np.ascontiguousarray(b[..., 4:8]), axis=-1, bitorder="little")   # [n, nb, 32]
        qs = b[..., 8:].reshape(n, k // 32, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        q = (qs & np.uint8(0x0F)).reshape(n, k // 32, 32) | (qh << np.uint8(4))
        return Stored("int8g", torch.from_numpy(q.reshape(n, k).view(np.int8).copy()), _f16h(b[..., 0:2]),
                      _f16h(b[..., 2:4]), 32, "Q5_1")
    if qtype == T.Q8_0:
        b = _blocks(data, n, k, qtype)
        q = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, k))
        return Stored("int8g", q, _f16h(b[..., 0:2]), None, 32, "Q8_0")
    if qtype in (T.Q4_K, T.Q5_K):
        b = _blocks(data, n, k, qtype)
        nb = k // QK_K
        d, neg_dmin = _f16h(b[..., 0:2]), -_f16h(b[..., 2:4])   # shift -(dmin * m) = (-dmin) * m, exactly
        sc, m = _k_scales(b[..., 4:16], n)
        qs = b[..., -128:].reshape(n, nb, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        ql = (qs & np.uint8(0x0F)).reshape(n, nb, 8, 32)
        if qtype == T.Q4_K:
            return Stored("int4", _pack_nibbles(ql.reshape(n, k)), sc, m, 32, "Q4_K", scale_d=d, shift_d=neg_dmin)
        qh = b[..., 16:48].reshape(n, nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
        q = ql | ((qh & np.uint8(1)) << np.uint8(4))
        return Stored("int8g", torch.from_numpy(q.reshape(n, k).view(np.int8).copy()), sc, m, 32, "Q5_K",
                      scale_d=d, shift_d=neg_dmin)
    if qtype == T.Q6_K:
        b = _blocks(data, n, k, qtype)
        nb = k // QK_K
        ql = b[..., 0:128].reshape(n, nb, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        ql = (ql & np.uint8(0x0F)).reshape(n, nb, 8, 32)
        qh = b[..., 128:192].reshape(n, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
        qh = (qh & np.uint8(0x03)).reshape(n, nb, 8, 32)
        q = (ql | (qh << np.uint8(4))).view(np.int8) - np.int8(32)
        scales = torch.from_numpy(np.ascontiguousarray(b[..., 192:208]).view(np.int8).reshape(n, nb * 16))
        return Stored("int8g", torch.from_numpy(q.reshape(n, k).copy()), scales, None, 16, "Q6_K",
                      scale_d=_f16h(b[..., 208:210]))
    if qtype in gguf.GGML_QUANT_SIZES and qtype not in (T.I8, T.I16, T.I32, T.I64, T.F64):
        w = gguf.quants.dequantize(np.asarray(data), qtype).reshape(n, k)
        logger.info("GGUF %s: %s has no exact kvfleet format; dequantized to bf16", name or "tensor", qtype.name)
        return Stored("bf16", torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to(torch.bfloat16),
                      source=qtype.name)
    raise ValueError(f"{name or 'tensor'}: GGUF tensor type {qtype.name} is not a weight kvfleet reads")


def to_float32(qtype: int, data: np.ndarray, name: str = "") -> torch.Tensor:
    """A small tensor (a norm's weight, a bias) as float32, whatever its stored type (``gguf``'s
    dequantization for quantized ones)."""
    import gguf

    try:
        qtype = gguf.GGMLQuantizationType(int(qtype))
    except ValueError:
        raise ValueError(f"{name or 'tensor'}: unknown GGUF tensor type {int(qtype)}") from None
    if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return torch.from_numpy(np.asarray(data).astype(np.float32))
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(np.asarray(data), qtype), dtype=np.float32))
