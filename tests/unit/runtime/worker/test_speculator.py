"""The model runner's speculative decoding (runtime/worker/speculator.py) on hand-made logits:
verification through the real sampler keeps the processed target distribution (chi-square, fixed
seed), row j of a draft sees the draft's first j tokens (penalties), and proposals back off per
request, per step and per batch size."""

from __future__ import annotations

import torch

from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.spec_decode.config import SpeculativeConfig
from kvfleet.runtime.worker.request_state import CachedRequestState
from kvfleet.runtime.worker.sampler import Sampler
from kvfleet.runtime.worker.speculator import PROBE_EVERY, Speculator, best_k

CHI2_3_P001 = 16.27  # chi-square critical value, 3 degrees of freedom, p = 0.001


def state(params: SamplingParams, prompt=(1, 2, 3, 1, 2), output=(), rid="r") -> CachedRequestState:
    return CachedRequestState(rid, list(prompt), params, None, 0, [0], len(prompt), list(output))


def speculator(**cfg) -> Speculator:
    return Speculator(SpeculativeConfig(**cfg), Sampler(torch.device("cpu"), seed=5))


def test_sampled_verification_keeps_the_processed_target_distribution():
    # Vocabulary of 4; temperature 0.5 sharpens the logits: the emitted first token must follow
    # softmax(logits / 0.5) whatever the (deterministic) draft.
    logits = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4]))
    target = torch.softmax(logits / 0.5, dim=-1)
    spec = speculator()
    req = state(SamplingParams(temperature=0.5))
    counts = torch.zeros(4)
    trials = 6000
    for _ in range(trials):
        tokens, _ = spec.verify(logits.repeat(3, 1), ["r"], [req], {"r": [3, 3]})
        counts[tokens["r"][0]] += 1
    expected = target * trials
    assert float(((counts - expected) ** 2 / expected).sum()) < CHI2_3_P001


def test_greedy_rows_see_the_drafts_before_them():
    # Row 1 follows draft token 2: a repetition penalty over it turns the argmax of row 1 from 2 to 1.
    logits = torch.tensor([[0.0, 1.0, 3.0, 0.0], [0.0, 1.9, 2.0, 0.0], [0.0, 0.0, 0.0, 5.0]])
    spec = speculator()
    req = state(SamplingParams(temperature=0.0, repetition_penalty=1.5), prompt=(0,))
    tokens, _ = spec.verify(logits.clone(), ["r"], [req], {"r": [2, 2]})
    assert tokens["r"] == [2, 1]  # draft 1 accepted, draft 2 rejected: the target's token instead
    plain = state(SamplingParams(temperature=0.0), prompt=(0,))
    tokens, _ = spec.verify(logits.clone(), ["r"], [plain], {"r": [2, 2]})
    assert tokens["r"] == [2, 2, 3]  # both accepted and the bonus token


def test_k_is_the_one_that_pays_best():
    assert best_k(0.95, 4, 0.1) == 4  # cheap rows, likely drafts: all of them
    assert best_k(0.88, 8, 0.45) == 3  # CPU rows: fewer
    assert best_k(0.5, 4, 0.45) == 1
    assert best_k(0.3, 4, 0.45) == 0  # nothing pays
    assert best_k(0.6, 4, 0.45, batch=8) == 0 < best_k(0.6, 4, 0.45)  # a full step: only likely drafts pay


def test_proposals_back_off_when_rejected_and_probe_again():
    spec = speculator(num_speculative_tokens=3, min_acceptance_rate=0.3)
    spec.row_cost = 0.45
    req = state(SamplingParams(temperature=0.0), prompt=(7, 8, 9, 7, 8, 9, 7, 8))
    assert spec.propose(["r"], [req], {}) == {"r": [9, 7]}  # the 4-in-5 prior: two drafts pay best
    for _ in range(4):  # drafts with nothing accepted
        spec._observe("r", 3, 0)
    proposals = [spec.propose(["r"], [req], {}) for _ in range(PROBE_EVERY)]
    assert proposals[:-1] == [{}] * (PROBE_EVERY - 1) and proposals[-1] == {"r": [9]}
    for _ in range(6):  # then everything accepted: back to the most that pays
        spec._observe("r", 3, 3)
    assert spec.propose(["r"], [req], {}) == {"r": [9, 7, 8]}


def test_proposals_respect_the_step_rows_batch_size_and_logprobs():
    ids = ["a", "b", "c"]
    reqs = [state(SamplingParams(temperature=0.0), prompt=(7, 8, 9, 7, 8, 9, 7, 8), rid=r) for r in ids]
    spec = speculator(num_speculative_tokens=3)
    spec.max_step_rows = 5  # 3 rows + 2 drafts, shared: one each for the first two
    assert spec.propose(ids, reqs, {}) == {"a": [9], "b": [9]}
    spec.max_step_rows = 12  # 9 drafts: three each
    assert spec.propose(ids, reqs, {}) == {r: [9, 7, 8] for r in ids}
    assert speculator(disable_by_batch_size=3).propose(ids, reqs, {}) == {}
    lp = state(SamplingParams(temperature=0.0, logprobs=1), prompt=(7, 8, 9, 7, 8))
    assert speculator().propose(["x"], [lp], {}) == {}
