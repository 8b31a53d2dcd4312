"""Read a PEFT LoRA checkpoint as PEFT writes it, and check that kvfleet can serve it.

A PEFT adapter folder holds ``adapter_config.json`` (``LoraConfig``: ``peft_type`` ``LORA``,
``r``, ``lora_alpha``, ``use_rslora``, ``target_modules``, ...) and ``adapter_model.safetensors``
whose keys are ``base_model.model.<module path>.lora_A.weight`` (``[r, in_features]``) and
``...lora_B.weight`` (``[out_features, r]``). The adapter adds ``scaling * B @ A`` to each targeted
linear layer's weight, with ``scaling = lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with
rsLoRA (Kalajdzievski 2023; PEFT's ``use_rslora``); ``rank_pattern`` / ``alpha_pattern`` give
some modules their own rank and alpha (PEFT's regex-or-suffix key match).

Refused, with a :class:`~kvfleet.runtime.lora_request.LoRALoadError` that says why: a missing
folder or file; a ``peft_type`` other than LORA; DoRA (``use_dora``: a weight-magnitude vector
per layer, not a low-rank delta the batched matmuls can add); adapters of the embedding or the LM
head (``embed_tokens`` / ``lm_head`` targets, ``modules_to_save``, ``trainable_token_indices``:
they change weights shared by every adapter in a batch); ``bias`` other than ``none``;
``fan_in_fan_out`` (Conv1D layouts); a module that is not a linear layer of the decoder; shapes
that do not match the base model; a rank over ``max_lora_rank``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kvfleet.runtime.lora_request import LoRALoadError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY_RE = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.default)?\.weight$")
_HEAD_MODULES = ("embed_tokens", "lm_head", "wte", "embed_out", "word_embeddings")


@dataclass
class LoRAWeights:
    """One adapter's weights on the host.

    Attributes:
        rank: the largest rank of its modules.
        modules: module path in the base model (``model.layers.3.self_attn.q_proj``) ->
            ``(A [r, in_features], B [out_features, r])`` float32 with the scaling folded into B
            (``B * scaling``), so that the delta of a layer is ``x @ A.T @ B.T``.
        scalings: module path -> the scaling that was folded in (``lora_alpha / r`` or rsLoRA's
            ``lora_alpha / sqrt(r)``).
    """

    rank: int
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]
    scalings: dict[str, float]

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.modules.values())


def _pattern_value(pattern: dict, module: str, default):
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` lookup: the first key that matches the module
    path as a regex anchored at a dot boundary at its end (``peft.tuners.tuners_utils`` semantics)."""
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_lora_config(path: Path) -> dict:
    """The adapter's ``adapter_config.json``, checked (see the module docstring for what is refused).

    Raises:
        LoRALoadError: naming the field and why."""
    if not path.is_dir():
        raise LoRALoadError(f"lora_path {str(path)!r}: no such directory (a PEFT adapter folder is expected)")
    cfg_path = path / CONFIG_FILE
    if not cfg_path.is_file():
        raise LoRALoadError(f"lora_path {str(path)!r}: no {CONFIG_FILE} (not a PEFT adapter folder)")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise LoRALoadError(f"lora_path {str(path)!r}: {CONFIG_FILE} is not readable JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise LoRALoadError(f"lora_path {str(path)!r}: {CONFIG_FILE} is not a JSON object")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRALoadError(f"lora_path {str(path)!r}: peft_type {peft_type} is not supported (only LORA)")
    if cfg.get("use_dora"):
        raise LoRALoadError(f"lora_path {str(path)!r}: DoRA adapters (use_dora) are not supported: their per-layer "
                            "magnitude vector rescales the merged weight, which batched low-rank matmuls cannot add")
    for key in ("modules_to_save", "trainable_token_indices", "target_parameters", "layer_replication"):
        if cfg.get(key):
            raise LoRALoadError(f"lora_path {str(path)!r}: {key} is not supported: it replaces base-model weights "
                                "(embedding, LM head or whole layers) that every adapter in a batch shares")
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    heads = [t for t in targets if any(h in str(t) for h in _HEAD_MODULES)]
    if heads:
        raise LoRALoadError(f"lora_path {str(path)!r}: adapters of the embedding or LM head ({', '.join(heads)}) are "
                            "not supported: only the decoder's linear layers take per-request adapters")
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias"):
        raise LoRALoadError(f"lora_path {str(path)!r}: bias={cfg.get('bias')!r} / lora_bias is not supported "
                            "(only bias='none')")
    if cfg.get("fan_in_fan_out"):
        raise LoRALoadError(f"lora_path {str(path)!r}: fan_in_fan_out (Conv1D layouts) is not supported")
    r = cfg.get("r")
    if not isinstance(r, int) or r < 1:
        raise LoRALoadError(f"lora_path {str(path)!r}: r must be a positive integer, got {r!r}")
    return cfg


def load_lora_weights(path: str | Path, targets: dict[str, tuple[int, int]], max_lora_rank: int) -> LoRAWeights:
    """Read and check a PEFT adapter for a base model.

    Args:
        path: the adapter folder.
        targets: the base model's adaptable layers: module path -> ``(in_features, out_features)``.
        max_lora_rank: the largest rank accepted (``--max-lora-rank``).

    Returns: the adapter's :class:`LoRAWeights` (float32, host memory).

    Raises:
        LoRALoadError: see the module docstring; the message names the folder and the reason.
    """
    from safetensors.torch import load_file

    path = Path(path).expanduser()
    cfg = read_lora_config(path)
    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file():
        raise LoRALoadError(f"lora_path {str(path)!r}: no {WEIGHTS_FILE} (kvfleet reads PEFT's safetensors format)")
    try:
        tensors = load_file(str(weights_path), device="cpu")
    except Exception as exc:
        raise LoRALoadError(f"lora_path {str(path)!r}: {WEIGHTS_FILE} is not readable: {exc}") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY_RE.match(key)
        if m is None:
            what = "a DoRA magnitude vector" if "lora_magnitude_vector" in key else "not a LoRA A/B matrix"
            if "lora_embedding" in key:
                what = "an embedding adapter"
            raise LoRALoadError(f"lora_path {str(path)!r}: tensor {key!r} is {what}; not supported")
        pairs.setdefault(m["module"], {})[m["ab"]] = tensor
    if not pairs:
        raise LoRALoadError(f"lora_path {str(path)!r}: {WEIGHTS_FILE} holds no LoRA weights")
    base_r, base_alpha = cfg["r"], cfg.get("lora_alpha", cfg["r"])
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    scalings: dict[str, float] = {}
    rank = 0
    for module, ab in sorted(pairs.items()):
        leaf = module.rsplit(".", 1)[-1]
        if module not in targets:
            why = ("the embedding or LM head is not adaptable per request" if leaf in _HEAD_MODULES
                   else "it is not a linear layer of the base model's decoder")
            raise LoRALoadError(f"lora_path {str(path)!r}: target module {module!r} is not supported: {why}")
        if set(ab) != {"A", "B"}:
            raise LoRALoadError(f"lora_path {str(path)!r}: {module!r} lacks its lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"].float(), ab["B"].float()
        r = a.shape[0]
        in_f, out_f = targets[module]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape != (out_f, r):
            raise LoRALoadError(
                f"lora_path {str(path)!r}: {module!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                f"the base layer needs [r, {in_f}] and [{out_f}, r] (an adapter of another model?)"
            )
        if r > max_lora_rank:
            raise LoRALoadError(f"lora_path {str(path)!r}: rank {r} of {module!r} is over --max-lora-rank "
                                f"({max_lora_rank}); raise --max-lora-rank to serve it")
        expected_r = _pattern_value(cfg.get("rank_pattern"), module, base_r)
        if r != expected_r:
            raise LoRALoadError(f"lora_path {str(path)!r}: {module!r} has rank {r}, its config says {expected_r}")
        alpha = _pattern_value(cfg.get("alpha_pattern"), module, base_alpha)
        scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        modules[module] = (a.contiguous(), (b * scaling).contiguous())
        scalings[module] = float(scaling)
        rank = max(rank, r)
    return LoRAWeights(rank=rank, modules=modules, scalings=scalings)
