"""A GGUF file's mixture-of-experts layers, as stored, for kvfleet's reader
(:mod:`kvfleet.runtime.worker.gguf_model`).

Contract: :func:`moe_config` completes transformers' config of a MoE file (Mixtral from a
llama-architecture file with experts; the experts' width). llama.cpp stores a MoE layer's experts
as three 3-D tensors, ``blk.N.ffn_gate_exps``,
``ffn_up_exps`` (``[E, I, H]``, numpy order) and ``ffn_down_exps`` (``[E, H, I]``), and its router as
``blk.N.ffn_gate_inp`` (``[E, H]``; read by the reader as any other float tensor). :func:`match`
names the experts tensors; the reader repacks each expert into its kernel format
(:func:`kvfleet.runtime.worker.gguf_header.stored_experts`) and :func:`combine` makes each expert's
``gate_up`` weight (its gate rows, then its up rows: transformers' ``gate_up_proj`` layout) and keeps
its ``down``, all of a layer's in one format (the fused decoder's MoE step takes one: a mix of int4
and grouped int8 becomes grouped int8, as :func:`gguf_tensors.unify_siblings` does for dense
siblings). :func:`assemble` puts them into the model: each layer's
transformers experts module (``mlp.experts``, its 3-D parameters on ``meta``) becomes a
:class:`~kvfleet.runtime.worker.moe_experts.LinearExperts` over one layer per expert in its stored
format (``Int4Linear`` / ``Int8GroupLinear`` / ...), which the fused decoder's MoE layers read as
they read ``--quantization`` experts. :func:`tensors` / :func:`from_tensors` give the flat tensors
and layout a cache holds. Every mismatch (a missing gate, up or down, experts without a module) is a
``ValueError`` naming the layer.
"""

from __future__ import annotations

import logging
import re

import torch

from kvfleet.runtime.worker.gguf_tensors import Stored, unify_siblings

logger = logging.getLogger(__name__)

_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
_MODULE = re.compile(r"(?:.*\.)?layers\.(\d+)\.mlp\.experts")

Experts = tuple[list[Stored], list[Stored]]
"""One layer's experts: ``gate_up`` ``[2 I, H]`` and ``down`` ``[H, I]`` per expert."""


def match(name: str) -> tuple[int, str] | None:
    """``(layer, "gate" | "up" | "down")`` for an experts tensor's GGUF name, else None."""
    m = _EXPERTS.fullmatch(name)
    return (int(m[1]), m[2]) if m else None


def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.parts[-1][0]


def moe_config(reader, arch: str, config):
    """``config`` (transformers' conversion of the file's metadata) with what its mapping leaves out
    of a MoE file: a llama-architecture file with ``llama.expert_count`` experts is Mixtral
    (llama.cpp writes Mixtral as ``llama``; transformers would build a dense Llama without its
    experts), and an expert's intermediate size comes from ``<arch>.expert_feed_forward_length``
    (Qwen3-MoE's ``moe_intermediate_size`` otherwise keeps transformers' default of 768)."""
    experts = _field(reader, f"{arch}.expert_count")
    if arch == "llama" and experts:
        from transformers import MixtralConfig

        skip = ("model_type", "architectures", "transformers_version")
        d = {k: v for k, v in config.to_dict().items() if k not in skip}
        used = _field(reader, "llama.expert_used_count")
        d.update(num_local_experts=int(experts), num_experts_per_tok=int(used or 2),
                 architectures=["MixtralForCausalLM"])
        config = MixtralConfig(**d)
    width = _field(reader, f"{arch}.expert_feed_forward_length")
    text = config.get_text_config()
    if width is not None and hasattr(text, "moe_intermediate_size"):
        text.moe_intermediate_size = int(width)
    return config


def _cat_rows(a: Stored, b: Stored) -> Stored:
    """``a``'s rows then ``b``'s (one format); a shift on one side only is zero on the other."""
    def cat(x, y):
        if x is None and y is None:
            return None
        return torch.cat([torch.zeros_like(y) if x is None else x, torch.zeros_like(x) if y is None else y])

    return Stored(a.fmt, cat(a.w, b.w), cat(a.scale, b.scale), cat(a.shift, b.shift), a.group,
                  a.source if a.source == b.source else f"{a.source}+{b.source}")


def combine(model, parts: dict[int, dict[str, list[Stored]]]) -> dict[str, Experts]:
    """Each layer's experts (``parts``: layer -> ``gate`` / ``up`` / ``down`` -> one weight per
    expert) under the name of the model's experts module for that layer."""
    modules = {int(m[1]): name for name, _ in model.named_modules() if (m := _MODULE.fullmatch(name))}
    out: dict[str, Experts] = {}
    for layer, p in sorted(parts.items()):
        if layer not in modules:
            raise ValueError(f"layer {layer}: the file has experts tensors but the model's layer has no experts")
        missing = [w for w in ("gate", "up", "down") if w not in p]
        counts = {len(v) for v in p.values()}
        if missing or len(counts) != 1:
            raise ValueError(f"layer {layer}: experts tensors incomplete (missing {', '.join(missing) or 'none'}; "
                             f"expert counts {sorted(counts)})")
        gate_up = []
        for g, u in zip(p["gate"], p["up"]):
            same = unify_siblings({"gate_proj": g, "up_proj": u})
            g, u = same["gate_proj"], same["up_proj"]
            if (g.fmt, g.group) != (u.fmt, u.group):
                raise ValueError(f"layer {layer}: experts' gate ({g.source}) and up ({u.source}) have no common format")
            gate_up.append(_cat_rows(g, u))
        out[modules[layer]] = _one_format(layer, gate_up, list(p["down"]))
    return out


def _one_format(layer: int, gate_up: list[Stored], down: list[Stored]) -> Experts:
    """The layer's experts in one format and group, as the fused decoder's MoE step takes them: a
    mix of int4 and grouped int8 (a Q4_K_M file's Q4_K gate / up beside its Q6_K down) all as grouped
    int8 with the smallest group (the same float32 weights; the int4 ones take one byte per weight)."""
    kinds = {(m.fmt, m.group) for m in (*gate_up, *down)}
    if len(kinds) == 1 or not all(fmt in ("int4", "int8g") for fmt, _ in kinds):
        return gate_up, down
    group = min(g for _, g in kinds)
    if any(g % group for _, g in kinds):
        return gate_up, down
    logger.info("GGUF MoE layer %d: experts stored as %s; all as grouped int8 (G%d) for the fused decoder",
                layer, "/".join(sorted({m.source for m in (*gate_up, *down)})), group)
    return [m.as_int8g(group) for m in gate_up], [m.as_int8g(group) for m in down]


def assemble(model, experts: dict[str, Experts]) -> None:
    """Replace each named experts module of ``model`` by a ``LinearExperts`` over the stored weights."""
    from kvfleet.runtime.worker.moe_experts import LinearExperts

    for name, (gate_up, down) in experts.items():
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        act = getattr(owner, child).act_fn
        setattr(owner, child, LinearExperts([s.module() for s in gate_up], [s.module() for s in down], act))


def tensors(experts: dict[str, Experts]) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """Flat tensors (``experts.<name>.<e>.gate_up.w`` ...) and the layout that :func:`from_tensors` reads."""
    flat: dict[str, torch.Tensor] = {}
    layout: dict[str, dict] = {}
    for name, (gate_up, down) in experts.items():
        spec = {"gate_up": [], "down": []}
        for kind, weights in (("gate_up", gate_up), ("down", down)):
            for e, s in enumerate(weights):
                flat.update(s.tensors(f"experts.{name}.{e}.{kind}"))
                spec[kind].append({"fmt": s.fmt, "group": s.group, "source": s.source})
        layout[name] = spec
    return flat, layout


def from_tensors(flat: dict[str, torch.Tensor], layout: dict[str, dict]) -> dict[str, Experts]:
    out = {}
    for name, spec in layout.items():
        out[name] = tuple([Stored.from_tensors(flat, f"experts.{name}.{e}.{kind}", s["fmt"], s["group"])
                           for e, s in enumerate(spec[kind])] for kind in ("gate_up", "down"))
    return out
