"""Suffix decoding proposals (runtime/spec_decode/suffix.py)."""

from kvfleet.runtime.spec_decode.suffix import ContinuationTrie, SuffixProposer


def _count(trie: ContinuationTrie, path: list[int]) -> int:
    node = trie.root
    for t in path:
        node = node.children.get(t)
        if node is None:
            return 0
    return node.count


def test_node_counts_are_occurrence_counts_and_extend_equals_add():
    seq = [1, 2, 1, 2, 3, 1, 2, 1]
    whole = ContinuationTrie(max_depth=3)
    whole.add(seq)
    grown = ContinuationTrie(max_depth=3)
    frontier = []
    for i in range(0, len(seq), 3):
        frontier = grown.extend(frontier, seq[i : i + 3])
    for path in ([1], [1, 2], [1, 2, 1], [2, 1], [1, 2, 3, 1], [3], [2, 3, 1, 2]):
        occurrences = sum(seq[s : s + len(path)] == path for s in range(len(seq)))
        assert _count(whole, path) == occurrences, path
        assert _count(grown, path) == occurrences, path
    assert whole.num_nodes == grown.num_nodes


def test_remove_undoes_add():
    trie = ContinuationTrie(max_depth=4)
    trie.add([7, 8, 9])
    before = trie.num_nodes
    trie.add([1, 2, 3, 1, 2, 4])
    trie.remove([1, 2, 3, 1, 2, 4])
    assert trie.num_nodes == before
    assert set(trie.root.children) == {7, 8, 9}


def test_proposes_the_most_frequent_continuation_while_likely():
    trie = ContinuationTrie(max_depth=4)
    trie.add([5, 1, 2, 3, 5, 1, 2, 3, 5, 1, 2, 4])
    assert trie.propose([9, 5, 1], k=2, min_prob=0.5) == [2, 3]
    assert trie.propose([9, 5, 1], k=2, min_prob=0.7) == [2]  # 3 follows "1 2" 2 times out of 3
    assert trie.propose([6], k=2, min_prob=0.0) == []


def test_proposer_uses_the_request_and_recent_outputs():
    prop = SuffixProposer(max_depth=8, max_cached_requests=1, min_token_prob=0.1)
    prompt = [10, 11, 12]
    first = prompt + [20, 21, 22, 23, 24]
    for n in range(len(prompt), len(first) + 1):
        prop.propose("a", first[:n], len(prompt), k=3)
    prop.finish("a", first)
    # a new request whose output starts like the cached one gets the rest of it
    assert prop.propose("b", [30, 20, 21], 1, k=3) == [22, 23, 24]
    # the oldest cached output leaves beyond max_cached_requests
    prop.finish("b", [30, 40, 41, 42])
    assert prop.propose("c", [20, 21], 0, k=3) == []
    assert prop.propose("d", [40], 0, k=2) == [41, 42]
