"""The engine's log-probabilities (:class:`~kvfleet.runtime.engine.outputs.Logprob`) as response bodies.

Three shapes, as OpenAI and vLLM: legacy completions logprobs (parallel lists, with ``echo`` the
prompt's first), chat logprobs (one entry per token with its top alternatives), and vLLM's raw
``prompt_logprobs``. JSON has no infinities: -inf and NaN are reported as :data:`LOGPROB_FLOOR`.
"""

from __future__ import annotations

import math
from typing import Any

from kvfleet.runtime.engine.outputs import CompletionOutput, Logprob
from kvfleet.runtime.entrypoints.openai import protocol as P

LOGPROB_FLOOR = -9999.0
"""-inf / NaN log-probabilities are reported as this (JSON has no infinities)."""


def finite(x: float | None) -> float:
    if x is None or math.isnan(x):
        return LOGPROB_FLOOR
    return max(float(x), LOGPROB_FLOOR)


class TokenText:
    """Token strings for logprobs: the engine's ``decoded_token`` or the tokenizer's; with
    ``as_token_ids`` (vLLM's ``return_tokens_as_token_ids``) ``"token_id:{id}"`` instead, so that
    tokens that are no whole UTF-8 text stay identifiable."""

    def __init__(self, tokenizer: Any, as_token_ids: bool = False):
        self.tokenizer = tokenizer
        self.as_token_ids = as_token_ids

    def __call__(self, token_id: int, lp: Logprob | None) -> str:
        if self.as_token_ids:
            return f"token_id:{token_id}"
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([token_id])


def _output_entries(c: CompletionOutput, j: int) -> dict[int, Logprob]:
    """The logprobs of output token ``j`` (the sampled token and the top ones), token id -> Logprob."""
    return (c.logprobs[j] if c.logprobs is not None and j < len(c.logprobs) else None) or {}


def _legacy_top(entries: dict[int, Logprob], tid: int, k: int, detok: TokenText) -> dict[str, float]:
    """One position's legacy ``top_logprobs``: token text -> logprob (-inf as -9999.0) of the
    entries of rank <= ``k``, by rank, plus token ``tid`` (the sampled or prompt token) always,
    as vLLM; texts that decode alike keep the better-ranked entry."""
    top: dict[str, float] = {}
    for tok_id, lp in sorted(entries.items(), key=lambda kv: kv[1].rank or 0):
        if tok_id == tid or lp.rank is None or lp.rank <= k:
            top.setdefault(detok(tok_id, lp), finite(lp.logprob))
    return top


def completion_logprobs(
    c: CompletionOutput, start: int, end: int, k: int, detok: TokenText, offset: int
) -> tuple[P.CompletionLogProbs, int]:
    """Legacy logprobs of output tokens ``[start, end)``; returns them and the next text offset."""
    out = P.CompletionLogProbs()
    for j in range(start, end):
        tid = c.token_ids[j]
        entries = _output_entries(c, j)
        sampled = entries.get(tid)
        token = detok(tid, sampled)
        out.tokens.append(token)
        out.token_logprobs.append(finite(sampled.logprob) if sampled is not None else None)
        out.top_logprobs.append(_legacy_top(entries, tid, k, detok))
        out.text_offset.append(offset)
        offset += len(token)
    return out, offset


def echo_logprobs(
    prompt_ids: list[int], prompt_logprobs: list[dict[int, Logprob] | None] | None, k: int, detok: TokenText
) -> tuple[P.CompletionLogProbs, int]:
    """Legacy logprobs of the prompt tokens (``echo``), as vLLM: a position without an entry
    (the first) has token_logprobs and top_logprobs None; returns them and the next text offset."""
    out = P.CompletionLogProbs()
    offset = 0
    for j, tid in enumerate(prompt_ids):
        entries = prompt_logprobs[j] if prompt_logprobs is not None and j < len(prompt_logprobs) else None
        if entries is None:
            token = detok(tid, None)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            actual = entries.get(tid)
            token = detok(tid, actual)
            out.token_logprobs.append(finite(actual.logprob) if actual is not None else None)
            out.top_logprobs.append(_legacy_top(entries, tid, k, detok))
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(token)
    return out, offset


def join_logprobs(a: P.CompletionLogProbs, b: P.CompletionLogProbs) -> P.CompletionLogProbs:
    return P.CompletionLogProbs(
        text_offset=a.text_offset + b.text_offset,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        tokens=a.tokens + b.tokens,
        top_logprobs=a.top_logprobs + b.top_logprobs,
    )


def prompt_logprobs_body(
    plp: list[dict[int, Logprob] | None] | None, prompt_ids: list[int] | None = None, k: int | None = None
) -> P.PromptLogprobs | None:
    """vLLM's ``prompt_logprobs`` for a response body (-inf clamped to -9999.0, as vLLM).

    With ``prompt_ids`` and ``k``: only the prompt token and the entries of rank <= ``k`` (the
    engine scored more for ``echo`` + a larger ``logprobs``)."""
    if plp is None:
        return None
    return [
        None
        if entries is None
        else {
            tid: P.PromptLogprob(logprob=finite(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
            for tid, lp in entries.items()
            if k is None or prompt_ids is None or tid == prompt_ids[j] or lp.rank is None or lp.rank <= k
        }
        for j, entries in enumerate(plp)
    ]


def chat_logprobs(c: CompletionOutput, start: int, end: int, k: int, detok: TokenText) -> P.ChatChoiceLogprobs:
    """Chat logprobs of output tokens ``[start, end)``: each with its top ``k`` alternatives, by rank."""
    content = []
    for j in range(start, end):
        tid = c.token_ids[j]
        entries = _output_entries(c, j)
        sampled = entries.get(tid)
        token = detok(tid, sampled)
        top = []
        ranked = sorted(
            ((lp.rank, tok_id, lp) for tok_id, lp in entries.items() if lp.rank is not None), key=lambda t: t[0]
        )
        for rank, tok_id, lp in ranked:
            if rank <= k:
                s = detok(tok_id, lp)
                top.append(P.TopLogprob(token=s, logprob=finite(lp.logprob), bytes=list(s.encode("utf-8"))))
        content.append(
            P.ChatTokenLogprob(
                token=token,
                logprob=finite(sampled.logprob if sampled is not None else None),
                bytes=list(token.encode("utf-8")),
                top_logprobs=top[:k],
            )
        )
    return P.ChatChoiceLogprobs(content=content)
