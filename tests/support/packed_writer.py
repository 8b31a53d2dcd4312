"""A reference 4-bit (and W8A8 int8) quantizer writing checkpoints in AWQ (GEMM), GPTQ v1 (with and
without act-order) and compressed-tensors (pack-quantized, int-quantized) layouts, each format's own:
the packed-checkpoint tests (tests/unit/runtime/worker/test_packed_checkpoints.py) and the formats'
speed benchmark (benchmarks/packed_speed.py) write theirs with it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvfleet.runtime.worker import packed_checkpoints

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def quantize(w: torch.Tensor, group_of: torch.Tensor, groups: int, sym: bool):
    """Reference 4-bit quantizer: per (row, group) fp16 scale, zero 8 (symmetric) or from the minimum;
    ``q`` 0..15, ``z`` and ``s`` ``[N, groups]``; ``(q - z) * s`` is the dequantized weight."""
    n, k = w.shape
    s = torch.empty(n, groups)
    z = torch.empty(n, groups)
    for g in range(groups):
        cols = w[:, group_of == g]
        if sym:
            s[:, g] = (cols.abs().amax(1) / 7).half().float().clamp_min(1e-4)
            z[:, g] = 8
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            s[:, g] = ((hi - lo) / 15).half().float().clamp_min(1e-4)
            z[:, g] = torch.round(-lo / s[:, g]).clamp(0, 15)
    q = torch.clamp(torch.round(w / s[:, group_of]) + z[:, group_of], 0, 15)
    return q.to(torch.int64), z.to(torch.int64), s


def pack(values: torch.Tensor, dim: int, order=tuple(range(8))) -> torch.Tensor:
    """int64 0..15 -> int32 words of eight along ``dim``; nibble i holds element 8c + order[i]."""
    v = values.movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, 8)[..., list(order)]
    word = sum(v[..., i] << (4 * i) for i in range(8))
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    return word.movedim(-1, dim).contiguous()


INPUT_OF = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
"""Layers that read one input: GPTQ's act-order quantizes them in one order (the order of their
Hessian's diagonal, which is the same for the same inputs)."""


def write(path, ref, fmt: str, group: int, sym: bool, act_order: bool, shared_orders: bool = True):
    """``ref`` (a float32 transformers model) quantized in ``fmt`` (``awq``, ``gptq``, ``ct``
    pack-quantized, ``ct8`` int-quantized), its checkpoint written at ``path`` (safetensors and
    config.json with the format's ``quantization_config``); ``ref``'s linear weights are replaced by
    their dequantization, so it is the float32 model the checkpoint holds. Returns ``ref``.

    ``act_order``: each layer's groups over its input features in a random order, one order per
    input (q/k/v, gate/up: :data:`INPUT_OF`) as GPTQ gives them, or with ``shared_orders`` False
    one per layer."""
    path = Path(path)
    cfg = ref.config
    gen = torch.Generator().manual_seed(1)
    orders: dict[str, torch.Tensor] = {}
    tensors = {}
    for name, p in ref.state_dict().items():
        module = name.rsplit(".", 1)[0]
        if name == "lm_head.weight" and getattr(cfg, "tie_word_embeddings", False):
            continue  # the embedding's, tied
        if not any(module.endswith(lin) for lin in LINEARS):
            tensors[name] = p.contiguous()
            continue
        w = p.detach()
        n, k = w.shape
        if fmt == "ct8":  # W8A8's weights: symmetric int8, an fp16 scale per output channel
            s8 = (w.abs().amax(1, keepdim=True) / 127).half().float()
            q8 = torch.round(w / s8).clamp(-127, 127)
            with torch.no_grad():
                p.copy_(q8 * s8)
            tensors[f"{module}.weight"] = q8.to(torch.int8)
            tensors[f"{module}.weight_scale"] = s8.half()
            continue
        groups = k // group
        group_of = torch.arange(k) // group
        if act_order:
            parent, _, leaf = module.rpartition(".")
            key = f"{parent}.{INPUT_OF.get(leaf, leaf)}" if shared_orders else module
            perm = orders[key] if key in orders else orders.setdefault(key, torch.randperm(k, generator=gen))
            group_of = torch.empty(k, dtype=torch.int64)
            group_of[perm] = torch.arange(k) // group
        q, z, s = quantize(w, group_of, groups, sym)
        with torch.no_grad():
            p.copy_((q - z[:, group_of]).float() * s[:, group_of])
        if fmt == "awq":
            tensors[f"{module}.qweight"] = pack(q.T, 1, packed_checkpoints.AWQ_ORDER)
            tensors[f"{module}.qzeros"] = pack(z.T, 1, packed_checkpoints.AWQ_ORDER)
            tensors[f"{module}.scales"] = s.T.half().contiguous()
        elif fmt == "gptq":
            tensors[f"{module}.qweight"] = pack(q.T, 0)
            tensors[f"{module}.qzeros"] = pack((z - 1).T, 1)  # v1 stores z - 1
            tensors[f"{module}.scales"] = s.T.half().contiguous()
            tensors[f"{module}.g_idx"] = group_of.to(torch.int32)
        else:
            tensors[f"{module}.weight_packed"] = pack(q, 1)
            tensors[f"{module}.weight_scale"] = s.half().contiguous()
            tensors[f"{module}.weight_shape"] = torch.tensor([n, k])
            if not sym:
                tensors[f"{module}.weight_zero_point"] = (z - 8).to(torch.int8)
    save_file(tensors, str(path / "model.safetensors"))
    quant = {
        "awq": {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm", "zero_point": True},
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order, "sym": sym,
                 "checkpoint_format": "gptq"},
        "ct": {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
               "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                   "num_bits": 4, "type": "int", "symmetric": sym, "strategy": "group", "group_size": group}}}},
        "ct8": {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                    "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                    "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True,
                                          "strategy": "token"}}}},
    }[fmt]
    cfg.save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"] = quant
    (path / "config.json").write_text(json.dumps(raw))
    return ref
