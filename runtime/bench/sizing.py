"""How many nodes a model needs and what the network carries per token for TP, PP and P/D,
from the model's shape (docs/sizing.md's table is :func:`sizing_table`; run this module to print it).

Contract (decoders of the Llama shape, :class:`~kvfleet.runtime.bench.roofline.ModelShape`;
``b`` = bytes per activation / weight / KV element, ``H`` hidden size, ``L`` layers):

- :func:`param_count`: embeddings (+ an untied LM head) + per layer q, k, v, o, gate, up, down
  and two norms, + the final norm;
- :func:`nodes_needed`: ``ceil((weights + KV of the context budget) / (usable memory per node))``;
- :func:`tp_bytes_per_token`: tensor parallelism over ``t`` ranks all-reduces the hidden state
  twice per layer (after attention's output projection and after the MLP's down projection,
  Megatron's split); a ring all-reduce of ``S`` bytes sends ``2 (t-1)/t x S`` over every link of
  the ring, so every link (the ones between nodes included) carries ``4 L H b (t-1)/t`` bytes per
  token of the step;
- :func:`pp_bytes_per_token`: pipeline parallelism sends the hidden state and the residual
  (``2 H b``) across each stage boundary per token of the step;
- :func:`pd_bytes_per_prompt_token`: prefill/decode disaggregation moves each prompt token's KV
  (``2 L kv_heads head_dim b``) once, from the prefill replica to the decode replica.

Everything else on the wire (sampled token ids, the step's plain data, heartbeats) is a few
bytes per token and left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvfleet.runtime.bench.roofline import ModelShape

GIB = 2**30


@dataclass(frozen=True)
class SizedModel:
    """A model's name, its shape and whether its LM head shares the embedding matrix."""

    name: str
    shape: ModelShape
    tied_embeddings: bool = False


MODELS = (
    SizedModel("SmolLM2-135M", ModelShape(576, 1536, 30, 9, 3, 64, 49152), tied_embeddings=True),
    SizedModel("Llama-3.1-8B", ModelShape(4096, 14336, 32, 32, 8, 128, 128256)),
    SizedModel("Llama-3.1-70B", ModelShape(8192, 28672, 80, 64, 8, 128, 128256)),
    SizedModel("Qwen2.5-72B", ModelShape(8192, 29568, 80, 64, 8, 128, 152064)),
    SizedModel("Llama-3.1-405B", ModelShape(16384, 53248, 126, 128, 8, 128, 128256)),
)
"""The shapes of the models docs/sizing.md sizes (their config.json values)."""


@dataclass(frozen=True)
class Node:
    """One node of the cluster: its accelerator memory and the share the engine may use."""

    name: str = "8x H100 80 GB"
    memory_bytes: int = 8 * 80 * 10**9
    utilization: float = 0.9  # spec.engine.gpuMemoryUtilization's default


def param_count(shape: ModelShape, tied_embeddings: bool = False) -> int:
    """Parameters of the decoder (see the module docstring)."""
    per_layer = sum(a * b for a, b in shape.layer_matmul_shapes()) + 2 * shape.hidden_size
    heads = 1 if tied_embeddings else 2
    return shape.num_layers * per_layer + heads * shape.vocab_size * shape.hidden_size + shape.hidden_size


def weight_bytes(shape: ModelShape, tied_embeddings: bool = False, dtype_bytes: int = 2) -> int:
    """Bytes of the weights in ``dtype_bytes`` per parameter (2: bf16)."""
    return param_count(shape, tied_embeddings) * dtype_bytes


def nodes_needed(model: SizedModel, node: Node = Node(), *, context_tokens: int = 32 * 8192,
                 dtype_bytes: int = 2) -> int:
    """Nodes one replica needs for its weights and the KV of ``context_tokens`` tokens in flight
    (default 32 sequences of 8192 tokens), each node's memory used up to ``node.utilization``."""
    need = weight_bytes(model.shape, model.tied_embeddings, dtype_bytes)
    need += model.shape.kv_bytes_per_token(dtype_bytes) * context_tokens
    return max(1, math.ceil(need / (node.memory_bytes * node.utilization)))


def tp_bytes_per_token(shape: ModelShape, ranks: int, dtype_bytes: int = 2) -> float:
    """Bytes each link of the tensor-parallel ring carries per token of a step (0 for one rank)."""
    if ranks <= 1:
        return 0.0
    return 2 * shape.num_layers * 2 * (ranks - 1) / ranks * shape.hidden_size * dtype_bytes


def pp_bytes_per_token(shape: ModelShape, dtype_bytes: int = 2) -> int:
    """Bytes across one pipeline stage boundary per token of a step (hidden state + residual)."""
    return 2 * shape.hidden_size * dtype_bytes


def pd_bytes_per_prompt_token(shape: ModelShape, kv_dtype_bytes: int = 2) -> int:
    """KV bytes a decode replica pulls per prompt token from the prefill replica."""
    return shape.kv_bytes_per_token(kv_dtype_bytes)


def gbit_per_s(bytes_per_token: float, tokens_per_s: float) -> float:
    """The link rate ``bytes_per_token`` at ``tokens_per_s`` needs, Gbit/s."""
    return bytes_per_token * tokens_per_s * 8 / 1e9


def _size(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def sizing_table(node: Node = Node(), tokens_per_s: float = 5000) -> str:
    """docs/sizing.md's table (markdown), bf16 weights, activations and KV; the last column is the
    link rate of TP over 2 nodes and of PP at ``tokens_per_s`` tokens through a replica."""
    rows = ["| model | params | weights (bf16) | KV / token | nodes of " + node.name
            + " (32 x 8k context) | TP, 8 ranks: per token per link | TP, 16 ranks over 2 nodes | "
            "PP: per token per stage boundary | P/D: per prompt token (1k-token prompt) | "
            f"at {tokens_per_s:g} tokens/s: TP over 2 nodes / PP |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for m in MODELS:
        s = m.shape
        pd = pd_bytes_per_prompt_token(s)
        rows.append(f"| {m.name} | {param_count(s, m.tied_embeddings) / 1e9:.2f} B "
                    f"| {_size(weight_bytes(s, m.tied_embeddings))} | {_size(s.kv_bytes_per_token(2))} "
                    f"| {nodes_needed(m, node)} | {_size(tp_bytes_per_token(s, 8))} "
                    f"| {_size(tp_bytes_per_token(s, 16))} | {_size(pp_bytes_per_token(s))} "
                    f"| {_size(pd)} ({_size(1000 * pd)}) "
                    f"| {gbit_per_s(tp_bytes_per_token(s, 16), tokens_per_s):.0f} / "
                    f"{gbit_per_s(pp_bytes_per_token(s), tokens_per_s):.1f} Gbit/s |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(sizing_table())
