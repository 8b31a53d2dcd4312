"""LoRA in the torch-free core, without a model (issue 17): the scheduler never runs more than
``max_loras`` adapters and reports the running and waiting ones; the prefix-cache hash chain is
seeded by the adapter."""

from __future__ import annotations

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.core.request import Request
from kvfleet.runtime.core.sched.scheduler import Scheduler
from kvfleet.runtime.sampling_params import SamplingParams


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
