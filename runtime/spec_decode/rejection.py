"""Verification of proposed tokens against the target model, in one step.

For a sequence with proposed tokens ``d_1 .. d_k`` the target model scores ``k + 1`` positions
at once: row ``j`` (0-based) is the distribution of the token after ``d_1 .. d_j``.
:func:`accept_greedy` takes one token per row -- the row's argmax for a greedy request, or for a
sampled one the row's own sample, drawn as decoding without speculation draws it -- and accepts
``d_{j+1}`` while it equals row ``j``'s token; the first mismatch emits the row's token instead,
and when all ``k`` are accepted row ``k``'s token is a bonus. For greedy rows the output is
exactly greedy decoding's. For sampled rows and a deterministic (model-free) proposer this is the
speculative sampling rule (Leviathan et al. 2023, Chen et al. 2023) with its two draws coupled:
with a one-hot proposal ``q``, the rule accepts ``d`` with probability ``p(d)`` and otherwise emits a
sample of ``p`` without ``d``, renormalised; drawing ``t ~ p`` and accepting ``d`` iff ``t = d``
accepts with the same probability and emits ``t`` (distributed as ``p`` given ``t != d``), so
every emitted token is distributed as ``p`` -- and it is the very token decoding without
speculation draws from the same generator. A proposer with a distribution of its own (a draft
model) would need the general rule; kvfleet has none (docs/engine.md, "Speculative decoding").
The model runner's :mod:`kvfleet.runtime.worker.speculator` draws the rows' tokens.
"""

from __future__ import annotations

from collections.abc import Sequence


def accept_greedy(target_argmax: Sequence[int], draft: Sequence[int]) -> list[int]:
    """Tokens emitted for one sequence: ``1 .. k + 1`` of them. ``target_argmax``: the ``k + 1``
    rows' tokens (argmax, or each row's own sample; see the module docstring); ``draft``: the ``k``
    proposed tokens."""
    out: list[int] = []
    for j, d in enumerate(draft):
        t = int(target_argmax[j])
        out.append(t)
        if t != int(d):
            return out
    out.append(int(target_argmax[len(draft)]))
    return out
