"""The batched LoRA ops (kvfleet.kernels.lora, triton_lora; issue 17): the torch paths against the
per-token definition; the Triton kernels against it under the interpreter on CPU, compiled on CUDA."""

from __future__ import annotations

import importlib

import pytest
import torch

from kvfleet.kernels.lora import lora_bgmv_torch, lora_stacked_torch, slot_mask

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"


def lora_case(num_tokens=13, num_slots=3, rank=4, d_in=40, d_out=24, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, d_in, generator=g).to(dtype)
    y = torch.randn(num_tokens, d_out, generator=g).to(dtype)
    a = torch.randn(num_slots, rank, d_in, generator=g).to(dtype)
    b = torch.randn(num_slots, rank, d_out, generator=g).to(dtype)
    slots = torch.tensor([(i * 7) % (num_slots + 1) - 1 for i in range(num_tokens)], dtype=torch.long)
    return x, y, a, b, slots


def naive(x, y, a, b, slots):
    out = y.double().clone()
    for t in range(x.shape[0]):
        s = int(slots[t])
        if s >= 0:
            out[t] += (x[t].double() @ a[s].double().T) @ b[s].double()
    return out


def test_torch_lora_paths_match_the_per_token_definition():
    x, y, a, b, slots = lora_case()
    want = naive(x, y, a, b, slots)
    got = lora_bgmv_torch(x, y.clone(), a, b, slots)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    k = int(slots.max()) + 1
    got = lora_stacked_torch(x, y.clone(), a, b, slot_mask(slots, k, a.shape[1], x.dtype))
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    base_only = torch.full_like(slots, -1)
    assert torch.equal(lora_bgmv_torch(x, y.clone(), a, b, base_only), y)


@pytest.fixture(scope="module")
def triton_lora():
    import os

    if not ON_CUDA:
        os.environ["TRITON_INTERPRET"] = "1"  # conftest sets it for the session on CPU machines
    import kvfleet.kernels.triton_lora as mod

    return importlib.reload(mod).lora_bgmv_triton


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-4), (torch.float16, 2e-2)])
@pytest.mark.parametrize("shape", [(13, 3, 4, 40, 24), (5, 2, 8, 70, 130)])
def test_triton_lora_matches_the_oracle(triton_lora, dtype, tol, shape):
    t, slots_n, rank, d_in, d_out = shape
    x, y, a, b, slots = lora_case(t, slots_n, rank, d_in, d_out, dtype)
    want = naive(x, y, a, b, slots)
    got = triton_lora(x.to(DEVICE), y.to(DEVICE).clone(), a.to(DEVICE), b.to(DEVICE), slots.to(DEVICE),
                      block_k=32, block_n=32)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double().cpu(), want, atol=tol * 10, rtol=tol)
