"""Embeddings from the loaded decoder: a pooling forward beside generation (vLLM's pooling runner,
``--pooler-config``).

:func:`embed` runs the model's decoder (no LM head) over a batch of token-id sequences packed
into one ``[1, T]`` forward, as the engine's steps are, with *scratch* KV caches sized for this
batch alone: the engine's paged caches, scheduler and sequences are not touched, so it can run
in the engine thread between two steps. Each sequence's final hidden states (after the final
norm) are pooled (``LAST`` token or ``MEAN`` over its tokens) and, with ``normalize``, L2
normalised. Sequences attend only to themselves (per-sequence ``query_start_loc``), so a
sequence's vector does not depend on what it is batched with (up to float rounding).
"""

from __future__ import annotations

import math

import torch

from kvfleet.runtime.pooler_config import PoolerConfig
from kvfleet.runtime.worker.attention import METADATA_KWARG, AttentionMetadata


@torch.inference_mode()
def embed(runner, seqs: list[list[int]], config: PoolerConfig) -> list[list[float]]:
    """One pooled float vector per sequence of ``seqs`` (each non-empty), in one forward."""
    device, bs = runner.device, runner.block_size
    lens = [len(s) for s in seqs]
    blocks = [math.ceil(n / bs) for n in lens]
    starts = [0, *torch.tensor(blocks).cumsum(0).tolist()]
    shape = (starts[-1], bs, runner.num_kv_heads, runner.head_size)
    caches = [
        (torch.zeros(shape, dtype=runner.dtype, device=device), torch.zeros(shape, dtype=runner.dtype, device=device))
        for _ in range(runner.num_layers)
    ]
    table = torch.zeros((len(seqs), max(blocks)), dtype=torch.int32)
    slots = []
    for i, n in enumerate(lens):
        table[i, : blocks[i]] = torch.arange(starts[i], starts[i + 1], dtype=torch.int32)
        slots.append(torch.arange(n) + starts[i] * bs)
    qsl = [0, *torch.tensor(lens).cumsum(0).tolist()]
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        block_tables=table.to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        max_query_len=max(lens),
        max_seq_len=max(lens),
        kv_caches=caches,
        sliding_windows=runner.sliding_windows,
    )
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=device).unsqueeze(0)
    pos = torch.cat([torch.arange(n) for n in lens]).to(device).unsqueeze(0)
    hidden = (
        runner.model.get_decoder()(input_ids=ids, position_ids=pos, use_cache=False, **{METADATA_KWARG: meta})
        .last_hidden_state[0]
        .float()
    )
    out = []
    for i in range(len(seqs)):
        h = hidden[qsl[i] : qsl[i + 1]]
        v = h[-1] if config.pooling_type == "LAST" else h.mean(dim=0)
        if config.normalize:
            v = torch.nn.functional.normalize(v, dim=0)
        out.append(v.cpu().tolist())
    return out
