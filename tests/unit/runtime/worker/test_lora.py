"""LoRA pieces without the model (issue 17): the scheduler's max_loras cap, the prefix-cache
hash chain seeded by the adapter, the batched LoRA ops (torch paths against the per-token
oracle; the Triton kernels under the interpreter on CPU, compiled on CUDA), PEFT config checks
and the serve options."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

from kvfleet.kernels.lora import lora_bgmv_torch, lora_stacked_torch, slot_mask
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.core.request import Request
from kvfleet.runtime.core.sched.scheduler import Scheduler
from kvfleet.runtime.lora_request import LoRALoadError
from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.worker.lora_checkpoint import load_lora_weights

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"


def req(rid: str, lora: int, prompt=None) -> Request:
    return Request(rid, prompt or [1, 2, 3, 4, 5], SamplingParams(max_tokens=4), eos_token_id=0,
                   lora_name=f"l{lora}" if lora else None, lora_int_id=lora)


def test_scheduler_never_runs_more_than_max_loras_adapters():
    config = EngineConfig(enable_lora=True, max_loras=2, block_size=4)
    sched = Scheduler(config, num_blocks=64, max_model_len=64)
    for i, lora in enumerate([1, 2, 3, 0, 1, 3, 0]):
        sched.add_request(req(f"r{i}", lora))
    seen_steps = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        loras = {s.request.lora_int_id for s in out.scheduled} - {0}
        seen_steps.append(loras)
        assert len(loras) <= 2
        assert len({r.lora_int_id for r in sched.running} - {0}) <= 2
        sched.update_from_output(out, {s.request_id: 7 for s in out.scheduled if s.sample})
    # The adapter-3 requests waited (passed over, not dropped) while 1 and 2 ran; base requests did not.
    assert seen_steps[0] == {1, 2} and any(3 in s for s in seen_steps)
    stats = sched.make_stats()
    assert stats.running_lora_adapters == {} and stats.waiting_lora_adapters == {}


def test_scheduler_reports_running_and_waiting_adapters():
    sched = Scheduler(EngineConfig(enable_lora=True, max_loras=1, block_size=4), num_blocks=64, max_model_len=64)
    for i, lora in enumerate([1, 1, 2]):
        sched.add_request(req(f"r{i}", lora))
    sched.schedule()
    stats = sched.make_stats()
    assert stats.running_lora_adapters == {"l1": 2} and stats.waiting_lora_adapters == {"l2": 1}


def test_prefix_cache_hashes_are_seeded_by_the_adapter():
    sched = Scheduler(EngineConfig(enable_lora=True, max_loras=4, block_size=4), num_blocks=64, max_model_len=64)
    kv = sched.kv_cache_manager
    prompt = list(range(1, 14))  # three full blocks
    hashes = {}
    for rid, lora in (("base", 0), ("a", 1), ("b", 2), ("a-again", 1)):
        r = req(rid, lora, prompt)
        kv._update_block_hashes(r, len(prompt))
        hashes[rid] = r.block_hashes
    assert len(hashes["base"]) == 3
    assert hashes["a"] == hashes["a-again"]
    for x, y in (("base", "a"), ("a", "b"), ("base", "b")):
        assert not set(hashes[x]) & set(hashes[y])  # no block of one chain in another


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


def write_adapter(path, cfg: dict, tensors: dict[str, torch.Tensor]):
    from safetensors.torch import save_file

    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def test_peft_checkpoint_scaling_rank_pattern_and_refusals(tmp_path):
    targets = {"model.layers.0.self_attn.q_proj": (6, 6), "model.layers.0.mlp.down_proj": (10, 6)}
    tensors = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 6),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(6, 2),
        "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight": torch.ones(4, 10),
        "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight": torch.ones(6, 4),
    }
    cfg = {"peft_type": "LORA", "r": 2, "lora_alpha": 8, "rank_pattern": {"down_proj": 4},
           "alpha_pattern": {"down_proj": 2}, "target_modules": ["q_proj", "down_proj"]}
    w = load_lora_weights(write_adapter(tmp_path / "ok", cfg, tensors), targets, max_lora_rank=8)
    assert w.rank == 4
    assert w.scalings == {"model.layers.0.self_attn.q_proj": 4.0, "model.layers.0.mlp.down_proj": 0.5}
    assert torch.equal(w.modules["model.layers.0.mlp.down_proj"][1], torch.full((6, 4), 0.5))
    rs = load_lora_weights(write_adapter(tmp_path / "rs", {**cfg, "use_rslora": True}, tensors), targets, 8)
    assert rs.scalings["model.layers.0.self_attn.q_proj"] == pytest.approx(8 / 2**0.5)
    with pytest.raises(LoRALoadError, match="over --max-lora-rank"):
        load_lora_weights(tmp_path / "ok", targets, max_lora_rank=2)
    with pytest.raises(LoRALoadError, match="not a linear layer"):
        load_lora_weights(tmp_path / "ok", {"model.layers.0.self_attn.q_proj": (6, 6)}, 8)
    with pytest.raises(LoRALoadError, match=r"\[r, 5\]"):
        load_lora_weights(tmp_path / "ok", {**targets, "model.layers.0.self_attn.q_proj": (5, 6)}, 8)
    dora = {**tensors, "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": torch.ones(6)}
    with pytest.raises(LoRALoadError, match="DoRA"):
        load_lora_weights(write_adapter(tmp_path / "dora", cfg, dora), targets, 8)
    emb = {**tensors, "base_model.model.model.embed_tokens.lora_embedding_A": torch.ones(2, 6)}
    with pytest.raises(LoRALoadError, match="embedding"):
        load_lora_weights(write_adapter(tmp_path / "emb", cfg, emb), targets, 8)
    with pytest.raises(LoRALoadError, match="no adapter_config.json"):
        load_lora_weights(tmp_path, targets, 8)


def test_serve_options_take_vllm_spellings():
    from kvfleet.runtime.entrypoints.openai.serve_args import parse_serve_args

    args = parse_serve_args(["--enable-lora", "--max-loras", "4", "--max-lora-rank", "8", "--max-cpu-loras", "8",
                             "--lora-modules", "a=/ad/a", "b=/ad/b", "--lora-modules",
                             '{"name": "c", "path": "/ad/c", "base_model_name": "base"}'],
                            environ={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    e = args.engine
    assert (e.enable_lora, e.max_loras, e.max_lora_rank, e.max_cpu_loras) == (True, 4, 8, 8)
    assert [(m.name, m.path, m.base_model_name) for m in e.lora_modules] == [
        ("a", "/ad/a", None), ("b", "/ad/b", None), ("c", "/ad/c", "base")]
    assert args.server.allow_runtime_lora_updating
    env = {"KVFLEET_ENABLE_LORA": "true", "KVFLEET_LORA_MODULES": '[{"name": "x", "path": "/p"}]'}
    assert parse_serve_args([], environ=env).engine.lora_modules[0].name == "x"
    assert not parse_serve_args([], environ={}).server.allow_runtime_lora_updating
    with pytest.raises(SystemExit):
        parse_serve_args(["--enable-lora", "--lora-modules", "no-equals-sign"], environ={})


def test_lora_paths_file_uris_and_bad_hub_uris():
    from kvfleet.runtime.lora_source import resolve_lora_path

    assert resolve_lora_path("/adapters/a") == "/adapters/a"
    assert resolve_lora_path("file:///adapters/a") == "/adapters/a"
    with pytest.raises(LoRALoadError, match="hf://ORG/NAME"):
        resolve_lora_path("hf://no-org-part")
