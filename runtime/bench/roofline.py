"""Analytic bounds for ``kvfleet bench compare``: what any engine must spend on a workload.

- :class:`ModelShape`: a Llama-style decoder's dimensions (FLOPs per token, KV bytes per token).
- :func:`workload_flops` / :func:`static_batch_flops`: FLOPs of a workload, exact or as
  static padded batching computes it; :func:`measure_matmul_flops`: this machine's matmul
  FLOP/s on the model's own weights; :func:`roofline`: the resulting compute bound
  (:class:`Roofline`, output tokens/s); :func:`measure_memory_bandwidth`: this machine's
  memory read bandwidth (the bound of one decode stream: weight bytes per token / bandwidth).
- :func:`kv_memory_report`: the share of KV slots holding real tokens under paged allocation,
  per-request ``max_model_len`` reservation and static padded batches.

Formulas and their assumptions: docs/benchmarks.md, "Roofline and KV-memory report".
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from kvfleet.runtime.bench.datasets import Workload


@dataclass
class ModelShape:
    """The dimensions of a Llama-style decoder that set its FLOPs and KV bytes."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def from_config(cls, config) -> ModelShape:
        heads = config.num_attention_heads
        return cls(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab_size=config.vocab_size,
        )

    def layer_matmul_shapes(self) -> list[tuple[int, int]]:
        """(in_features, out_features) of one layer's linear maps: q, k, v, o, gate, up, down."""
        h, q, kv, i = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.intermediate_size,
        )
        return [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]

    @property
    def linear_flops_per_token(self) -> int:
        """2 x multiply-adds of all layers' linear maps for one token (no LM head), FLOPs."""
        return 2 * self.num_layers * sum(a * b for a, b in self.layer_matmul_shapes())

    @property
    def lm_head_flops(self) -> int:
        """FLOPs of the LM head for one sampled token."""
        return 2 * self.hidden_size * self.vocab_size

    @property
    def attention_flops_per_key(self) -> int:
        """FLOPs of QK^T plus PV for one query token against one key, all layers."""
        return 4 * self.num_layers * self.num_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """Bytes of K and V for one token, all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def workload_flops(prompt_lens, output_lens, shape: ModelShape) -> tuple[float, float]:
    """(prefill FLOPs, decode FLOPs) that any engine must spend on a workload.

    Prefill: every prompt token through the linear maps, causal attention over the
    prompt (token t attends to t+1 keys) and one LM head (the first output token).
    Decode: output tokens 2..o each feed the previous token (o-1 forward tokens per
    request, at positions p..p+o-2, attending to p+1..p+o-1 keys) plus an LM head.
    """
    pre = dec = 0.0
    for p, o in zip(prompt_lens, output_lens):
        p, o = int(p), int(o)
        pre += p * shape.linear_flops_per_token + shape.attention_flops_per_key * p * (p + 1) / 2 + shape.lm_head_flops
        n_dec = max(o - 1, 0)
        keys = (p + 1 + p + o - 1) * n_dec / 2  # sum of k for k = p+1 .. p+o-1
        dec += n_dec * (shape.linear_flops_per_token + shape.lm_head_flops) + shape.attention_flops_per_key * keys
    return pre, dec


def model_linear_weights(model, include_lm_head: bool = True) -> list:
    """The weight matrices of every ``nn.Linear`` of ``model`` (all layers' q/k/v/o and
    MLP projections, and the LM head when asked), in forward order."""
    import torch

    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not lm_head]
    if include_lm_head and lm_head is not None:
        weights.append(lm_head.weight)
    return weights


def static_batch_flops(prompt_lens, output_lens, batch: int, shape: ModelShape) -> float:
    """FLOPs that static padded batching spends: every request of a batch of ``batch``
    consecutive requests is computed at the batch's longest prompt and longest output."""
    total = 0.0
    p, o = list(prompt_lens), list(output_lens)
    for s in range(0, len(p), batch):
        n = len(p[s : s + batch])
        pre, dec = workload_flops([max(p[s : s + batch])] * n, [max(o[s : s + batch])] * n, shape)
        total += pre + dec
    return total


def measure_matmul_flops(weights, tokens: int, min_seconds: float = 0.5, repeats: int = 3) -> float:
    """FLOP/s this machine reaches on ``torch.nn.functional.linear`` of a ``[tokens, in]``
    activation with each of ``weights`` (``[out, in]``) in turn: the model's own matmuls,
    one forward pass's worth, so that decode-sized batches are as memory-bound as in the
    real model. Best of ``repeats`` timings of at least ``min_seconds`` each."""
    import torch

    gen = torch.Generator().manual_seed(0)
    xs = {w.shape[1]: torch.randn(tokens, w.shape[1], generator=gen, dtype=w.dtype) for w in weights}
    flops = sum(2 * tokens * w.shape[0] * w.shape[1] for w in weights)
    F = torch.nn.functional.linear
    best = 0.0
    with torch.inference_mode():
        for w in weights:
            F(xs[w.shape[1]], w)
        for _ in range(repeats):
            n, t0 = 0, time.perf_counter()
            while True:
                for w in weights:
                    F(xs[w.shape[1]], w)
                n += 1
                dt = time.perf_counter() - t0
                if dt >= min_seconds:
                    break
            best = max(best, n * flops / dt)
    return best


def measure_memory_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Memory read bandwidth, bytes/s: the best of ``repeats`` ``sum()`` passes over an fp32
    tensor of ``nbytes`` (far larger than the caches), with torch's threads. A decode step of
    one stream reads every weight once, so ``bandwidth / weight bytes`` bounds its tokens/s
    (the STREAM benchmark's idea, with a read-only kernel)."""
    import torch

    x = torch.ones(nbytes // 4, dtype=torch.float32)
    best = 0.0
    with torch.inference_mode():
        x.sum()
        for _ in range(repeats):
            t0 = time.perf_counter()
            x.sum()
            best = max(best, nbytes / (time.perf_counter() - t0))
    return best


@dataclass
class Roofline:
    """Compute roofline of a workload on this machine: the time its FLOPs take at the best
    matmul FLOP/s measured here, and the output token throughput that allows. No engine
    can beat it; decode at small batches is memory-bound and stays well below it."""

    prefill_gflop: float
    decode_gflop: float
    peak_gflops_per_s: float
    """Best measured matmul GFLOP/s (the model's own weights, ``--prefill-tokens`` rows)."""
    seconds: float
    """(prefill + decode FLOPs) / peak FLOP/s."""
    output_tokens: int
    output_tokens_per_s: float
    """Output tokens / ``seconds``: the best output token throughput compute allows, tokens/s."""
    decode_shape_gflops_per_s: float | None = None
    """Measured matmul GFLOP/s with as many rows as the concurrency level (a decode step's
    shape), for reference."""

    @property
    def gflop(self) -> float:
        return self.prefill_gflop + self.decode_gflop


def roofline(
    workload: Workload, shape: ModelShape, peak_flops_per_s: float, decode_shape_flops_per_s: float | None = None
) -> Roofline:
    """The :class:`Roofline` of ``workload`` (FLOPs from :func:`workload_flops`) at
    ``peak_flops_per_s`` FLOP/s."""
    pre, dec = workload_flops(workload.prompt_lens, workload.output_lens, shape)
    seconds = (pre + dec) / peak_flops_per_s
    out = sum(workload.output_lens)
    return Roofline(
        pre / 1e9,
        dec / 1e9,
        peak_flops_per_s / 1e9,
        seconds,
        out,
        out / seconds,
        None if decode_shape_flops_per_s is None else decode_shape_flops_per_s / 1e9,
    )


def kv_memory_report(
    prompt_lens,
    output_lens,
    block_size: int,
    max_model_len: int,
    kv_bytes_per_token: int,
    kv_budget_bytes: int,
    static_batch: int,
) -> list[dict]:
    """How well three KV allocation schemes use memory on a mixed-length workload.

    Each request holds ``prompt + output`` real tokens at its peak. Schemes:

    - ``paged``: ``ceil(tokens / block_size)`` blocks of ``block_size`` slots (PagedAttention);
    - ``reserve max_model_len``: ``max_model_len`` slots per request, reserved up front;
    - ``static padded batch``: each batch of ``static_batch`` consecutive requests reserves
      (longest prompt + longest output of the batch) slots per request, as padded
      ``generate()`` does.

    Returns one dict per scheme: ``scheme``, ``allocated_slots``, ``real_tokens``,
    ``utilization`` (real / allocated, 0-1), ``slots_per_seq`` (mean), and
    ``max_concurrent_seqs``: how many sequences of this workload's mean footprint fit in
    ``kv_budget_bytes`` (``floor(budget_slots / slots_per_seq)``; paged: whole blocks).
    """
    p = np.asarray(prompt_lens, dtype=np.int64)
    o = np.asarray(output_lens, dtype=np.int64)
    real = p + o
    if len(real) == 0:
        raise ValueError("empty workload")
    if real.max() > max_model_len:
        raise ValueError(f"a request of {int(real.max())} tokens exceeds max_model_len {max_model_len}")
    budget_slots = kv_budget_bytes // kv_bytes_per_token
    paged = np.ceil(real / block_size).astype(np.int64) * block_size
    reserve = np.full_like(real, max_model_len)
    static = np.empty_like(real)
    for s in range(0, len(real), static_batch):
        static[s : s + static_batch] = p[s : s + static_batch].max() + o[s : s + static_batch].max()
    rows = []
    schemes = (
        (f"paged (block_size {block_size})", paged),
        (f"reserve max_model_len ({max_model_len})", reserve),
        (f"static padded batch of {static_batch}", static),
    )
    for name, alloc in schemes:
        per_seq = float(alloc.mean())
        if name.startswith("paged"):
            fits = int((budget_slots // block_size) // (per_seq / block_size))
        else:
            fits = int(budget_slots // per_seq)
        rows.append(
            {
                "scheme": name,
                "allocated_slots": int(alloc.sum()),
                "real_tokens": int(real.sum()),
                "utilization": float(real.sum() / alloc.sum()),
                "slots_per_seq": per_seq,
                "max_concurrent_seqs": fits,
            }
        )
    return rows
