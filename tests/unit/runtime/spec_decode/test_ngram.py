"""Prompt lookup proposals (runtime/spec_decode/ngram.py)."""

from kvfleet.runtime.spec_decode.ngram import propose


def test_the_longest_match_wins_then_the_latest():
    # "1 2 3" occurs at the start followed by 9 9; "2 3" also occurs later followed by 7 7
    tokens = [1, 2, 3, 9, 9, 5, 2, 3, 7, 7, 4, 1, 2, 3]
    assert propose(tokens, k=2, min_n=2, max_n=3) == [9, 9]  # 3-gram beats the later 2-gram
    assert propose(tokens, k=2, min_n=2, max_n=2) == [7, 7]  # equal length: the latest occurrence


def test_no_match_below_min_n_proposes_nothing():
    assert propose([5, 6, 7, 8, 6], k=3, min_n=2, max_n=4) == []
    assert propose([5, 6, 7, 8, 6], k=3, min_n=1, max_n=4) == [7, 8, 6]
    assert propose([1], k=3, min_n=1, max_n=4) == []
    assert propose([], k=3, min_n=1, max_n=4) == []


def test_proposal_is_cut_at_the_sequence_end_and_at_k():
    tokens = [4, 5, 6, 4, 5]
    assert propose(tokens, k=5, min_n=2, max_n=3) == [6, 4, 5]
    assert propose(tokens, k=1, min_n=2, max_n=3) == [6]


def test_matches_a_brute_force_search_on_random_sequences():
    import random

    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(2, 40))]
        lo, hi = rng.randrange(1, 4), 4
        expect = []
        for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
            ends = [e for e in range(n - 1, len(tokens) - 1) if tokens[e - n + 1 : e + 1] == tokens[-n:]]
            if ends:
                expect = tokens[ends[-1] + 1 : ends[-1] + 4]
                break
        assert propose(tokens, k=3, min_n=lo, max_n=hi) == expect, tokens
