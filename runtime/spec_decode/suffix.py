"""Suffix decoding proposals (vLLM's ``suffix`` method; Oliaro et al. 2024, "SuffixDecoding").

A :class:`ContinuationTrie` counts, for every context of up to ``max_depth`` tokens seen in a
set of sequences, which tokens followed it (a trie of every window of ``max_depth + 1`` tokens;
a node's count is how often its path occurred). :class:`SuffixProposer` keeps one trie per
running request (its prompt and output, grown as tokens arrive) and one replica-wide trie of
the outputs of the last ``max_cached_requests`` finished requests (agent loops and templated
answers repeat across requests). A proposal matches the longest suffix of the sequence found
in a trie, then follows the most frequent continuation while its share of the node's
continuations stays at or above ``min_token_prob``, re-matching the suffix when the path ends;
the trie with the longer proposal wins.

Memory: about ``max_depth`` nodes per indexed token (shared prefixes merge them).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class ContinuationTrie:
    """Counts of every window of up to ``max_depth + 1`` tokens of the sequences added: the node
    of a path ``P`` counts the occurrences of ``P``, so its children's counts are what followed."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node()
        self.num_nodes = 0

    def extend(self, frontier: list[_Node], tokens: Sequence[int]) -> list[_Node]:
        """Append ``tokens`` to a sequence whose open windows end at ``frontier`` (the nodes of
        the windows that started within its last ``max_depth`` tokens, oldest first; ``[]`` for a
        new sequence). Returns the new frontier. Cost: ``max_depth + 1`` node steps a token."""
        for t in tokens:
            frontier.append(self.root)
            nxt = []
            for node in frontier:
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = _Node()
                    self.num_nodes += 1
                child.count += 1
                nxt.append(child)
            frontier = nxt[len(nxt) - self.max_depth:] if len(nxt) > self.max_depth else nxt
        return frontier

    def add(self, tokens: Sequence[int]) -> None:
        """Index a whole sequence."""
        self.extend([], tokens)

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo :meth:`add` of ``tokens`` (nodes whose count falls to 0 are dropped)."""
        width = self.max_depth + 1
        for start in range(len(tokens)):
            node = self.root
            for t in tokens[start : start + width]:
                child = node.children.get(t)
                if child is None:
                    break
                child.count -= 1
                if child.count <= 0:
                    del node.children[t]
                    self.num_nodes -= len(_subtree(child))
                    break
                node = child

    def _match(self, tokens: Sequence[int]) -> _Node | None:
        """The node of the longest suffix of ``tokens`` (at most ``max_depth``) present, or None."""
        for n in range(min(self.max_depth, len(tokens)), 0, -1):
            node = self.root
            for t in tokens[len(tokens) - n:]:
                node = node.children.get(t)
                if node is None:
                    break
            if node is not None and node.children:
                return node
        return None

    def propose(self, tokens: Sequence[int], k: int, min_prob: float) -> list[int]:
        """Up to ``k`` tokens continuing ``tokens``, each the most frequent continuation of the
        longest matched context, while its share of that context's continuations is ``>= min_prob``."""
        out: list[int] = []
        context = list(tokens[-self.max_depth:])
        node = self._match(context)
        while node is not None and len(out) < k:
            total = sum(c.count for c in node.children.values())
            token, child = max(node.children.items(), key=lambda kv: kv[1].count)
            if total <= 0 or child.count / total < min_prob:
                break
            out.append(token)
            context = (context + [token])[-self.max_depth:]
            node = child if child.children else self._match(context)
        return out


def _subtree(node: _Node) -> list[_Node]:
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children.values())
    return out


class _RequestIndex:
    __slots__ = ("trie", "frontier", "indexed", "num_prompt_tokens")

    def __init__(self, trie: ContinuationTrie, num_prompt_tokens: int) -> None:
        self.trie = trie
        self.frontier: list[_Node] = []
        self.indexed = 0
        self.num_prompt_tokens = num_prompt_tokens


class SuffixProposer:
    """Per-request tries plus a replica-wide trie of recent outputs (see the module docstring)."""

    def __init__(self, max_depth: int, max_cached_requests: int, min_token_prob: float) -> None:
        self.max_depth = max_depth
        self.min_token_prob = min_token_prob
        self.max_cached_requests = max_cached_requests
        self.global_trie = ContinuationTrie(max_depth)
        self._cached: OrderedDict[str, list[int]] = OrderedDict()
        self._requests: dict[str, _RequestIndex] = {}

    def propose(self, req_id: str, tokens: Sequence[int], num_prompt_tokens: int, k: int) -> list[int]:
        """Up to ``k`` proposed next tokens of request ``req_id`` whose prompt + output is ``tokens``."""
        index = self._requests.get(req_id)
        if index is None:
            index = self._requests[req_id] = _RequestIndex(ContinuationTrie(self.max_depth), num_prompt_tokens)
        if index.indexed < len(tokens):
            index.frontier = index.trie.extend(index.frontier, tokens[index.indexed:])
            index.indexed = len(tokens)
        own = index.trie.propose(tokens, k, self.min_token_prob)
        if len(own) >= k or not self._cached:
            return own
        shared = self.global_trie.propose(tokens, k, self.min_token_prob)
        return shared if len(shared) > len(own) else own

    def finish(self, req_id: str, tokens: Sequence[int] | None = None) -> None:
        """Forget request ``req_id``; with its final ``tokens``, its output joins the replica-wide
        trie (the oldest cached output leaves it beyond ``max_cached_requests``)."""
        entry = self._requests.pop(req_id, None)
        if tokens is None or entry is None or self.max_cached_requests == 0:
            return
        output = list(tokens[entry.num_prompt_tokens:])
        if not output:
            return
        self.global_trie.add(output)
        self._cached[req_id] = output
        while len(self._cached) > self.max_cached_requests:
            _, old = self._cached.popitem(last=False)
            self.global_trie.remove(old)
