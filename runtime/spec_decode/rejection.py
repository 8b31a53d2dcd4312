"""Verification of proposed tokens against the target model, in one step.

For a sequence with proposed tokens ``d_1 .. d_k`` the target model scores ``k + 1`` positions
at once: row ``j`` (0-based) is the distribution of the token after ``d_1 .. d_j``. Then:

- greedy rows (:func:`accept_greedy`): ``d_{j+1}`` is accepted while it equals the target's
  argmax at row ``j``; the first mismatch emits the target's argmax instead, and when all ``k``
  are accepted the argmax of row ``k`` is a bonus token. The output is exactly the tokens
  greedy decoding without speculation makes.
- sampled rows (:func:`accept_sampled`): the standard speculative sampling rule (Leviathan et
  al. 2023, Chen et al. 2023): accept ``d`` with probability ``min(1, p(d) / q(d))`` where ``p``
  is the target's (processed) distribution and ``q`` the proposer's; on a rejection emit a
  sample of the residual ``max(0, p - q)`` normalised, and stop; all accepted: a bonus sample of
  row ``k``. Every emitted token is distributed as ``p`` exactly. Model-free proposers
  (n-gram, suffix) propose deterministically: ``q`` is one-hot, the acceptance probability is
  ``p(d)`` and the residual is ``p`` without ``d``.

Randomness: position ``i`` of a request's output draws from ``generators[j]``, the caller's
generator for that output position (seeded requests: ``step_seed(seed, i)``), so a seeded
request's text depends only on its own tokens.

The engine's model-free proposers are deterministic, and for them the model runner
(:mod:`kvfleet.runtime.worker.speculator`) applies :func:`accept_greedy` to the rows' own samples
(each drawn as decoding without speculation draws it): :func:`accept_sampled`'s rule with its two
draws coupled, the same distribution, and the same tokens as without speculation.
:func:`accept_sampled` is the rule for a proposer with a distribution of its own (``draft_probs``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def accept_greedy(target_argmax: Sequence[int], draft: Sequence[int]) -> list[int]:
    """Tokens emitted for one greedy sequence: ``1 .. k + 1`` of them (``target_argmax`` has
    ``k + 1`` entries, ``draft`` ``k``)."""
    out: list[int] = []
    for j, d in enumerate(draft):
        t = int(target_argmax[j])
        out.append(t)
        if t != int(d):
            return out
    out.append(int(target_argmax[len(draft)]))
    return out


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from ``probs [V]`` (need not sum to 1) by an exponential race ``argmax(p / E)``,
    ``E ~ Exponential(1)`` (the sampler's rule)."""
    e = torch.empty_like(probs).exponential_(generator=generator)
    return int(torch.argmax(probs / e))


def accept_sampled(
    probs: torch.Tensor,
    draft: Sequence[int],
    generators: Sequence[torch.Generator | None],
    draft_probs: torch.Tensor | None = None,
) -> list[int]:
    """Tokens emitted for one sampled sequence (``1 .. k + 1`` of them).

    Args:
        probs: ``[k + 1, V]`` float32, the target's distributions after every logits processor
            (penalties, temperature, top-k/top-p/min-p), on any device.
        draft: the ``k`` proposed tokens.
        generators: ``k + 1`` generators (or None: torch's default), one per output position.
        draft_probs: ``[k, V]`` the proposer's distributions, or None for a deterministic proposer.
    """
    out: list[int] = []
    for j, d in enumerate(draft):
        d = int(d)
        p = float(probs[j, d])
        q = 1.0 if draft_probs is None else float(draft_probs[j, d])
        u = float(torch.rand((), generator=generators[j]))
        if q > 0 and u < min(1.0, p / q):
            out.append(d)
            continue
        if draft_probs is None:
            residual = probs[j].clone()
            residual[d] = 0.0
        else:
            residual = (probs[j] - draft_probs[j]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p == q: nothing to correct towards
            residual = probs[j]
        out.append(_sample(residual, generators[j]))
        return out
    out.append(_sample(probs[len(draft)], generators[len(draft)]))
    return out
