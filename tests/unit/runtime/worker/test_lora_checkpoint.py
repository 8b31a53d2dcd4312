"""PEFT adapter folders (kvfleet.runtime.worker.lora_checkpoint; issue 17): scaling, rsLoRA,
``rank_pattern`` / ``alpha_pattern``, and the refusals (rank over ``--max-lora-rank``, a
non-linear target, mismatched shapes, DoRA, embeddings, no config)."""

from __future__ import annotations

import json

import pytest
import torch

from kvfleet.runtime.lora_request import LoRALoadError
from kvfleet.runtime.worker.lora_checkpoint import load_lora_weights


def write_adapter(path, cfg: dict, tensors: dict[str, torch.Tensor]):
    from safetensors.torch import save_file

    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def test_peft_checkpoint_scaling_rank_pattern_and_refusals(tmp_path):
    targets = {"model.layers.0.self_attn.q_proj": (6, 6), "model.layers.0.mlp.down_proj": (10, 6)}
    tensors = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 6),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(6, 2),
        "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight": torch.ones(4, 10),
        "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight": torch.ones(6, 4),
    }
    cfg = {"peft_type": "LORA", "r": 2, "lora_alpha": 8, "rank_pattern": {"down_proj": 4},
           "alpha_pattern": {"down_proj": 2}, "target_modules": ["q_proj", "down_proj"]}
    w = load_lora_weights(write_adapter(tmp_path / "ok", cfg, tensors), targets, max_lora_rank=8)
    assert w.rank == 4
    assert w.scalings == {"model.layers.0.self_attn.q_proj": 4.0, "model.layers.0.mlp.down_proj": 0.5}
    assert torch.equal(w.modules["model.layers.0.mlp.down_proj"][1], torch.full((6, 4), 0.5))
    rs = load_lora_weights(write_adapter(tmp_path / "rs", {**cfg, "use_rslora": True}, tensors), targets, 8)
    assert rs.scalings["model.layers.0.self_attn.q_proj"] == pytest.approx(8 / 2**0.5)
    with pytest.raises(LoRALoadError, match="over --max-lora-rank"):
        load_lora_weights(tmp_path / "ok", targets, max_lora_rank=2)
    with pytest.raises(LoRALoadError, match="not a linear layer"):
        load_lora_weights(tmp_path / "ok", {"model.layers.0.self_attn.q_proj": (6, 6)}, 8)
    with pytest.raises(LoRALoadError, match=r"\[r, 5\]"):
        load_lora_weights(tmp_path / "ok", {**targets, "model.layers.0.self_attn.q_proj": (5, 6)}, 8)
    dora = {**tensors, "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": torch.ones(6)}
    with pytest.raises(LoRALoadError, match="DoRA"):
        load_lora_weights(write_adapter(tmp_path / "dora", cfg, dora), targets, 8)
    emb = {**tensors, "base_model.model.model.embed_tokens.lora_embedding_A": torch.ones(2, 6)}
    with pytest.raises(LoRALoadError, match="embedding"):
        load_lora_weights(write_adapter(tmp_path / "emb", cfg, emb), targets, 8)
    with pytest.raises(LoRALoadError, match="no adapter_config.json"):
        load_lora_weights(tmp_path, targets, 8)
