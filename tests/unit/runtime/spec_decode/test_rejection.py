"""Verification of proposed tokens (runtime/spec_decode/rejection.py): the accepted prefix and
the row's own token at the first mismatch. That sampled rows keep the target distribution through
it is tested with the real sampler in tests/unit/runtime/worker/test_speculator.py."""

from kvfleet.runtime.spec_decode.rejection import accept_greedy


def test_greedy_accepts_the_matching_prefix_and_adds_one_token():
    assert accept_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted + bonus
    assert accept_greedy([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # first mismatch: the target's token
    assert accept_greedy([4, 6, 7, 8], [5, 6, 7]) == [4]
    assert accept_greedy([3], []) == [3]
