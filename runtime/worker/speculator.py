"""Speculative decoding in the model runner: verify last step's drafts, propose the next ones.

The scheduler sends a decoding request's drafts with its step (``ScheduledRow.spec_token_ids``:
the step computes the last known token and the ``k`` drafts at once); the runner keeps the
logits of those ``k + 1`` rows and :meth:`Speculator.verify` turns them into the tokens the step
emits (1 .. k + 1): each row is sampled exactly as decoding without speculation samples it (row
``j`` processed as the request would be after ``draft[:j]``: penalties over those tokens too,
``min_tokens`` counted with them; greedy: the argmax; a seeded request draws position ``i`` from
``(seed, i)``), and the drafts are accepted while they equal those samples. For the model-free
(deterministic) proposers this is rejection sampling (:mod:`kvfleet.runtime.spec_decode.rejection`)
with its two draws coupled: a draft is accepted with probability ``p(draft)`` and a rejected
position emits a sample of ``p``, so the target distribution is kept, and greedy and seeded
requests emit exactly the tokens they emit without speculation, whatever the batch. Then
:meth:`Speculator.propose` guesses the next drafts of every request that sampled, by the
configured model-free method (``ngram``: prompt lookup; ``suffix``: suffix decoding), with an
adaptive ``k`` per request and a cap on the step's rows (``CPU_STEP_ROWS`` with the fused CPU
decoder, shared evenly by the requests).

Which requests speculate: not those asking for logprobs (their per-token logprobs would need
every verified row's), and none while ``disable_by_batch_size`` or more requests sample. How many
drafts (adaptive k): each request keeps an estimate ``p`` of its draft tokens' acceptance, and
proposes the ``k`` that makes the most tokens per unit of step cost (:func:`best_k`: a row costs
``row_cost`` of a one-row step, ``CPU_ROW_COST`` on the fused CPU path, so in a step of many
requests only likely drafts pay);
when no ``k`` pays (or ``p`` is below ``min_acceptance_rate``) it proposes nothing and probes with
one draft every ``PROBE_EVERY`` steps.
Plain data in and out; the model runner owns one per engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfleet.runtime.spec_decode import ngram, rejection
from kvfleet.runtime.spec_decode.config import SpeculativeConfig
from kvfleet.runtime.spec_decode.suffix import SuffixProposer
from kvfleet.runtime.worker.sampler import SampleLogprobs, Sampler, SamplingRow

PROBE_EVERY = 8
"""Steps between one-token probes of a request for which no draft pays."""
DECAY = 0.7
"""Weight of a request's acceptance history against its latest draft (an exponential average)."""
CPU_ROW_COST = 0.45
"""What one more row adds to a fused CPU decode step, as a fraction of a one-row step (measured on
a Xeon with AMX, int4 weights, ~1,000 tokens of context: 7.5 ms for one row, 21 ms for five)."""
ROW_COST = 0.1
"""The same elsewhere (GPUs: a decode step's rows are nearly free until it turns compute-bound);
not measured here."""
CPU_STEP_ROWS = 32
"""Most rows (one per request plus the drafts) a step of the fused CPU decoder is given with
drafts: beyond it a step is compute-bound and a draft row costs about what a plain row does, for
less than a token (docs/benchmarks.md, "Speculative decoding")."""


@dataclass
class _Row:
    """A request as its row ``j`` of a verification sees it: its output plus ``draft[:j]``."""

    sampling_params: object
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_id: int | None

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


def _rows_of(request: SamplingRow, draft: list[int]) -> list[_Row]:
    out = request.output_token_ids
    return [_Row(request.sampling_params, request.prompt_token_ids, out + draft[:j], request.eos_token_id)
            for j in range(len(draft) + 1)]


@dataclass
class _Acceptance:
    """A request's draft record: accepted drafts and trials (accepted drafts plus the first
    rejection of each draft), both decayed; ``accepted / trials`` estimates the chance that a draft
    token is accepted once the ones before it were."""

    accepted: float = 4.0   # a prior of 4 in 5: prompt lookup's drafts, when there are any, are often right
    trials: float = 5.0
    idle: int = 0


def best_k(p: float, max_k: int, row_cost: float, batch: int = 1) -> int:
    """The number of drafts (0 .. max_k) of one request that makes its step yield the most tokens
    per unit of cost, when each draft token is accepted with probability ``p`` once the ones before
    it were and the step has ``batch`` requests: tokens ``batch - 1 + (1 + p + ... + p^k)`` over
    cost ``1 + row_cost * (batch - 1 + k)`` one-row steps (the expected tokens of a k-draft step
    with a constant acceptance rate: Leviathan et al. 2023, eq. 1). The more rows a step already
    has, the likelier a draft must be to pay for its row."""
    base_tokens, base_cost = batch - 1.0, 1.0 + row_cost * (batch - 1)
    best, best_rate, tokens, term = 0, (base_tokens + 1.0) / base_cost, 1.0, 1.0
    for k in range(1, max_k + 1):
        term *= p
        tokens += term
        rate = (base_tokens + tokens) / (base_cost + row_cost * k)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


class Speculator:
    """One engine's proposer and verifier.

    Args:
        config: the engine's ``--speculative-config``.
        sampler: the model runner's sampler (its logits processing and generators).
        max_step_rows: the most rows a step should have (the fused CPU decoder's limit), or None.
        row_cost: what one more row adds to a step, as a fraction of a one-row step.
    """

    def __init__(self, config: SpeculativeConfig, sampler: Sampler, max_step_rows: int | None = None,
                 row_cost: float = ROW_COST) -> None:
        self.config = config
        self.sampler = sampler
        self.max_step_rows = max_step_rows
        self.row_cost = row_cost
        self.suffix = None
        if config.method == "suffix":
            self.suffix = SuffixProposer(config.suffix_decoding_max_tree_depth,
                                         config.suffix_decoding_max_cached_requests,
                                         config.suffix_decoding_min_token_prob)
        self._acceptance: dict[str, _Acceptance] = {}

    # ------------------------------------------------------------------ verification
    def verify(self, logits: torch.Tensor, req_ids: list[str], requests: list[SamplingRow],
               drafts: dict[str, list[int]]) -> tuple[dict[str, list[int]], dict[str, SampleLogprobs]]:
        """The tokens each request emits this step.

        Args:
            logits: ``[R, V]`` float32 (grammar-masked): one row per request, ``1 + k`` for a
                request with ``k`` drafts, in ``req_ids`` order; modified in place.
            req_ids, requests: the sampling requests and the runner's state of each.
            drafts: request id -> the drafts its rows verify (absent: none).

        Returns: ``(tokens, logprobs)`` by request id (logprobs only for plain rows that asked).
        """
        plain, spans = [], []
        row = 0
        for rid, req in zip(req_ids, requests):
            draft = drafts.get(rid, [])
            (spans if draft else plain).append((rid, req, draft, row))
            row += 1 + len(draft)
        tokens: dict[str, list[int]] = {}
        logprobs: dict[str, SampleLogprobs] = {}
        if plain:
            rows = [r for _, _, _, r in plain]
            sub = logits if len(rows) == logits.shape[0] else logits[rows]
            out = self.sampler(sub, [req for _, req, _, _ in plain])
            for (rid, _, _, _), token, lp in zip(plain, out.token_ids, out.logprobs):
                tokens[rid] = [token]
                if lp is not None:
                    logprobs[rid] = lp
        for rid, req, draft, row in spans:
            tokens[rid] = self._verify_one(logits[row : row + 1 + len(draft)], req, draft)
            self._observe(rid, len(draft), len(tokens[rid]) - 1)
        return tokens, logprobs

    def _verify_one(self, logits: torch.Tensor, request: SamplingRow, draft: list[int]) -> list[int]:
        """Each row sampled as plain decoding samples it (greedy: argmax; seeded: the generator
        of its output position), then the drafts accepted while they equal those samples: for a
        deterministic (model-free) proposer this is rejection sampling's rule with the two draws
        coupled -- a draft is accepted with probability p(draft), a rejected position emits a
        sample of p -- and every emitted token is the one decoding without speculation draws."""
        return rejection.accept_greedy(self.sampler(logits, _rows_of(request, draft)).token_ids, draft)

    def _observe(self, rid: str, num_draft: int, num_accepted: int) -> None:
        acc = self._acceptance.setdefault(rid, _Acceptance())
        acc.accepted = DECAY * acc.accepted + num_accepted
        acc.trials = DECAY * acc.trials + num_accepted + (num_accepted < num_draft)

    # ------------------------------------------------------------------ proposals
    def propose(self, req_ids: list[str], requests: list[SamplingRow],
                emitted: dict[str, list[int]]) -> dict[str, list[int]]:
        """Drafts for the next step of each request that sampled, by request id (requests with
        none are absent). ``emitted``: the tokens each got this step (not yet in its state). With
        ``max_step_rows``, the drafts of a step share what is left of it after one row per
        request, evenly (what a request does not use goes to the ones after it)."""
        cfg = self.config
        if cfg.disable_by_batch_size is not None and len(req_ids) >= cfg.disable_by_batch_size:
            return {}
        spare = None if self.max_step_rows is None else self.max_step_rows - len(req_ids)
        candidates = [(rid, req) for rid, req in zip(req_ids, requests) if req.sampling_params.logprobs is None]
        out: dict[str, list[int]] = {}
        for i, (rid, req) in enumerate(candidates):
            k = self._budget(rid, len(req_ids))
            if spare is not None:
                if spare <= 0:
                    break
                k = min(k, max(1, spare // (len(candidates) - i)))
            if k <= 0:
                continue
            context = req.prompt_token_ids + req.output_token_ids + emitted.get(rid, [])
            if self.suffix is not None:
                draft = self.suffix.propose(rid, context, len(req.prompt_token_ids), k)
            else:
                draft = ngram.propose(context, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
            if draft:
                out[rid] = draft
                if spare is not None:
                    spare -= len(draft)
        return out

    def _budget(self, rid: str, batch: int = 1) -> int:
        """Drafts request ``rid`` may propose now, in a step of ``batch`` requests: :func:`best_k` of
        its acceptance and the step's row cost, none below ``min_acceptance_rate``; a request for
        which none pays probes with one draft every ``PROBE_EVERY`` steps (its text may change
        character)."""
        acc = self._acceptance.setdefault(rid, _Acceptance())
        p = acc.accepted / acc.trials
        max_k = self.config.num_speculative_tokens
        k = 0 if p < self.config.min_acceptance_rate else best_k(p, max_k, self.row_cost, batch)
        if k > 0:
            acc.idle = 0
            return k
        acc.idle += 1
        if acc.idle < PROBE_EVERY:
            return 0
        acc.idle = 0
        return 1

    def finish(self, request_ids, final_tokens: dict[str, list[int]] | None = None) -> None:
        """Forget finished requests (suffix decoding: their outputs join the replica-wide table
        when ``final_tokens`` gives their prompt + output)."""
        for rid in request_ids:
            self._acceptance.pop(rid, None)
            if self.suffix is not None:
                self.suffix.finish(rid, (final_tokens or {}).get(rid))
