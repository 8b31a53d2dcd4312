"""Batched sampling: logits processing, greedy/random sampling, logprobs.

On ``logits [S, vocab_size]`` float32 (one row per request that samples; the rows of
constrained requests already masked by their grammar, :mod:`kvfleet.runtime.structured_output`),
in order: the token controls (``allowed_token_ids``: every other token ``-inf``; ``bad_words``:
a word's last token ``-inf`` when the output ends with the tokens before it; ``logit_bias``
added, OpenAI's semantics), ``repetition_penalty`` over prompt + output tokens (CTRL, Keskar et
al. 2019: positive logits divided, negative multiplied); ``frequency_penalty`` / ``presence_penalty`` over output
tokens (OpenAI API: ``logit -= f * count + p * (count > 0)``); ``min_tokens`` (EOS unless
``ignore_eos``, and ``stop_token_ids``, get ``-inf``); then greedy rows ``argmax``, others
temperature, ``top_k``, ``top_p`` (Holtzman et al. 2019), ``min_p`` (Nguyen et al. 2024) and an
exponential race ``argmax(p_i / E_i)``, ``E_i ~ Exponential(1)`` (Gumbel-max equivalent).
A seeded request draws from a generator re-seeded each step from ``(seed, output tokens so
far)``. Logprobs (``logprobs=k``): ``log_softmax`` after penalties, ``min_tokens`` and
temperature, before truncation; the sampled token's logprob and 1-based rank plus the ``k``
best. Semantics: docs/engine.md, "Sampling semantics".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvfleet.runtime.sampling_params import SamplingParams

_MASK63 = (1 << 63) - 1


class SamplingRow(Protocol):
    """What the sampler reads of one row's request, plain data (the model runner's
    :class:`~kvfleet.runtime.worker.request_state.CachedRequestState` is one)."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_id: int | None

    @property
    def num_output_tokens(self) -> int: ...


def step_seed(seed: int, step: int) -> int:
    """Seed of a request's generator at output step ``step`` (a splitmix64-style mix of the
    request seed and the step; any Python int seed works)."""
    z = ((seed & 0xFFFFFFFFFFFFFFFF) + (step + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _MASK63


def _plain_greedy(requests: list[SamplingRow]) -> bool:
    """True when every request is greedy with no penalty, no logprobs and no ``min_tokens``
    ban still in force: the sampled tokens are then the rows' argmax."""
    for r in requests:
        p = r.sampling_params
        if (p.temperature != 0.0 or p.logprobs is not None or p.repetition_penalty != 1.0
                or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
                or _min_tokens_bans(r) or _has_token_controls(p)):
            return False
    return True


def _min_tokens_bans(r: SamplingRow) -> bool:
    """Whether ``min_tokens`` bans a token this step: output still short, and a stop token or
    (without ``ignore_eos``) an EOS token to ban (the ban of step 2 in :class:`Sampler`)."""
    p = r.sampling_params
    return bool(p.min_tokens and r.num_output_tokens < p.min_tokens
                and (p.stop_token_ids or (not p.ignore_eos and r.eos_token_id is not None)))


def _has_token_controls(p) -> bool:
    return bool(p.logit_bias or p.allowed_token_ids or p.bad_words_token_ids)


def apply_token_controls(logits: torch.Tensor, requests: list[SamplingRow]) -> None:
    """``allowed_token_ids``, ``bad_words`` and ``logit_bias`` of each row, in place (``logits``
    ``[S, vocab_size]``, row ``i`` for ``requests[i]``)."""
    vocab = logits.shape[1]
    for i, r in enumerate(requests):
        p = r.sampling_params
        if not _has_token_controls(p):
            continue
        row = logits[i]
        if p.allowed_token_ids:
            keep = torch.tensor([t for t in p.allowed_token_ids if t < vocab], dtype=torch.long, device=row.device)
            allowed = row.index_select(0, keep)
            row.fill_(float("-inf")).index_copy_(0, keep, allowed)
        if p.bad_words_token_ids:
            out = r.output_token_ids
            banned = [ids[-1] for ids in p.bad_words_token_ids
                      if ids[-1] < vocab and (len(ids) == 1 or out[len(out) - len(ids) + 1:] == ids[:-1])]
            if banned:
                row[banned] = float("-inf")
        if p.logit_bias:
            ids = [t for t in p.logit_bias if t < vocab]
            if ids:
                bias = torch.tensor([float(p.logit_bias[t]) for t in ids], dtype=row.dtype, device=row.device)
                row.index_add_(0, torch.tensor(ids, dtype=torch.long, device=row.device), bias)


def _argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (first maximum; a NaN counts as the maximum, as in torch). On the CPU
    through NumPy, single-threaded: ``torch.argmax`` over one 49k-wide row took ~140 us (it wakes
    the intra-op threads for two chunks), NumPy ~7 us."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


@dataclass
class SampleLogprobs:
    """Logprobs of one sampled token.

    Attributes:
        logprob: natural-log probability of the sampled token.
        rank: its 1-based rank in the distribution.
        top_ids: the ``k`` most likely token ids (best first).
        top_logprobs: their logprobs.
    """

    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class SamplerOutput:
    """``token_ids[i]`` is the token sampled for row ``i``; ``logprobs[i]`` is None unless
    that request asked for logprobs."""

    token_ids: list[int]
    logprobs: list[SampleLogprobs | None]


@dataclass
class SampledRows:
    """A step's sampled tokens keyed by request id (what the model runner returns):
    ``token_ids`` for every request that sampled (one token, or with speculative decoding the
    1 .. k + 1 its verified drafts gave), ``logprobs`` for the requests that asked, and
    ``spec_token_ids``, the drafts proposed for each request's next step."""

    token_ids: dict[str, list[int]]
    logprobs: dict[str, SampleLogprobs]
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def of(cls, req_ids: list[str], out: SamplerOutput) -> SampledRows:
        return cls({rid: [t] for rid, t in zip(req_ids, out.token_ids)},
                   {rid: lp for rid, lp in zip(req_ids, out.logprobs) if lp is not None})


class Sampler:
    """Samples one token per row.

    Args:
        device: device of the logits.
        seed: seed of the generator shared by unseeded requests.
    """

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._seeded_generator = torch.Generator(device=device)

    def __call__(self, logits: torch.Tensor, requests: list[SamplingRow]) -> SamplerOutput:
        """Sample the next token of each request.

        Args:
            logits: ``[S, vocab_size]`` float32, row ``i`` for ``requests[i]``; modified in place.
            requests: the ``S`` requests (their ``sampling_params``, ``prompt_token_ids``,
                ``output_token_ids`` and ``eos_token_id`` are read).

        Returns: a :class:`SamplerOutput` with ``S`` tokens.
        """
        num_rows = len(requests)
        if num_rows == 0:
            return SamplerOutput([], [])
        if _plain_greedy(requests):
            # Every row greedy, no penalties, no logprobs, no min_tokens ban in force: the
            # pipeline below would change nothing before its argmax.
            return SamplerOutput(_argmax_rows(logits), [None] * num_rows)
        dev = logits.device
        params = [r.sampling_params for r in requests]
        vocab = logits.shape[1]
        self._process(logits, requests)
        greedy = [p.temperature == 0.0 for p in params]
        all_greedy = all(greedy)
        want_logprobs = any(p.logprobs is not None for p in params)

        if all_greedy:
            tokens = logits.argmax(dim=-1)
            lp_logits = logits
        else:
            temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=dev)
            logits.div_(temps.unsqueeze(1))
            lp_logits = logits.clone() if want_logprobs else logits
            self._truncate(logits, params)
            probs = torch.softmax(logits, dim=-1)
            q = torch.empty_like(probs)
            unseeded = [i for i, p in enumerate(params) if p.seed is None and not greedy[i]]
            if unseeded:
                draws = torch.empty((len(unseeded), vocab), device=dev).exponential_(generator=self.generator)
                if len(unseeded) == num_rows:
                    q = draws
                else:
                    q[unseeded] = draws
            g = self._seeded_generator
            for i, p in enumerate(params):
                if p.seed is not None and not greedy[i]:
                    g.manual_seed(step_seed(p.seed, requests[i].num_output_tokens))
                    q[i].exponential_(generator=g)
            tokens = probs.div_(q).argmax(dim=-1)
            if any(greedy):
                gmask = torch.tensor(greedy, device=dev)
                tokens = torch.where(gmask, lp_logits.argmax(dim=-1), tokens)

        token_list = tokens.tolist()
        logprobs: list[SampleLogprobs | None] = [None] * num_rows
        if want_logprobs:
            rows = [i for i, p in enumerate(params) if p.logprobs is not None]
            idx = torch.tensor(rows, device=dev)
            lps = torch.log_softmax(lp_logits.index_select(0, idx), dim=-1)
            chosen = tokens.index_select(0, idx)
            chosen_lp = lps.gather(1, chosen.unsqueeze(1))  # [R, 1]
            ranks = (lps > chosen_lp).sum(dim=1) + 1
            k = max(params[i].logprobs for i in rows)
            top_lp, top_ids = lps.topk(k, dim=-1) if k > 0 else (lps[:, :0], lps[:, :0].long())
            chosen_l, ranks_l = chosen_lp.squeeze(1).tolist(), ranks.tolist()
            top_lp_l, top_ids_l = top_lp.tolist(), top_ids.tolist()
            for j, i in enumerate(rows):
                ki = params[i].logprobs
                logprobs[i] = SampleLogprobs(chosen_l[j], ranks_l[j], top_ids_l[j][:ki], top_lp_l[j][:ki])
        return SamplerOutput(token_list, logprobs)

    def _process(self, logits: torch.Tensor, requests: list[SamplingRow]) -> None:
        """Steps 0-2, in place: token controls, penalties, ``min_tokens`` bans."""
        params = [r.sampling_params for r in requests]
        vocab = logits.shape[1]
        # 0. Token controls (allowed_token_ids, bad_words, logit_bias).
        if any(_has_token_controls(p) for p in params):
            apply_token_controls(logits, requests)
        # 1. Penalties.
        rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        if rep_rows:
            self._apply_repetition_penalty(logits, requests, rep_rows, vocab)
        fp_rows = [i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
        if fp_rows:
            self._apply_frequency_presence(logits, requests, fp_rows, vocab)
        # 2. min_tokens.
        for i, r in enumerate(requests):
            p = params[i]
            if p.min_tokens and r.num_output_tokens < p.min_tokens:
                banned = [t for t in p.stop_token_ids if t < vocab]
                if not p.ignore_eos and r.eos_token_id is not None and r.eos_token_id < vocab:
                    banned.append(r.eos_token_id)
                if banned:
                    logits[i, banned] = float("-inf")

    # ------------------------------------------------------------------ processors
    @staticmethod
    def _apply_repetition_penalty(logits: torch.Tensor, requests: list[SamplingRow], rows: list[int],
                                  vocab: int) -> None:
        dev = logits.device
        seen = torch.zeros((len(rows), vocab), dtype=torch.bool, device=dev)
        row_idx, tok_idx = [], []
        for j, i in enumerate(rows):
            r = requests[i]
            toks = set(r.prompt_token_ids)
            toks.update(r.output_token_ids)
            row_idx.extend([j] * len(toks))
            tok_idx.extend(toks)
        flat_rows = torch.tensor(row_idx, dtype=torch.long, device=dev)
        seen[flat_rows, torch.tensor(tok_idx, dtype=torch.long, device=dev).clamp_(max=vocab - 1)] = True
        idx = torch.tensor(rows, dtype=torch.long, device=dev)
        sub = logits.index_select(0, idx)
        penalty = torch.tensor([requests[i].sampling_params.repetition_penalty for i in rows], device=dev).unsqueeze(1)
        penalized = torch.where(sub > 0, sub / penalty, sub * penalty)
        logits[idx] = torch.where(seen, penalized, sub)

    @staticmethod
    def _apply_frequency_presence(logits: torch.Tensor, requests: list[SamplingRow], rows: list[int],
                                  vocab: int) -> None:
        dev = logits.device
        counts = torch.zeros((len(rows), vocab), dtype=logits.dtype, device=dev)
        for j, i in enumerate(rows):
            out = requests[i].output_token_ids
            if out:
                ids = torch.tensor(out, dtype=torch.long, device=dev)
                counts[j].index_add_(0, ids, torch.ones(len(out), dtype=logits.dtype, device=dev))
        freq = torch.tensor([requests[i].sampling_params.frequency_penalty for i in rows], device=dev).unsqueeze(1)
        pres = torch.tensor([requests[i].sampling_params.presence_penalty for i in rows], device=dev).unsqueeze(1)
        idx = torch.tensor(rows, device=dev)
        logits[idx] = logits.index_select(0, idx) - freq * counts - pres * (counts > 0).to(logits.dtype)

    @staticmethod
    def _truncate(logits: torch.Tensor, params) -> None:
        """top-k, top-p and min-p, in place (filtered logits become -inf)."""
        dev = logits.device
        vocab = logits.shape[1]
        use_k = any(p.top_k > 0 for p in params)
        use_p = any(p.top_p < 1.0 for p in params)
        if use_k or use_p:
            sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
            remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
            if use_k:
                ks = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=dev)
                remove |= torch.arange(vocab, device=dev).unsqueeze(0) >= ks.unsqueeze(1)
            if use_p:
                # top_p 1.0 keeps every token: its row gets no threshold, or the float32 rounding
                # of the cumulative sum would cut its tail only when another row asks for top_p.
                ps = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params],
                                  device=dev).unsqueeze(1)
                sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
                # Exclusive cumulative sum: a token is kept while the mass before it is < top_p,
                # so the kept set is the smallest one whose mass reaches top_p (and never empty).
                mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
                remove |= mass_before >= ps
            logits.scatter_(1, sorted_idx, sorted_logits.masked_fill(remove, float("-inf")))
        if any(p.min_p > 0.0 for p in params):
            mins = torch.tensor([p.min_p for p in params], device=dev).unsqueeze(1)
            probs = torch.softmax(logits, dim=-1)
            top = probs.max(dim=-1, keepdim=True).values
            logits.masked_fill_(probs < mins * top, float("-inf"))
