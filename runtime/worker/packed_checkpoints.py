"""4-bit checkpoints as users download them: AWQ (GEMM packing), GPTQ (v1 packing, ``g_idx`` /
act-order, symmetric and asymmetric) and compressed-tensors ``pack-quantized`` (W4A16), repacked at
load into kvfleet's int4 layers -- no gptqmodel / AutoAWQ dependency.

Contract: :func:`method_of` names the format of a config's ``quantization_config`` (None for a
plain checkpoint; :class:`PackedError` for a quantized one kvfleet cannot take, one line);
:func:`load` builds the model on the ``meta`` device (the quantization config dropped) and fills it
from the folder's safetensors (a ``group_size`` the scales do not match, an act-order checkpoint
without ``g_idx``: :class:`PackedError` naming the layer): each quantized linear layer becomes an
:class:`~kvfleet.runtime.worker.woq_linear.Int4Linear` whose float32 dequantization equals the
format's ``(q - z) * s`` exactly (``q * s + shift`` with ``shift = -z * s``: both products and the
sum are exact in float32 for fp16 scales and 4-bit integers), every other tensor float32.

Layouts (DESIGN.md, "Quantized formats, facts"; the formats' own loaders):

- AWQ GEMM: ``qweight`` int32 ``[K, N/8]``, eight 4-bit values per word along the output dim in
  the order 0, 2, 4, 6, 1, 3, 5, 7 (nibble ``i`` holds column ``8c + order[i]``), ``qzeros`` int32
  ``[K/G, N/8]`` alike, ``scales`` fp16 ``[K/G, N]``; ``w[k, n] = (q - z) * s``.
- GPTQ v1: ``qweight`` int32 ``[K/8, N]`` packed along the input dim (nibble ``i`` of word ``j``:
  ``k = 8j + i``), ``qzeros`` int32 ``[K/G, N/8]`` packed along the output dim, stored as ``z - 1``;
  ``scales`` ``[K/G, N]``; ``g_idx`` ``[K]`` the group of each input feature. With act-order
  (``g_idx`` not ``k // G``) the input features are sorted by group, so each group is contiguous,
  and the layer permutes its input the same way (:class:`PermutedInt4Linear`: exact; the fused
  decoder runs it as its int4 layer with an input permutation, ``kernels/cpu_perm.h``, so q/k/v
  and gate/up, quantized in one order from one input, stay one matrix each). Groups of unequal
  sizes: the layer is dequantized to bf16, logged.
- compressed-tensors pack-quantized: ``weight_packed`` int32 ``[N, K/8]`` along the input dim,
  values stored plus 8 (``q + 8`` for ``q`` in -8..7), ``weight_scale`` ``[N, K/G]``, optional
  ``weight_zero_point`` ``[N, K/G]`` (or packed ``[N/8, K/G]``; used wherever stored, even under
  ``symmetric``); ``weight_g_idx`` as GPTQ's.
- compressed-tensors int-quantized (W8A8 int8): ``weight`` int8 ``[N, K]``, ``weight_scale``
  ``[N, 1]`` (symmetric, per channel) -> ``Int8Linear`` with those very weights; the activations stay
  float32 (kvfleet's int8 kernels are weight-only: no int8 rounding of activations, logged).
"""

from __future__ import annotations

import json
import logging
import types
from pathlib import Path

import torch

from kvfleet.runtime.model_errors import INVALID_MODEL_FILE, UNSUPPORTED_QUANTIZATION

logger = logging.getLogger(__name__)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""Column of the output group of eight held by nibble ``i`` of an AWQ word."""
METHODS = ("awq", "gptq", "compressed-tensors")


class PackedError(ValueError):
    """A quantized checkpoint kvfleet cannot load (one line: the folder and the reason); ``reason``
    one of :data:`kvfleet.runtime.model_errors.REASONS` (a format kvfleet does not read, by default;
    a checkpoint whose tensors are not what its config says: ``InvalidModelFile``)."""

    bad_input = True

    def __init__(self, message: str, reason: str = UNSUPPORTED_QUANTIZATION) -> None:
        super().__init__(message)
        self.reason = reason


def _cfg(hf_config) -> dict | None:
    q = getattr(hf_config, "quantization_config", None)
    if q is None:
        return None
    return q if isinstance(q, dict) else q.to_dict()


def method_of(hf_config, where: str = "checkpoint") -> str | None:
    """``awq`` / ``gptq`` / ``compressed-tensors`` for a checkpoint kvfleet repacks, None for an
    unquantized one.

    Raises:
        PackedError: quantized in a way kvfleet does not read (another method, bits, packing)."""
    q = _cfg(hf_config)
    if q is None:
        return None
    method = str(q.get("quant_method", "")).lower()
    if method == "awq":
        if str(q.get("version", "gemm")).lower() != "gemm" or int(q.get("bits", q.get("w_bit", 4))) != 4:
            raise PackedError(f"{where}: AWQ {q.get('version')} with {q.get('bits', q.get('w_bit'))} bits: "
                              "kvfleet reads 4-bit GEMM packing only")
        return method
    if method == "gptq":
        fmt = str(q.get("checkpoint_format", "gptq")).lower()
        if int(q.get("bits", 4)) != 4 or fmt not in ("gptq", ""):
            raise PackedError(f"{where}: GPTQ {fmt} with {q.get('bits')} bits: kvfleet reads 4-bit v1 packing only")
        return method
    if method == "compressed-tensors":
        fmt = q.get("format")
        bits = 4 if fmt == "pack-quantized" else 8 if fmt in ("int-quantized", "naive-quantized") else None
        if bits is None:
            raise PackedError(f"{where}: compressed-tensors format {fmt!r}: kvfleet reads pack-quantized (W4A16) "
                              "and int-quantized (W8A8 int8)")
        for group in (q.get("config_groups") or {}).values():
            w = group.get("weights") or {}
            strategy = w.get("strategy", "group" if bits == 4 else "channel")
            if (int(w.get("num_bits", bits)) != bits or w.get("type", "int") != "int"
                    or (bits == 4 and group.get("input_activations"))
                    or (bits == 8 and (strategy != "channel" or not w.get("symmetric", True)))):
                raise PackedError(f"{where}: compressed-tensors {fmt} scheme {w} with activations "
                                  f"{group.get('input_activations')}: kvfleet reads int4 weight-only (pack-quantized) "
                                  "and symmetric per-channel int8 weights (int-quantized)")
        return method
    raise PackedError(f"{where}: quantization method {method!r} is not one kvfleet loads ({', '.join(METHODS)})")


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., C]`` -> ``[..., C, 8]`` uint8: nibble ``i`` (bits ``4i .. 4i + 3``)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((packed.to(torch.int32)[..., None] >> shifts) & 0xF).to(torch.uint8)


def _along_cols(packed: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """``[R, C/8]`` int32 packed along the columns -> ``[R, C]`` uint8."""
    nib = _nibbles(packed)
    if order is not None:  # nibble i holds column order[i]: column j comes from nibble inverse[j]
        inverse = [order.index(j) for j in range(8)]
        nib = nib[..., inverse]
    return nib.reshape(packed.shape[0], -1)


def _along_rows(packed: torch.Tensor) -> torch.Tensor:
    """``[R/8, C]`` int32 packed along the rows (nibble i of word j: row 8j + i) -> ``[R, C]`` uint8."""
    nib = _nibbles(packed)  # [R/8, C, 8]
    return nib.permute(0, 2, 1).reshape(-1, packed.shape[1])


class PermutedInt4Linear(torch.nn.Module):
    """An act-order layer: ``y = inner(x[..., perm])`` where ``inner`` is an ``Int4Linear`` over the
    weight's input features sorted by group (``perm``), so it equals the checkpoint's layer exactly.
    The fused decoder reads ``inner`` and ``perm`` (:mod:`kvfleet.runtime.worker.cpu_decode`) and
    gathers the input in its C step; this forward is the torch path's."""

    def __init__(self, inner: torch.nn.Module, perm: torch.Tensor) -> None:
        super().__init__()
        self.inner = inner
        self.in_features, self.out_features = inner.in_features, inner.out_features
        self.register_buffer("perm", perm.to(torch.int64), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """``inner``'s (packed) weight: its device and dtype, for code that reads ``layer.weight``."""
        return self.inner.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.index_select(-1, self.perm))


def _int4_module(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, group_of: torch.Tensor | None,
                 group: int, bias: torch.Tensor | None, name: str) -> torch.nn.Module:
    """The layer for ``w[n, k] = (q[n, k] - zero[n, g(k)]) * scale[n, g(k)]`` (``q [N, K]`` 0..15,
    ``zero`` / ``scale [N, K/G]``, ``g(k) = group_of[k]`` or ``k // G``)."""
    from kvfleet.kernels.cpu_woq import pack_int4
    from kvfleet.runtime.worker.woq_linear import Bf16Linear, Int4Linear

    n, k = q.shape
    scale = scale.float()
    if scale.dim() != 2 or scale.shape[0] != n or tuple(zero.shape) != tuple(scale.shape):
        raise PackedError(f"{name}: scales {list(scale.shape)} / zeros {list(zero.shape)} do not fit its "
                          f"{n} x {k} weight", INVALID_MODEL_FILE)
    if group > 0 and scale.shape[1] != -(-k // group):
        raise PackedError(f"{name}: quantization_config's group_size {group} does not match the checkpoint: "
                          f"{scale.shape[1]} groups of scales over {k} input features", INVALID_MODEL_FILE)
    if group_of is not None and (group_of.shape != (k,) or group_of.dtype.is_floating_point or (k and (
            int(group_of.min()) < 0 or int(group_of.max()) >= scale.shape[1]))):
        raise PackedError(f"{name}: g_idx must hold {k} group indices in 0..{scale.shape[1] - 1} "
                          f"(got shape {list(group_of.shape)}, {group_of.dtype})", INVALID_MODEL_FILE)
    shell = types.SimpleNamespace(in_features=k, out_features=n, bias=bias)
    perm = None
    if group_of is not None and not torch.equal(group_of.long(), torch.arange(k) // group):
        perm = torch.argsort(group_of.long(), stable=True)
        counts = torch.bincount(group_of.long(), minlength=scale.shape[1])
        if not bool((counts == group).all()) or k % 32:
            w = (q.float() - zero.float()[:, group_of.long()]) * scale[:, group_of.long()]
            logger.info("%s: act-order groups of unequal sizes; dequantized to bf16", name)
            lin = torch.nn.Linear(k, n, bias=bias is not None, device="meta")
            lin.weight = torch.nn.Parameter(w, requires_grad=False)
            if bias is not None:
                lin.bias = torch.nn.Parameter(bias, requires_grad=False)
            return Bf16Linear.from_linear(lin)
        q = q[:, perm]
    if group % 32 or k % group:
        raise PackedError(f"{name}: group size {group} (K {k}) is not a multiple of 32 dividing K")
    layer = Int4Linear.from_blocks(shell, pack_int4(q.contiguous()), scale.contiguous(),
                                   (-zero.float() * scale).contiguous(), group)
    return layer if perm is None else PermutedInt4Linear(layer, perm)


def _group(q: dict) -> int:
    for key in ("group_size", "q_group_size"):
        if key in q:
            return int(q[key])
    for group in (q.get("config_groups") or {}).values():
        w = group.get("weights") or {}
        if w.get("group_size"):
            return int(w["group_size"])
    return -1


def _layer(method: str, t: dict[str, torch.Tensor], prefix: str, group: int, act_order: bool) -> torch.nn.Module:
    g_idx = t.get(f"{prefix}.g_idx" if method == "gptq" else f"{prefix}.weight_g_idx")
    if act_order and g_idx is None and method != "awq":
        raise PackedError(f"{prefix}: the checkpoint is act-order (quantization_config) but has no g_idx "
                          "for this layer (its groups cannot be known)", INVALID_MODEL_FILE)
    bias = t.get(f"{prefix}.bias")
    bias = None if bias is None else bias.float()
    if method == "awq":
        q = _along_cols(t[f"{prefix}.qweight"], AWQ_ORDER).T  # [N, K]
        z = _along_cols(t[f"{prefix}.qzeros"], AWQ_ORDER).T
        s = t[f"{prefix}.scales"].T
        g = q.shape[1] // s.shape[1] if group <= 0 else group
        return _int4_module(q, z, s, None, g, bias, prefix)
    if method == "gptq":
        q = _along_rows(t[f"{prefix}.qweight"]).T  # [N, K]
        n = q.shape[0]
        z = (_along_cols(t[f"{prefix}.qzeros"])[:, :n].to(torch.int16) + 1).T  # v1: stored z - 1
        s = t[f"{prefix}.scales"].T
        g = q.shape[1] // s.shape[1] if group <= 0 else group
        return _int4_module(q, z, s, g_idx, g, bias, prefix)
    if f"{prefix}.weight_packed" not in t:  # int-quantized (W8A8): int8 weights, a scale per output channel
        from kvfleet.runtime.worker.woq_linear import Int8Linear

        w8 = t[f"{prefix}.weight"]
        n, k = w8.shape
        layer = Int8Linear.__new__(Int8Linear)
        torch.nn.Module.__init__(layer)
        layer.in_features, layer.out_features = k, n
        layer.register_buffer("weight", w8.to(torch.int8).contiguous(), persistent=False)
        layer.register_buffer("qscale", t[f"{prefix}.weight_scale"].float().reshape(n).contiguous(), persistent=False)
        layer.register_buffer("bias32", bias, persistent=False)
        layer.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        return layer
    packed = t[f"{prefix}.weight_packed"]
    q = _along_cols(packed)  # [N, K]: stored q + 8
    s = t[f"{prefix}.weight_scale"]
    n = q.shape[0]
    zp = t.get(f"{prefix}.weight_zero_point")  # used where stored, as compressed-tensors' own decompressor does
    if zp is None:
        z = torch.full(s.shape, 8, dtype=torch.int16)
    else:
        if zp.dtype == torch.int32 and zp.shape[0] * 8 == n:  # packed along the output dim
            zp = _along_cols(zp.T.contiguous()).T.to(torch.int16) - 8
        z = zp.to(torch.int16) + 8
    g = q.shape[1] // s.shape[1] if group <= 0 else group
    return _int4_module(q, z, s, g_idx, g, bias, prefix)


_KEYS = {"awq": "qweight", "gptq": "qweight", "compressed-tensors": "weight_packed"}
_PARTS = {"qweight", "qzeros", "scales", "g_idx", "bias", "weight_packed", "weight_scale", "weight_zero_point",
          "weight_g_idx", "weight_shape", "weight", "input_scale", "input_zero_point"}


def load(path: Path, hf_config, attn_implementation="sdpa") -> torch.nn.Module:
    """The model of checkpoint folder ``path`` (``hf_config`` its config, quantized by
    :func:`method_of`'s ``awq`` / ``gptq`` / ``compressed-tensors``) with its quantized layers as
    int4 kernels' layers, in eval mode.

    Raises:
        PackedError: a layout it cannot read (one line)."""
    from safetensors import safe_open

    from kvfleet.runtime.worker.gguf_model import _check_filled, _empty_model, _replace, _set_param

    path = Path(path)
    method = method_of(hf_config, str(path))
    q = _cfg(hf_config)
    group = _group(q)
    act_order = bool(q.get("desc_act")) or any(
        (g.get("weights") or {}).get("actorder") in (True, "group") for g in (q.get("config_groups") or {}).values())
    config = type(hf_config).from_dict({k: v for k, v in hf_config.to_dict().items() if k != "quantization_config"})
    model = _empty_model(config, attn_implementation)
    tensors: dict[str, torch.Tensor] = {}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise PackedError(f"{path}: no *.safetensors files", INVALID_MODEL_FILE)
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    tensors[key] = st.get_tensor(key)
        except Exception as exc:  # safetensors' own error type (a truncated or corrupt file)
            raise PackedError(f"{f}: not a readable safetensors file ({type(exc).__name__}: {exc})",
                              INVALID_MODEL_FILE) from None
    key = _KEYS[method]
    if method == "compressed-tensors" and q.get("format") != "pack-quantized":
        key = "weight_scale"  # int-quantized: every quantized layer has one; its weight is int8
        logger.info("%s: W8A8 int8 weights run as stored with float32 activations (not quantized to int8: "
                    "kvfleet's int8 kernels are weight-only)", path.name)
    prefixes = sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith("." + key)})
    try:
        for prefix in prefixes:
            _replace(model, prefix, _layer(method, tensors, prefix, group, act_order))
    except PackedError as exc:
        raise PackedError(f"{path}: {exc}", exc.reason) from None
    except (KeyError, RuntimeError) as exc:
        raise PackedError(f"{path}: {method} layout not as expected ({type(exc).__name__}: {exc})",
                          INVALID_MODEL_FILE) from None
    done = set(prefixes)
    names = dict(model.named_parameters())
    for key, value in tensors.items():
        prefix, _, part = key.rpartition(".")
        if prefix in done and part in _PARTS:
            continue
        if key in names:
            _set_param(model, key, value.float())
        else:
            logger.info("%s: tensor %s has no place in the model; skipped", path.name, key)
    if getattr(config, "tie_word_embeddings", False):
        head = model.get_output_embeddings()
        if head is not None and head.weight.is_meta:
            head.weight = model.get_input_embeddings().weight
    _check_filled(model, path)
    logger.info("%s: %s checkpoint, %d linear layers repacked onto the int4 kernels (group %d%s)", path.name,
                method, len(prefixes), group, ", act-order" if any(
                    isinstance(m, PermutedInt4Linear) for m in model.modules()) else "")
    model.eval()
    model.requires_grad_(False)
    return model


def bf16_head(model: torch.nn.Module, native_bf16_prefill: bool = False) -> bool:
    """Store the LM head, the checkpoint's unquantized float32 output layer, in bf16 (a
    :class:`~kvfleet.runtime.worker.woq_linear.Bf16Linear`, weights rounded to nearest even: half
    the bytes each decode token reads; a tied head becomes its own copy, the input embedding stays
    float32 for the lookups). The plan asks for it (``CpuPlan.bf16_weights`` of a packed checkpoint:
    CPUs with native bf16, docs/performance.md "Packed 4-bit checkpoints"); steps of more than 32
    rows through torch run oneDNN's native bf16 matmul only with ``native_bf16_prefill`` (the plan's:
    off under ``--batch-invariant``). Returns whether a head was converted (False: no float32
    ``nn.Linear`` head)."""
    from kvfleet.runtime.worker.woq_linear import Bf16Linear

    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.weight.dtype != torch.float32:
        return False
    new = Bf16Linear.from_linear(head)
    new.prefill_bf16 = native_bf16_prefill
    model.set_output_embeddings(new)
    if getattr(model.config, "tie_word_embeddings", False):
        model.config.tie_word_embeddings = False  # the head is its own (bf16) copy now
    return True


def config_json_method(path: Path) -> str | None:
    """:func:`method_of` from a folder's ``config.json`` alone (no transformers config class)."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    return method_of(types.SimpleNamespace(quantization_config=cfg.get("quantization_config")), str(path))
