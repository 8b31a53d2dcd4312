"""A GGUF checkpoint's own 4-bit weights, kept as they are: Q4_1 blocks as kvfleet int4 layers.

A GGUF file's Q4_1 tensor stores each row in blocks of 32 weights: an fp16 scale ``d``, an fp16
minimum ``m`` and 16 bytes of nibbles (byte ``j``: weight ``j`` in its low nibble, weight
``16 + j`` in its high one), and means ``w = q * d + m``. That is exactly the layout and formula of
kvfleet's groupwise int4 kernels (:class:`~kvfleet.runtime.worker.woq_linear.Int4Linear`, group
size 32: ``qscale = d``, ``qshift = m``), so such a checkpoint runs on the int4 kernels with the
weights it ships, not re-quantized and not widened to float32: a quarter of float32's bytes per
decode token at no loss (llama.cpp's own storage of the same file).

:func:`q4_1_layers` reads the Q4_1 linear weights of a Llama-family GGUF file (the layer names
transformers' GGUF loader maps them to); :func:`use_q4_1_weights` swaps a loaded model's float32
linear layers for them (q and k rows un-permuted as transformers does), each only after its
dequantized weight matched the float32 weight transformers produced from the same file; then
they are cached beside that float32 checkpoint (:data:`CACHE_FILE`), so later loads take ~0.1 s.
:func:`kvfleet.runtime.worker.model_loader.load_model` calls it when the CPU plan says so
(:mod:`kvfleet.runtime.worker.cpu_plan`: ``dtype auto``, no ``--quantization``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

GROUP = 32
"""Weights per Q4_1 block (ggml's ``QK4_1``)."""
_BLOCK_BYTES = 4 + GROUP // 2

_LLAMA_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
"""GGUF tensor name (``blk.<i>.<name>.weight``) -> the Llama module under ``model.layers.<i>``."""

_ARCHITECTURES = ("llama", "mistral", "qwen2")


CACHE_FILE = "kvfleet/q4_1_layers.st"
"""The file, under the GGUF file's conversion cache folder, that holds its Q4_1 layers in the
kernels' layout (safetensors format; written once, after every layer matched the converted float32
weights). It sits in a subfolder with its own suffix because that folder is a plain Hugging Face
checkpoint other servers load too (vLLM reads every ``*.safetensors`` file at its top level)."""


def _reader(gguf_file: Path):
    import gguf

    return gguf.GGUFReader(str(gguf_file))  # parses the whole header: ~3 s for a 49k-token vocabulary


def _unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's rotary permutation of q / k rows (transformers'
    ``LlamaTensorProcessor._reverse_permute_weights``, as an index)."""
    dim = n_rows // n_head // 2
    return torch.arange(n_rows).reshape(n_head, dim, 2).transpose(2, 1).reshape(n_rows)


def _extract(gguf_file: Path) -> dict[str, torch.Tensor]:
    """The file's Q4_1 linear weights of a Llama-family architecture, in GGUF row order:
    ``<module>.packed [N, K/2]`` uint8, ``<module>.scale`` and ``<module>.shift [N, K/32]`` float32."""
    import gguf

    reader = _reader(gguf_file)
    field = reader.fields.get("general.architecture")
    if field is None or bytes(field.parts[-1]).decode() not in _ARCHITECTURES:
        return {}
    out = {}
    for t in reader.tensors:
        parts = t.name.split(".")
        if (t.tensor_type != gguf.GGMLQuantizationType.Q4_1 or len(parts) != 4 or parts[0] != "blk"
                or parts[2] not in _LLAMA_NAMES or parts[3] != "weight"):
            continue
        rows = np.asarray(t.data)  # [N, K / 32 * 20] uint8
        n, k = rows.shape[0], rows.shape[1] // _BLOCK_BYTES * GROUP
        blocks = rows.reshape(n, k // GROUP, _BLOCK_BYTES)
        name = f"model.layers.{parts[1]}.{_LLAMA_NAMES[parts[2]]}"
        out[f"{name}.scale"] = torch.from_numpy(blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
        out[f"{name}.shift"] = torch.from_numpy(blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
        out[f"{name}.packed"] = torch.from_numpy(np.ascontiguousarray(blocks[:, :, 4:]).reshape(n, k // 2))
    return out


def q4_1_layers(gguf_file: Path, cache_folder: Path | None) -> dict[str, torch.Tensor]:
    """:func:`_extract`'s tensors, read from ``cache_folder / CACHE_FILE`` when it is there (fast),
    else from the file (seconds). Empty for a file with none."""
    from safetensors.torch import load_file

    cached = None if cache_folder is None else cache_folder / CACHE_FILE
    if cached is not None and cached.is_file():
        return load_file(str(cached))
    return _extract(gguf_file)


def has_q4_1_layers(gguf_file: Path, cache_folder: Path | None) -> bool:
    """Whether the file has Q4_1 linear weights kvfleet can run as stored."""
    cached = None if cache_folder is None else cache_folder / CACHE_FILE
    if cached is not None and cached.is_file():
        return True
    return bool(_extract(gguf_file))


def use_q4_1_weights(model: torch.nn.Module, gguf_file: Path, cache_folder: Path | None = None) -> int:
    """Replace ``model``'s float32 linear layers by :class:`Int4Linear` layers over the file's own
    Q4_1 blocks; returns how many were replaced (0 for another architecture or no Q4_1 tensor).

    Read from the file, a layer is replaced only when its dequantized weight equals the loaded
    float32 weight (to the float32 rounding of ``q * d + m``); a mismatch (a layout this code does
    not know) keeps the float32 layer and logs a warning. When every layer matched, the layers are
    written to ``cache_folder`` and later loads read them from there without checking again."""
    from kvfleet.runtime.worker.woq_linear import Int4Linear

    cached = cache_folder is not None and (cache_folder / CACHE_FILE).is_file()
    tensors = q4_1_layers(gguf_file, cache_folder)
    cfg = model.config.get_text_config()
    heads = {"q_proj": cfg.num_attention_heads,
             "k_proj": getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads}
    names = sorted({k.rsplit(".", 1)[0] for k in tensors})
    replaced = 0
    for name in names:
        packed, scale, shift = (tensors[f"{name}.{part}"] for part in ("packed", "scale", "shift"))
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, child)
        if type(linear) is not torch.nn.Linear or linear.weight.dtype != torch.float32:
            continue
        if child in heads:
            order = _unpermute_rows(packed.shape[0], heads[child])
            packed, scale, shift = packed[order], scale[order], shift[order]
        layer = Int4Linear.from_blocks(linear, packed, scale, shift, GROUP)
        if not cached and not torch.allclose(layer.dequantized(), linear.weight.detach(), rtol=1e-6, atol=1e-7):
            logger.warning("GGUF Q4_1 weights: %s does not match the float32 weight; kept float32", name)
            continue
        setattr(parent, child, layer)
        replaced += 1
    if not cached and cache_folder is not None and replaced == len(names) and names:
        _write_cache(tensors, cache_folder / CACHE_FILE)
    return replaced


def _write_cache(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp))
        os.replace(tmp, path)
    except OSError as exc:  # a read-only cache (an image) only costs the check again next time
        logger.info("GGUF Q4_1 weights: not cached (%s)", exc)
        tmp.unlink(missing_ok=True)
