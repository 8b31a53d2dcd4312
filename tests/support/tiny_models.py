"""Tiny randomly initialised transformers models (no download), saved as checkpoints the engine
loads: the configs (``COMMON`` sizes; ``configs()``: Mistral, Qwen2, Gemma 2 with an 8-token
sliding window; ``family_config()``: each family of the fused decoder's recipes with its
features switched on), a word-level tokenizer, token-id ``PROMPTS`` longer than the window, and
``build``, which saves a model of a config and returns its eager transformers reference."""

from __future__ import annotations

import copy

import torch

from kvfleet.runtime.worker.recipes import RECIPES

VOCAB = 96
GEN = 10
# Token-id prompts (29, 21 and 12 tokens) longer than the window of 8.
PROMPTS = [[(7 * i + 3) % (VOCAB - 2) + 2 for i in range(29)], [(5 * i + 11) % (VOCAB - 2) + 2 for i in range(21)],
           [(3 * i + 1) % (VOCAB - 2) + 2 for i in range(12)]]
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3, tie_word_embeddings=False,
              bos_token_id=0, eos_token_id=1, pad_token_id=1)


def configs():
    """Mistral (window 8 on every layer), Qwen2 (layer 0 full, layer 1 window 8) and Gemma 2
    (alternating window/full, soft-capped logits), each of ``COMMON``'s tiny sizes."""
    from transformers import Gemma2Config, MistralConfig, Qwen2Config

    return {
        "mistral": MistralConfig(sliding_window=8, **COMMON),
        "qwen2": Qwen2Config(use_sliding_window=True, sliding_window=8, max_window_layers=1, **COMMON),
        "gemma2": Gemma2Config(sliding_window=8, head_dim=16, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                               final_logit_softcapping=3.0, **COMMON),
    }


FAMILIES = tuple(family for family, recipe in RECIPES.items() if recipe.unsupported is None)
"""The families runtime/worker/recipes.py puts on the fused path (a new row there is tested here)."""
_FAMILY = {
    "mistral": dict(sliding_window=8),                                  # a window on every layer
    "qwen2": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
    "gemma3_text": dict(sliding_window=8, query_pre_attn_scalar=24, head_dim=32,
                        layer_types=["sliding_attention", "full_attention"]),
    "glm4": dict(partial_rotary_factor=0.5, head_dim=32),               # rotary over half of each head
    "glm": dict(partial_rotary_factor=0.5, head_dim=32),
    "gemma": dict(head_dim=16),
    "phi3": dict(partial_rotary_factor=0.5),
    "granite": dict(attention_multiplier=0.2, residual_multiplier=0.5, embedding_multiplier=3.0, logits_scaling=2.0),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),           # 4 experts, top-2
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                      head_dim=16, mlp_only_layers=[1]),                # layer 1 dense
}


def family_config(model_type: str, **sizes):
    """A ``COMMON``-sized config of ``model_type`` (:data:`FAMILIES`) with the family's features
    on: sliding windows of 8 (Mistral, Qwen2's layer 1, Gemma 3's local layer), Gemma 3's
    ``query_pre_attn_scalar``, partial rotary (GLM-4, Phi-3), Granite's four multipliers;
    ``sizes`` override."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**COMMON, **_FAMILY.get(model_type, {}), **sizes})


def save_tokenizer(path) -> None:
    """A word-level tokenizer of ``VOCAB`` tokens (``w2`` ... , ``<s>`` 0, ``</s>`` 1) saved at ``path``."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="</s>"))
    tok.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>").save_pretrained(
        path)


def build(config, path, seed: int = 0):
    """A randomly initialised model of ``config`` saved (with a tokenizer) at ``path``; returns
    the eager-attention transformers model that serves as the reference."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = copy.deepcopy(config)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    model.save_pretrained(path)
    save_tokenizer(path)
    return model


def hf_greedy(model, prompts=PROMPTS, n: int = GEN) -> list[list[int]]:
    """transformers' own greedy ``generate`` of ``model``: ``n`` new token ids per prompt of
    ``prompts`` (token-id lists), one prompt at a time (its own mask), never stopping early
    (the model's EOS cleared)."""
    model.generation_config.eos_token_id = None
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                 min_new_tokens=n, pad_token_id=1)
        out.append(gen[0, len(p):].tolist())
    return out
