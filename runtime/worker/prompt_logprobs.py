"""Prompt logprobs (vLLM's semantics: ``log_softmax`` of the raw float32 logits at every prompt
position a request asks for) from a step's decoder hidden states.

:func:`prompt_logprob_rows` picks, from a step's :class:`~kvfleet.runtime.worker.request_state.ScheduledRow` s,
the batch rows whose logprobs are wanted; :func:`prompt_logprobs` runs the LM head on them in
chunks of at most ``PROMPT_LOGPROBS_CHUNK_BYTES`` and returns :class:`PromptLogprobsTensors` per
request (host tensors). The model runner calls both; the engine's output processor reads the result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvfleet.runtime.worker.request_state import ScheduledRow

PROMPT_LOGPROBS_CHUNK_BYTES = 128 * 2**20
"""Most float32 logits the prompt-logprobs LM head materialises at once, bytes
(``rows * vocab_size * 4``; 682 rows of SmolLM2's 49152-token vocabulary)."""


@dataclass
class PromptLogprobsTensors:
    """Prompt logprobs of one request computed in one step (host tensors, ``R`` rows).

    Row ``i`` is the distribution at prompt position ``first_token - 1 + i``, i.e. the one
    that predicts prompt token ``first_token + i`` (``first_token >= 1``: the first prompt
    token has no logprob).

    Attributes:
        first_token: index in the prompt of the token row 0 scores.
        token_logprobs: ``[R]`` float32, log-probability of each scored prompt token.
        token_ranks: ``[R]`` int64, its 1-based rank (1 + tokens with a strictly larger logprob).
        top_ids: ``[R, k]`` int64, the ``k`` most likely token ids, best first.
        top_logprobs: ``[R, k]`` float32, their logprobs.
    """

    first_token: int
    token_logprobs: torch.Tensor
    token_ranks: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor


def prompt_logprob_rows(scheduled: list[ScheduledRow]) -> list[tuple[ScheduledRow, int, int, int]]:
    """``(request, first batch row, number of rows, first scored prompt token)`` for every
    scheduled request that wants prompt logprobs and computes prompt positions before its
    last prompt token this step. Position ``p`` scores prompt token ``p + 1``; positions
    whose logprobs the engine already holds (``request.num_prompt_logprobs_done``: a
    request preempted and computing its prompt again) are skipped."""
    rows = []
    offset = 0
    for s in scheduled:
        k = s.request.sampling_params.prompt_logprobs
        last = s.request.num_prompt_tokens - 1  # the last prompt position samples, it scores nothing
        start = max(s.start_pos, s.request.num_prompt_logprobs_done - 1)
        end = min(s.seq_len, last)
        if k is not None and start < end:
            rows.append((s, offset + start - s.start_pos, end - start, start + 1))
        offset += s.num_new_tokens
    return rows


def prompt_logprobs(
    hidden: torch.Tensor, rows: list[tuple[ScheduledRow, int, int, int]],
    compute_logits: Callable[[torch.Tensor], torch.Tensor], vocab_size: int,
) -> dict[str, PromptLogprobsTensors]:
    """Prompt logprobs of ``rows`` (see :func:`prompt_logprob_rows`) from the decoder's
    hidden states ``[T, hidden_size]`` through the LM head ``compute_logits``, in chunks of
    ``PROMPT_LOGPROBS_CHUNK_BYTES``."""
    dev = hidden.device
    chunk = max(1, PROMPT_LOGPROBS_CHUNK_BYTES // (4 * vocab_size))
    out: dict[str, PromptLogprobsTensors] = {}
    for s, row0, count, first in rows:
        k = s.request.sampling_params.prompt_logprobs
        targets = torch.tensor(s.request.prompt_token_ids[first : first + count], dtype=torch.long, device=dev)
        lps, ranks, top_ids, top_lps = [], [], [], []
        for c0 in range(0, count, chunk):
            n = min(chunk, count - c0)
            logprobs = torch.log_softmax(compute_logits(hidden[row0 + c0 : row0 + c0 + n]), dim=-1)
            target_lp = logprobs.gather(1, targets[c0 : c0 + n].unsqueeze(1))  # [n, 1]
            lps.append(target_lp.squeeze(1))
            ranks.append((logprobs > target_lp).sum(dim=1) + 1)
            if k > 0:
                v, i = logprobs.topk(k, dim=-1)
                top_lps.append(v)
                top_ids.append(i)
            del logprobs
        if k > 0:
            top_lp_t, top_id_t = torch.cat(top_lps).cpu(), torch.cat(top_ids).cpu()
        else:
            top_lp_t, top_id_t = torch.empty((count, 0)), torch.empty((count, 0), dtype=torch.long)
        out[s.request.request_id] = PromptLogprobsTensors(
            first_token=first,
            token_logprobs=torch.cat(lps).cpu(),
            token_ranks=torch.cat(ranks).cpu(),
            top_ids=top_id_t,
            top_logprobs=top_lp_t,
        )
    return out
