"""kvfleet.runtime.worker.recipes: each family's recipe resolved from transformers' own configs
(``AutoConfig.for_model``, no download), the fields each family's features set, the reasons for
what the fused path cannot take, and that the module imports no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
from transformers import AutoConfig

from kvfleet.runtime.worker.recipes import RECIPES, Recipe, families_table, layer_windows, recipe_for

DENSE = tuple(f for f, r in RECIPES.items() if r.unsupported is None and not r.moe)
MOE = tuple(f for f, r in RECIPES.items() if r.moe)


def test_the_issue_families_are_recipes():
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma3_text", "glm4", "phi3", "olmo2", "granite"} <= set(DENSE)
    assert {"mixtral", "qwen3_moe"} <= set(MOE)


def _config(model_type: str, **fields):
    return AutoConfig.for_model(model_type, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
                                num_key_value_heads=2, intermediate_size=128, vocab_size=100, **fields)


@pytest.mark.parametrize("family", DENSE)
def test_every_dense_family_has_a_recipe(family):
    r = recipe_for(_config(family))
    assert isinstance(r, Recipe), r
    assert r.family == family and r.layer is RECIPES[family]
    assert len(r.windows) == len(r.layer_rope) == 6 and all(0 <= i < len(r.rope_keys) for i in r.layer_rope)
    assert 0 < r.rotary_dim <= r.head_size and r.act in ("silu", "gelu_tanh")
    assert set(r.layer.norms) <= {"attn_in", "attn_out", "mlp_in", "mlp_out"}


def test_llama_is_the_plain_layer():
    r = recipe_for(_config("llama", head_dim=16))
    assert r.layer.norms == {"attn_in": "input_layernorm", "mlp_in": "post_attention_layernorm"}
    assert (r.act, r.rotary_dim, r.rotary_interleaved, r.layer.qk_norm) == ("silu", 16, False, "none")
    assert (r.attn_scale, r.embed_scale, r.residual_scale, r.logit_scale, r.logit_softcap) == (0.25, 1, 1, 1, None)
    assert r.windows == (0,) * 6 and r.rope_keys == (None,)


def test_gemma3_local_and_global_layers():
    r = recipe_for(_config("gemma3_text", head_dim=16, sliding_window=32, query_pre_attn_scalar=64,
                           final_logit_softcapping=30.0))
    assert r.layer.norm_offset == 1.0 and r.layer.qk_norm == "head" and r.act == "gelu_tanh"
    assert len(r.layer.norms) == 4
    assert r.windows == (32, 32, 32, 32, 32, 0)  # 5 local : 1 global
    assert r.rope_keys == ("full_attention", "sliding_attention") and r.layer_rope == (1, 1, 1, 1, 1, 0)
    assert r.attn_scale == 64 ** -0.5 and r.logit_softcap == 30.0


def test_glm4_rotates_half_of_each_head_in_pairs():
    r = recipe_for(_config("glm4", head_dim=32))
    assert (r.rotary_dim, r.rotary_interleaved) == (16, True)
    assert r.layer.gate_up == ("gate_up_proj",) and r.layer.norms["mlp_in"] == "post_attention_layernorm"


def test_phi3_olmo2_granite():
    phi = recipe_for(_config("phi3", partial_rotary_factor=0.75))
    assert phi.layer.qkv == ("qkv_proj",) and phi.rotary_dim == 12
    olmo = recipe_for(_config("olmo2"))
    assert olmo.layer.qk_norm == "proj" and set(olmo.layer.norms) == {"attn_out", "mlp_out"}
    granite = recipe_for(_config("granite", attention_multiplier=0.1, residual_multiplier=0.2,
                                 embedding_multiplier=12.0, logits_scaling=8.0))
    assert (granite.attn_scale, granite.residual_scale, granite.embed_scale, granite.logit_scale) == (
        0.1, 0.2, 12.0, 0.125)


def test_sliding_windows_follow_the_config():
    assert layer_windows(_config("mistral", sliding_window=8)) == (8,) * 6
    assert layer_windows(_config("mistral", sliding_window=None)) == (0,) * 6
    qwen2 = _config("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=2)
    assert recipe_for(qwen2).windows == (0, 0, 8, 8, 8, 8)


@pytest.mark.parametrize("config,reason", [
    (lambda: _config("gpt2"), "model type 'gpt2' has no layer recipe"),
    (lambda: _config("llama", hidden_act="gelu"), "hidden_act='gelu'"),
    (lambda: _config("gemma3_text", attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
    (lambda: _config("glm4", head_dim=16, partial_rotary_factor=0.1875), "rotary width 3"),
])
def test_what_the_fused_path_cannot_take_is_a_reason(config, reason):
    got = recipe_for(config())
    assert isinstance(got, str) and reason in got, got


def test_a_multimodal_config_is_read_through_its_text_config():
    config = AutoConfig.for_model("gemma3", text_config=dict(hidden_size=64, num_hidden_layers=2,
                                                             num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    assert recipe_for(config).family == "gemma3_text"


def test_the_families_table_names_every_family():
    table = families_table()
    for family in RECIPES:
        assert f"| {family} |" in table
    assert table.count("fused C decoder") == len(DENSE) + len(MOE)
    assert table.count("mixture of experts") == len(MOE)


@pytest.mark.parametrize("family", MOE)
def test_the_mixture_of_experts_families_have_recipes(family):
    """Mixtral and Qwen3-MoE: the Llama layer with experts (moe_experts reads the router and the
    experts), Qwen3-MoE with its per-head q/k norms."""
    r = recipe_for(_config(family))
    assert isinstance(r, Recipe) and r.layer.moe and r.act == "silu"
    assert r.layer.qk_norm == ("head" if family == "qwen3_moe" else "none")
    assert not any(RECIPES[f].moe for f in DENSE)


def test_the_module_imports_no_torch():
    code = "import sys, kvfleet.runtime.worker.recipes; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
