"""The weights that decide the LM head's kernels in the fused CPU decode path
(kvfleet.runtime.worker.cpu_decode's ``_step_weights``, the denominator of
kvfleet.runtime.worker.cpu_plan.matrix_matmul's rule): no model, no engine."""

from __future__ import annotations

import torch

from kvfleet.kernels.cpu_decoder import Layer, Linear, MoeLayer
from kvfleet.runtime.worker import cpu_decode


def test_the_step_weights_that_decide_the_heads_kernels():
    """``_step_weights`` (cpu_plan.matrix_matmul's denominator): every dense matrix, ``top_k`` of
    ``E`` experts' worth of a mixture of experts, and the head."""
    def m(n, k):
        return Linear("fp32", torch.zeros(n, k))

    dense = Layer(None, None, m(96, 64), m(64, 32), m(256, 64), m(64, 128), None, None)
    moe = MoeLayer(m(4, 64), [m(256, 64)] * 4, [m(64, 128)] * 4, top_k=2)
    experts = Layer(None, None, m(96, 64), m(64, 32), None, None, None, None, moe=moe)
    layers = 96 * 64 + 64 * 32
    assert cpu_decode._step_weights([dense], m(1000, 64)) == layers + 256 * 64 + 64 * 128 + 1000 * 64
    assert cpu_decode._step_weights([experts], None) == layers + 2 * (256 * 64 + 64 * 128)
