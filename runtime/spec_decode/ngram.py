"""Prompt lookup (n-gram) proposals: vLLM's ``ngram`` method, llama.cpp's lookup decoding.

:func:`propose` finds the longest n-gram (``max_n`` down to ``min_n`` tokens) that ends the
sequence and also occurs earlier in it, and proposes the (up to) ``k`` tokens that followed its
latest earlier occurrence. Input-grounded text (summaries, code edits, RAG answers, JSON that
repeats keys) copies spans of its context, so the guess is often right and costs microseconds.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose(tokens: Sequence[int] | np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` proposed next tokens of ``tokens`` (prompt + output so far); ``[]`` when no
    n-gram of ``min_n`` or more tokens ending the sequence occurred before.

    Among earlier occurrences the longest match wins (up to ``max_n``), then the latest one.
    Cost: one comparison per earlier occurrence of the last token and matched length."""
    arr = np.asarray(tokens, dtype=np.int64)
    n_tokens = arr.shape[0]
    if k < 1 or n_tokens < min_n + 1:
        return []
    # Candidate ends: earlier positions holding the last token (the sequence's own end excluded).
    ends = np.flatnonzero(arr[: n_tokens - 1] == arr[-1])
    if ends.size == 0:
        return []
    length = np.ones(ends.shape[0], dtype=np.int64)
    alive = np.ones(ends.shape[0], dtype=bool)
    for j in range(1, max_n):
        idx = ends - j
        ok = alive & (idx >= 0)
        ok[ok] = arr[idx[ok]] == arr[n_tokens - 1 - j]
        if not ok.any():
            break
        length[ok] += 1
        alive = ok
    best = length.max()
    if best < min_n:
        return []
    end = int(ends[np.flatnonzero(length == best)[-1]])
    return arr[end + 1 : end + 1 + k].tolist()
