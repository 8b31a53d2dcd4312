"""Random PEFT LoRA adapters of the default model, made in the test (no download), and the
greedy tokens of PEFT's merged model for them (the reference the engine must match)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(path: Path, seed: int, prompts: list[list[int]], max_tokens: int, *, r: int = 8,
                 alpha: int = 16, use_rslora: bool = False) -> list[list[int]]:
    """Save a rank-``r`` LoRA adapter over every attention and MLP projection of a fresh copy of
    the default model (fp32, CPU) to ``path`` with PEFT, its A and B drawn from ``seed`` (B
    non-zero, so that it changes the outputs); return the greedy tokens of PEFT's merged model
    (``merge_and_unload``) for each prompt (``max_tokens`` each, EOS ignored)."""
    from peft import LoraConfig, get_peft_model

    from kvfleet.runtime.worker.model_loader import load_model

    base = load_model(None, dtype="float32", device="cpu")
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=TARGETS, use_rslora=use_rslora,
                        init_lora_weights=False, lora_dropout=0.0)
    model = get_peft_model(base.model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model.save_pretrained(str(path))
    merged = model.merge_and_unload().eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            res = merged.generate(torch.tensor([ids]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                  do_sample=False, pad_token_id=0)
            out.append(res[0, len(ids):].tolist())
    return out


def edit_config(src: Path, dst: Path, **changes) -> Path:
    """A copy of adapter folder ``src`` at ``dst`` whose adapter_config.json has ``changes``."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def double_rank(src: Path, dst: Path) -> Path:
    """A copy of adapter ``src`` at ``dst`` with twice its rank (each A and B stacked twice)."""
    from safetensors.torch import load_file, save_file

    edit_config(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    tensors = load_file(str(src / "adapter_model.safetensors"))
    doubled = {k: torch.cat([t, t], dim=0 if "lora_A" in k else 1).contiguous() for k, t in tensors.items()}
    save_file(doubled, str(dst / "adapter_model.safetensors"))
    cfg["r"] = cfg["r"] * 2
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def scaled_b(src: Path, dst: Path, factor: float) -> Path:
    """A copy of adapter ``src`` at ``dst`` with every lora_B times ``factor`` (another adapter, no model load)."""
    from safetensors.torch import load_file, save_file

    edit_config(src, dst)
    tensors = load_file(str(src / "adapter_model.safetensors"))
    save_file({k: (t * factor if "lora_B" in k else t).contiguous() for k, t in tensors.items()},
              str(dst / "adapter_model.safetensors"))
    return dst


SMOLLM2_SHAPES = {"self_attn.q_proj": (576, 576), "self_attn.k_proj": (576, 192), "self_attn.v_proj": (576, 192),
                  "self_attn.o_proj": (576, 576), "mlp.gate_proj": (576, 1536), "mlp.up_proj": (576, 1536),
                  "mlp.down_proj": (1536, 576)}
"""``(in_features, out_features)`` of the default model's projections (30 layers)."""


def random_adapter(path: Path, seed: int, r: int = 8) -> Path:
    """A rank-``r`` adapter of the default model in PEFT's file layout from random tensors, without
    loading the model or PEFT (for the HTTP and operator tests; tests/unit/runtime/engine/test_lora.py checks
    real PEFT output)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(30):
        for mod, (d_in, d_out) in SMOLLM2_SHAPES.items():
            key = f"base_model.model.model.layers.{layer}.{mod}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, d_in, generator=gen) / d_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, r, generator=gen) * 0.05
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r,
                                                          "target_modules": TARGETS, "bias": "none"}))
    return path


def lora_isvc(adapters: list[dict]) -> dict:
    """The InferenceService ``lora-svc`` (namespace ``default``) of the default model, served as
    ``smollm2``, with ``adapters`` as ``spec.model.adapters``."""
    return {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "lora-svc", "namespace": "default", "uid": "u-1", "generation": 1},
            "spec": {"model": {"uri": "file:///models/smollm2.gguf", "servedModelName": "smollm2", "adapters": adapters},
                     "engine": {"maxModelLen": 256, "extraArgs": {"kv_cache_memory": "64MiB", "max_lora_rank": 8}}}}
