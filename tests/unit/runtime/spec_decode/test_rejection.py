"""Verification of proposed tokens (runtime/spec_decode/rejection.py): greedy equality and the
target distribution kept by rejection sampling (a chi-square test with a fixed seed)."""

import torch

from kvfleet.runtime.spec_decode.rejection import accept_greedy, accept_sampled

# Chi-square critical value, 5 degrees of freedom (6 categories), p = 0.001.
CHI2_5_P001 = 20.52


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_greedy_accepts_the_matching_prefix_and_adds_one_token():
    assert accept_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted + bonus
    assert accept_greedy([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # first mismatch: the target's token
    assert accept_greedy([4, 6, 7, 8], [5, 6, 7]) == [4]
    assert accept_greedy([3], []) == [3]


P0 = torch.tensor([0.05, 0.40, 0.25, 0.15, 0.10, 0.05])
P1 = torch.tensor([0.30, 0.10, 0.10, 0.20, 0.20, 0.10])


def _run(draft_token_of, draft_probs_of, trials: int = 12000):
    """Emitted first tokens, and second tokens after an accepted first draft."""
    gen = torch.Generator().manual_seed(1234)
    first = torch.zeros(6)
    second = torch.zeros(6)
    probs = torch.stack([P0, P1, P0])
    for _ in range(trials):
        draft = draft_token_of(gen)
        out = accept_sampled(probs, draft, [gen, gen, gen], draft_probs_of())
        first[out[0]] += 1
        if out[0] == draft[0] and len(out) > 1:
            second[out[1]] += 1
    return first, second


def test_deterministic_proposals_keep_the_target_distribution():
    # A model-free proposer that always guesses token 3 (unlikely under P0) then 0.
    first, second = _run(lambda g: [3, 0], lambda: None)
    assert _chi2(first, P0) < CHI2_5_P001
    assert _chi2(second, P1) < CHI2_5_P001
    # the acceptance rate of the first guess is P0[3]
    assert abs(float(first[3]) / first.sum() - float(P0[3])) < 0.02


def test_draft_model_proposals_keep_the_target_distribution():
    q = torch.tensor([0.30, 0.05, 0.05, 0.30, 0.25, 0.05])
    dq = torch.stack([q, q])

    def draft(g):
        return [int(torch.multinomial(q, 1, generator=g)), int(torch.multinomial(q, 1, generator=g))]

    first, second = _run(draft, lambda: dq)
    assert _chi2(first, P0) < CHI2_5_P001
    assert _chi2(second, P1) < CHI2_5_P001


def test_a_wrong_rule_is_caught():
    # Accepting every proposal would make the first token always 3: the test's statistic sees it.
    counts = torch.tensor([0.0, 0.0, 0.0, 12000.0, 0.0, 0.0])
    assert _chi2(counts, P0) > CHI2_5_P001
