"""Layer recipes: how each model family's decoder layer maps onto the fused CPU decoder
(:mod:`kvfleet.kernels.cpu_decoder`), read once from a transformers config. Pure and torch-free.

:data:`RECIPES` is the one table of families (``model_type`` -> :class:`FamilyRecipe`): the
module names of the layer's linear layers (split q/k/v or a fused ``qkv_proj``, split gate/up or a
fused ``gate_up_proj``) and of its RMSNorms at the four positions (``attn_in``, ``attn_out``,
``mlp_in``, ``mlp_out``; None: no norm there), whether the norms are Gemma's ``(1 + w)`` kind
(``norm_offset`` 1.0: added to the float32 weights handed to C, which only knows ``w * x / rms``),
the q/k norm (``none``, ``head``: weight ``[D]`` on each head, ``proj``: over the whole projection),
the rotary style (``half``: transformers' rotate_half; ``interleaved``: GLM-4's neighbouring pairs)
and whether the rotary module takes the layer type (Gemma 3: local and global RoPE bases), and
the config fields of the activation and of the scalar multipliers; ``moe``: a layer's MLP may be a
mixture of experts, which :func:`kvfleet.runtime.worker.moe_experts.moe_layer` reads (router, top-k,
renormalisation; the experts' linear layers), each layer on its own (Qwen3-MoE's ``mlp_only_layers``
are dense).

:func:`recipe_for` resolves a family against one config into a :class:`Recipe` (activation,
rotary width, per-layer sliding window and RoPE table, attention scale, embedding / residual /
logit multipliers, logit soft-cap), or returns a str: why the fused path cannot take the model
(the engine then runs transformers' modules). Adding a dense family is a row here, a test and
the docs table (:func:`families_table`, checked against docs/performance.md by
tests/repo/test_docs_families.py).

The multipliers and who applies them: ``embed_scale`` by the Python embedding step (Gemma's
sqrt(H) is inside its embedding module already, so only Granite's ``embedding_multiplier`` is
here), ``attn_scale`` and ``residual_scale`` by the C step, ``logit_scale`` (Granite's
``1 / logits_scaling``) and ``logit_softcap`` (``final_logit_softcapping``) in Python on the C step's
logits, as the engine's torch path applies them. Biases need no field: a module's ``bias`` is
carried by its :class:`~kvfleet.kernels.cpu_decoder.Linear` (Qwen2's and GLM-4's q/k/v biases).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

NORM_POSITIONS = ("attn_in", "attn_out", "mlp_in", "mlp_out")
"""The RMSNorm positions of a layer: before attention, on its output, before the MLP, on its output."""
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
"""transformers' activation names -> the C step's (``cpu_decoder.ACTS``)."""

_LLAMA_NORMS = {"attn_in": "input_layernorm", "mlp_in": "post_attention_layernorm"}


@dataclass(frozen=True)
class FamilyRecipe:
    """What a family's decoder layer is made of (see the module docstring)."""

    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    gate_up: tuple[str, ...] = ("gate_proj", "up_proj")
    o: str = "o_proj"
    down: str = "down_proj"
    norms: dict[str, str] = field(default_factory=lambda: dict(_LLAMA_NORMS))
    norm_offset: float = 0.0
    qk_norm: str = "none"
    act_field: str = "hidden_act"
    rotary_style: str = "half"
    rope_per_layer_type: bool = False
    attn_scale_field: str | None = None          # a config field holding the scale itself (Granite)
    attn_scale_pre_field: str | None = None      # a config field s: scale = s ** -0.5 (Gemma)
    embed_scale_field: str | None = None
    residual_scale_field: str | None = None
    logit_divisor_field: str | None = None
    moe: bool = False                            # a layer's ``mlp`` may be experts (``gate`` + ``experts``)
    unsupported: str | None = None               # why the fused path never takes the family (yet)
    note: str = ""


RECIPES: dict[str, FamilyRecipe] = {
    "llama": FamilyRecipe(),
    "mistral": FamilyRecipe(),
    "qwen2": FamilyRecipe(note="q/k/v biases"),
    "qwen3": FamilyRecipe(qk_norm="head"),
    "gemma": FamilyRecipe(norm_offset=1.0, note="sqrt(H) embedding scale (in its embedding)"),
    "gemma3_text": FamilyRecipe(
        norms={"attn_in": "input_layernorm", "attn_out": "post_attention_layernorm",
               "mlp_in": "pre_feedforward_layernorm", "mlp_out": "post_feedforward_layernorm"},
        norm_offset=1.0, qk_norm="head", act_field="hidden_activation", rope_per_layer_type=True,
        attn_scale_pre_field="query_pre_attn_scalar", note="sqrt(H) embedding scale (in its embedding)"),
    "glm4": FamilyRecipe(
        gate_up=("gate_up_proj",), rotary_style="interleaved",
        norms={"attn_in": "input_layernorm", "attn_out": "post_self_attn_layernorm",
               "mlp_in": "post_attention_layernorm", "mlp_out": "post_mlp_layernorm"},
        note="q/k/v biases"),
    "glm": FamilyRecipe(gate_up=("gate_up_proj",), rotary_style="interleaved", note="q/k/v biases"),
    "phi3": FamilyRecipe(qkv=("qkv_proj",), gate_up=("gate_up_proj",)),
    "olmo2": FamilyRecipe(norms={"attn_out": "post_attention_layernorm", "mlp_out": "post_feedforward_layernorm"},
                          qk_norm="proj"),
    "granite": FamilyRecipe(attn_scale_field="attention_multiplier", embed_scale_field="embedding_multiplier",
                            residual_scale_field="residual_multiplier", logit_divisor_field="logits_scaling"),
    "mixtral": FamilyRecipe(moe=True),
    "qwen3_moe": FamilyRecipe(qk_norm="head", moe=True, note="`mlp_only_layers` dense"),
}
"""The families (``model_type``) and their layers. ``gemma3`` (the multimodal config) is read
through its text config, ``gemma3_text``."""


@dataclass(frozen=True)
class Recipe:
    """A family's recipe resolved against one model's config: what the fused path builds."""

    family: str
    layer: FamilyRecipe
    act: str
    head_size: int
    rotary_dim: int
    rotary_interleaved: bool
    windows: tuple[int, ...]              # per layer, 0: global attention
    rope_keys: tuple[str | None, ...]     # the rotary module's layer_type per table (None: it takes none)
    layer_rope: tuple[int, ...]           # per layer, its table in rope_keys
    attn_scale: float
    embed_scale: float
    residual_scale: float
    logit_scale: float
    logit_softcap: float | None


def _get(config, name: str, default=None):
    value = getattr(config, name, None)
    return default if value is None else value


def _rotary_factor(config) -> float:
    params = _get(config, "rope_parameters", {}) or {}
    nested = [p for p in params.values() if isinstance(p, dict)]
    factors = {p.get("partial_rotary_factor", 1.0) for p in ([params] if not nested else nested)}
    direct = getattr(config, "partial_rotary_factor", None)
    if direct is not None:
        factors.add(float(direct))
    return factors.pop() if len(factors) == 1 else float("nan")


def layer_windows(config) -> tuple[int, ...]:
    """Per layer, the sliding window (0: none) as transformers' masks read the config: with
    ``layer_types``, ``sliding_window`` on the ``sliding_attention`` layers; without, on every
    layer (Mistral, Phi-3). (The engine's own reading, ``attention.layer_sliding_windows``, must
    agree: the fused path checks it.)"""
    window = int(_get(config, "sliding_window", 0) or 0)
    types = getattr(config, "layer_types", None)
    if types:
        return tuple(window if kind == "sliding_attention" else 0 for kind in types)
    return (window,) * int(config.num_hidden_layers)


def recipe_for(config) -> Recipe | str:
    """The :class:`Recipe` of a transformers config (a multimodal one's text config), or why the
    fused path cannot run the model (a str naming the field)."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    family = getattr(config, "model_type", None)
    layer = RECIPES.get(family)
    if layer is None:
        return f"model type {family!r} has no layer recipe (families: {', '.join(RECIPES)})"
    if layer.unsupported:
        return f"model type {family!r}: {layer.unsupported}"
    act = ACTIVATIONS.get(_get(config, layer.act_field, ""))
    if act is None:
        return f"{layer.act_field}={_get(config, layer.act_field)!r} is not one of {', '.join(ACTIVATIONS)}"
    for name in ("attn_logit_softcapping", "attention_chunk_size"):
        if getattr(config, name, None):
            return f"{name}={getattr(config, name)!r} is not in the fused step"
    heads = int(config.num_attention_heads)
    head_size = int(_get(config, "head_dim", 0) or config.hidden_size // heads)
    factor = _rotary_factor(config)
    rotary_dim = int(head_size * factor) if math.isfinite(factor) else 0
    if not 0 < rotary_dim <= head_size or rotary_dim % 2:
        return f"partial_rotary_factor {factor} gives a rotary width {rotary_dim} of head size {head_size}"
    windows = layer_windows(config)
    types = tuple(getattr(config, "layer_types", None) or ())
    if layer.rope_per_layer_type:
        if len(types) != len(windows):
            return "the rotary embedding takes a layer type but the config has no layer_types"
        keys = tuple(sorted(set(types)))
        layer_rope = tuple(keys.index(t) for t in types)
    else:
        keys, layer_rope = (None,), (0,) * len(windows)
    if layer.attn_scale_field:
        scale = float(_get(config, layer.attn_scale_field, head_size ** -0.5))
    elif layer.attn_scale_pre_field:
        scale = float(_get(config, layer.attn_scale_pre_field, head_size)) ** -0.5
    else:
        scale = head_size ** -0.5
    divisor = float(_get(config, layer.logit_divisor_field, 1.0)) if layer.logit_divisor_field else 1.0
    cap = getattr(config, "final_logit_softcapping", None)
    return Recipe(
        family=family, layer=layer, act=act, head_size=head_size, rotary_dim=rotary_dim,
        rotary_interleaved=layer.rotary_style == "interleaved", windows=windows, rope_keys=keys,
        layer_rope=layer_rope, attn_scale=scale,
        embed_scale=float(_get(config, layer.embed_scale_field, 1.0)) if layer.embed_scale_field else 1.0,
        residual_scale=float(_get(config, layer.residual_scale_field, 1.0)) if layer.residual_scale_field else 1.0,
        logit_scale=1.0 / divisor, logit_softcap=float(cap) if cap else None)


def families_table() -> str:
    """The Markdown table of :data:`RECIPES` that docs/performance.md holds ("Model families")."""
    rows = ["| model_type | path | norms | q/k norm | activation from | rotary | multipliers | notes |",
            "|---|---|---|---|---|---|---|---|"]
    for family, r in RECIPES.items():
        if r.unsupported:
            rows.append(f"| {family} | transformers' modules | | | | | | {r.unsupported} |")
            continue
        norms = " + ".join(p for p in NORM_POSITIONS if p in r.norms) + (" (1 + w)" if r.norm_offset else "")
        fused = [n for n, names in (("qkv", r.qkv), ("gate_up", r.gate_up)) if len(names) == 1]
        rotary = r.rotary_style + (", per layer type" if r.rope_per_layer_type else "")
        mult = ", ".join(f for f in (r.attn_scale_field, r.attn_scale_pre_field, r.embed_scale_field,
                                     r.residual_scale_field, r.logit_divisor_field) if f)
        notes = "; ".join(n for n in ("mixture of experts (router softmax, top-k)" if r.moe else "", r.note,
                                       ("fused " + " and ".join(fused) + " as stored") if fused else "") if n)
        act = f"`{r.act_field}`"
        rows.append(f"| {family} | fused C decoder | {norms} | {r.qk_norm} | {act} | {rotary} | {mult} | {notes} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(families_table())
