"""Sampler on synthetic logits (no model): filters, penalties, min_tokens, seeds, logprobs,
and the sampled distribution."""

from __future__ import annotations

import math

import pytest
import torch

from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.worker.request_state import CachedRequestState
from kvfleet.runtime.worker.sampler import Sampler, step_seed

VOCAB = 8
PROBS = [0.5, 0.3, 0.2, 0.0, 0.0, 0.0, 0.0, 0.0]


def logits_of(probs, rows=1) -> torch.Tensor:
    base = torch.tensor([math.log(p) if p > 0 else -1e9 for p in probs], dtype=torch.float32)
    return base.repeat(rows, 1)


def req(params: SamplingParams, prompt=(1, 2, 3), output=(), eos=None, rid="r") -> CachedRequestState:
    # the sampler reads the model runner's plain per-request state
    return CachedRequestState(rid, list(prompt), params, eos, 0, [], 0, list(output))


def frequencies(params: SamplingParams, n=4000, probs=PROBS) -> list[float]:
    sampler = Sampler(torch.device("cpu"), seed=0)
    out = sampler(logits_of(probs, n), [req(params, rid=str(i)) for i in range(n)])
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=VOCAB).tolist()
    return [c / n for c in counts]


def test_unfiltered_distribution_matches_probabilities():
    freq = frequencies(SamplingParams(temperature=1.0))
    for f, p in zip(freq, PROBS):
        assert abs(f - p) < 0.03


def test_temperature_sharpens():
    freq = frequencies(SamplingParams(temperature=0.25))
    # p^(1/T) renormalised: 0.5^4 : 0.3^4 : 0.2^4 = 0.0625 : 0.0081 : 0.0016
    expect = [0.0625 / 0.0722, 0.0081 / 0.0722, 0.0016 / 0.0722]
    for f, p in zip(freq, expect):
        assert abs(f - p) < 0.03


def test_top_p_top_k_min_p_cut_the_tail():
    # top_p=0.7: keep 0 (mass before 0) and 1 (mass before 0.5 < 0.7); drop 2 (0.8 >= 0.7).
    freq = frequencies(SamplingParams(temperature=1.0, top_p=0.7))
    assert freq[2] == 0 and abs(freq[0] - 0.5 / 0.8) < 0.03
    freq = frequencies(SamplingParams(temperature=1.0, top_k=2))
    assert freq[2] == 0 and abs(freq[1] - 0.3 / 0.8) < 0.03
    # min_p=0.5: keep tokens with p >= 0.25 -> {0, 1}.
    freq = frequencies(SamplingParams(temperature=1.0, min_p=0.5))
    assert freq[2] == 0 and freq[0] > 0.5
    for params in (SamplingParams(top_k=1), SamplingParams(top_p=0.01), SamplingParams(min_p=1.0)):
        assert frequencies(params, n=200)[0] == 1.0


def test_mixed_batch_greedy_rows_are_argmax():
    sampler = Sampler(torch.device("cpu"))
    logits = logits_of([0.1, 0.2, 0.7, 0, 0, 0, 0, 0], 4)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=1)] * 2
    out = sampler(logits, [req(p, rid=str(i)) for i, p in enumerate(params)])
    assert out.token_ids[0] == 2 and out.token_ids[2] == 2


def test_repetition_and_frequency_presence_penalties():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0]])
    r = req(SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1])
    Sampler._apply_repetition_penalty(logits, [r], [0], 4)
    assert logits.tolist() == [[1.0, -2.0, 0.5, 0.0]]
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0]])
    r = req(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), prompt=[2], output=[0, 0, 1])
    Sampler._apply_frequency_presence(logits, [r], [0], 4)
    # Output tokens only (OpenAI): 0 seen twice, 1 once, 2 only in the prompt.
    assert logits[0].tolist() == pytest.approx([2.0 - 1.0 - 0.25, -1.0 - 0.5 - 0.25, 0.5, 0.0])


def test_repetition_penalty_of_a_later_row_changes_that_row_only():
    # A batch whose only penalised request is row 1 (the row index and the penalised-rows index
    # differ): row 0 untouched, row 1 penalised by its own tokens.
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0], [2.0, -1.0, 0.5, 0.0]])
    plain = req(SamplingParams(), prompt=[0], output=[1])
    pen = req(SamplingParams(repetition_penalty=2.0), prompt=[2], output=[1])
    Sampler._apply_repetition_penalty(logits, [plain, pen], [1], 4)
    assert logits.tolist() == [[2.0, -1.0, 0.5, 0.0], [2.0, -2.0, 0.25, 0.0]]


def test_penalties_change_the_greedy_choice():
    sampler = Sampler(torch.device("cpu"))
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0]])
    r = req(SamplingParams(temperature=0, repetition_penalty=1.5), prompt=[0])
    assert sampler(logits, [r]).token_ids == [1]
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0]])
    r = req(SamplingParams(temperature=0, presence_penalty=0.5), output=[0])
    assert sampler(logits, [r]).token_ids == [1]


def test_min_tokens_masks_eos_and_stop_ids():
    sampler = Sampler(torch.device("cpu"))
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1])
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])
    assert sampler(logits.clone(), [req(params, output=[3], eos=0)]).token_ids == [2]
    assert sampler(logits.clone(), [req(params, output=[3, 3], eos=0)]).token_ids == [0]
    # ignore_eos: EOS is not a stop token, so min_tokens leaves it alone.
    assert sampler(logits.clone(), [req(params.clone(ignore_eos=True), output=[3], eos=0)]).token_ids == [0]


def test_seeded_draws_depend_only_on_seed_and_step():
    params = SamplingParams(temperature=1.0, seed=42)
    probs = [1 / VOCAB] * VOCAB

    def draw(batch_size: int, position: int, step: int) -> int:
        sampler = Sampler(torch.device("cpu"), seed=batch_size)  # the shared generator differs
        reqs = [req(SamplingParams(temperature=1.0), rid=f"o{i}") for i in range(batch_size)]
        reqs.insert(position, req(params, output=[0] * step, rid="seeded"))
        return sampler(logits_of(probs, batch_size + 1), reqs).token_ids[position]

    for step in range(6):
        alone = draw(0, 0, step)
        assert draw(5, 3, step) == alone
        assert draw(15, 15, step) == alone
    assert len({draw(0, 0, step) for step in range(20)}) > 1
    assert step_seed(42, 0) != step_seed(42, 1) != step_seed(43, 1)


def test_logprobs_are_processed_and_ranked():
    sampler = Sampler(torch.device("cpu"))
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    out = sampler(logits.clone(), [req(SamplingParams(temperature=0, logprobs=2))])
    lp = out.logprobs[0]
    ref = torch.log_softmax(logits[0], -1)
    assert out.token_ids == [1] and lp.rank == 1
    assert lp.logprob == pytest.approx(ref[1].item())
    assert lp.top_ids == [1, 2] and lp.top_logprobs == pytest.approx([ref[1].item(), ref[2].item()])
    # With temperature the logprobs are those of the tempered distribution.
    out = sampler(logits.clone(), [req(SamplingParams(temperature=2.0, seed=3, logprobs=0))])
    lp = out.logprobs[0]
    ref = torch.log_softmax(logits[0] / 2.0, -1)
    assert lp.logprob == pytest.approx(ref[out.token_ids[0]].item())
    assert lp.top_ids == [] and lp.rank == int((ref > ref[out.token_ids[0]]).sum()) + 1
    assert out.logprobs is not None and sampler(logits.clone(), [req(SamplingParams())]).logprobs == [None]


def test_min_tokens_counts_as_a_ban_only_when_there_is_a_token_to_ban():
    from kvfleet.runtime.worker.sampler import _plain_greedy

    def greedy(**kw):
        return SamplingParams(temperature=0.0, min_tokens=4, **kw)

    # kvfleet bench's requests: ignore_eos, no stop tokens: nothing to ban, the argmax fast path.
    assert _plain_greedy([req(greedy(ignore_eos=True), eos=7)])
    assert not _plain_greedy([req(greedy(), eos=7)])  # EOS is banned
    assert not _plain_greedy([req(greedy(ignore_eos=True, stop_token_ids=[5]), eos=7)])
    assert _plain_greedy([req(greedy(), output=(1, 2, 3, 4), eos=7)])  # min_tokens reached
    # And the fast path gives the argmax the full pipeline gives: the banned token stays banned.
    logits = torch.tensor([[0.0, 1.0, 5.0, 0.5]])
    assert Sampler(torch.device("cpu"))(logits.clone(), [req(greedy(), eos=2)]).token_ids == [1]
    assert Sampler(torch.device("cpu"))(logits.clone(), [req(greedy(ignore_eos=True), eos=2)]).token_ids == [2]


def test_a_rows_truncation_does_not_depend_on_its_neighbours():
    """A row with top_p 1.0 keeps its whole distribution also beside a row with top_p < 1 (the
    float32 cumulative sum of a peaked 49k-token distribution reaches 1.0 before its tail: the old
    sampler cut ~19k tail tokens of that row, only when a neighbour used top_p)."""
    logits = torch.randn(49152, generator=torch.Generator().manual_seed(0)) * 4
    rows = torch.stack([logits, logits])
    Sampler._truncate(rows, [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.5, top_k=40)])
    assert torch.equal(rows[0], logits)
    assert 49152 - 40 <= torch.isinf(rows[1]).sum() < 49152  # the neighbour is truncated


# ----------------------------------------------------------------------------- token controls
def test_logit_bias_allowed_token_ids_and_bad_words_in_the_sampler():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0 + 1e-9, 1e-9, 1e-9, 1e-9, 1e-9]])).repeat(4, 1)
    params = [
        SamplingParams(temperature=0, logit_bias={0: -100}),
        SamplingParams(temperature=0, logit_bias={5: 100}),
        SamplingParams(temperature=0, allowed_token_ids=[2, 6]),
        SamplingParams(temperature=0, bad_words_token_ids=[[0], [9, 1]]),
    ]
    reqs = [req(p, prompt=[1], rid=str(i)) for i, p in enumerate(params)]
    reqs[3].output_token_ids = [9]  # the output ends with the first token of [9, 1]: token 1 banned too
    out = Sampler(torch.device("cpu"))(logits.clone(), reqs)
    assert out.token_ids == [1, 5, 2, 2]
    for bad in ({0: 101}, {-1: 1}, {0: math.inf}):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
