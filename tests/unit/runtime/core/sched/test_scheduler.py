"""Scheduler, KV cache manager and block pool, without a model.

A fake runner stands in for the forward pass: it "writes" each scheduled token id into
the slot the block table gives, and then checks that every position a request attends
to holds that request's token -- which is what correct paging, sharing and prefix caching
mean. Hypothesis drives random workloads (arrivals, shared prefixes, aborts, memory
pressure) and the block-accounting invariants are checked after every step.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.core.request import Request, RequestStatus
from kvfleet.runtime.core.sched.scheduler import Scheduler
from kvfleet.runtime.sampling_params import SamplingParams

EOS = 0


def make_scheduler(num_blocks=64, block_size=4, max_model_len=64, watermark=0.01, sliding_window=None,
                   **kw) -> Scheduler:
    defaults = dict(block_size=block_size, max_num_seqs=8, max_num_batched_tokens=32)
    defaults.update(kw)
    return Scheduler(EngineConfig(**defaults), num_blocks=num_blocks, max_model_len=max_model_len, watermark=watermark,
                     sliding_window=sliding_window)


def make_request(rid, prompt, max_tokens=8, **kw) -> Request:
    params = SamplingParams(max_tokens=max_tokens, **{k: v for k, v in kw.items() if k in ("ignore_eos", "min_tokens", "stop_token_ids", "prompt_logprobs")})
    return Request(rid, prompt, params, eos_token_id=EOS, **{k: v for k, v in kw.items() if k in ("priority", "tenant", "arrival_time")})


def next_token(request: Request) -> int:
    """Deterministic stand-in for the sampler; EOS now and then."""
    h = hash((request.request_id, request.num_output_tokens)) % 97
    return EOS if h == 0 else 1 + h


class FakeRunner:
    """Plays the model runner's part in the paging contract."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler
        self.bs = scheduler.block_size
        self.slots: dict[int, int] = {}  # slot -> token id "stored" there
        self.hash_tokens: dict[bytes, tuple[int, ...]] = {}
        self.outputs = []
        self.just_admitted = False

    def step(self):
        waiting = {q.request_id: q.priority for q in self.s.waiting}
        # Siblings of an n > 1 request still tied to their leader, with the leader's state
        # before this step is planned.
        tied = {q.request_id: (q.prompt_leader, q.prompt_leader.status, q.prompt_leader.num_computed_tokens)
                for q in self.s.waiting if q.prompt_leader is not None}
        out = self.s.schedule()
        this_step = {sr.request_id: sr for sr in out.scheduled}
        for sr in out.scheduled:
            if sr.request_id in tied:
                # With prefix caching, a sibling starts only once its leader's prompt was
                # computed, or is completed in this very step (or the leader finished).
                leader, status, computed = tied[sr.request_id]
                lsr = this_step.get(leader.request_id)
                assert (not self.s.kv_cache_manager.enable_caching or status.finished or leader.is_finished
                        or computed >= leader.num_prompt_tokens
                        or (lsr is not None and lsr.seq_len >= leader.num_prompt_tokens)), (
                    f"{sr.request_id} admitted before its leader computed the prompt")
        if self.just_admitted:
            # The admission rule: what the previous step admitted left room for the
            # running requests' next tokens, so no request runs out of blocks now. Only a
            # waiting request of higher priority may preempt (priority policy).
            top = min(waiting.values(), default=None)
            for rid in out.preempted_request_ids:
                assert self.s.policy == "priority" and top is not None and self.s.requests[rid].priority > top, (
                    f"{rid} preempted in the step after an admission"
                )
        self.just_admitted = any(sr.request_id in waiting for sr in out.scheduled)
        for sr in out.scheduled:
            for j, tok in enumerate(sr.token_ids):
                pos = sr.start_pos + j
                self.slots[sr.block_ids[pos // self.bs] * self.bs + pos % self.bs] = tok
        kv = self.s.kv_cache_manager
        window = kv.sliding_window
        null_id = kv.null_block.block_id if kv.null_block is not None else None
        for sr in out.scheduled:  # attention reads after every write of the step
            tokens = sr.request.all_token_ids
            assert len(sr.block_ids) * self.bs >= sr.seq_len
            # Keys the step's queries see: all, or with a window W those of the first
            # query's window on (p - W < k <= p for the query at p = start_pos).
            first = 0 if window is None else max(0, sr.start_pos + 1 - window)
            for pos in range(first, sr.seq_len):
                block_id = sr.block_ids[pos // self.bs]
                assert block_id != null_id, f"{sr.request_id} position {pos} is in its window but nulled"
                assert self.slots.get(block_id * self.bs + pos % self.bs) == tokens[pos], (
                    f"{sr.request_id} position {pos} reads another token"
                )
            if window is not None:
                # Nothing before the window is kept beyond the block of its first key.
                assert all(b == null_id for b in sr.block_ids[:first // self.bs])
                live = sum(b != null_id for b in sr.block_ids)
                assert live <= kv.max_num_blocks_per_request(sr.seq_len, sr.num_new_tokens)
        sampled = {sr.request_id: next_token(sr.request) for sr in out.scheduled if sr.sample}
        self.s.update_from_output(out, sampled)
        self.outputs.append(out)
        self.check_invariants()
        return out

    def check_invariants(self):
        kv = self.s.kv_cache_manager
        pool = kv.block_pool
        null = pool.null_block
        owners = Counter()
        for rid, blocks in kv.req_to_blocks.items():
            ids = [b.block_id for b in blocks if b is not null]
            assert len(ids) == len(set(ids)), f"{rid} holds a block twice"
            owners.update(ids)
            # Null entries only before the live ones (a prefix of the table).
            live = [b is not null for b in blocks]
            assert live == sorted(live), f"{rid} has a null block after a live one"
        free_ids = {b.block_id for b in pool.free_queue}
        assert len(free_ids) == pool.num_free_blocks
        if null is not None:
            assert null.block_id == pool.num_blocks - 1
            assert null.ref_cnt == 0 and null.block_hash is None and null.block_id not in free_ids
            assert all(null.block_id * self.bs + k not in self.slots for k in range(self.bs)), "null block written"
        for block in pool.blocks:
            if block is null:
                continue
            assert block.ref_cnt >= 0
            assert block.ref_cnt == owners[block.block_id], f"{block} owners={owners[block.block_id]}"
            assert (block.ref_cnt == 0) == (block.block_id in free_ids)
        # Every request's hashes describe its tokens; every cached hash's block holds them.
        for request in self.s.requests.values():
            for i, h in enumerate(request.block_hashes):
                self.hash_tokens[h] = tuple(request.token_ids_slice(i * self.bs, (i + 1) * self.bs))
        for h, block in pool.cached_blocks.items():
            assert block.block_hash == h
            if h in self.hash_tokens:
                stored = tuple(self.slots.get(block.block_id * self.bs + k) for k in range(self.bs))
                assert stored == self.hash_tokens[h], "a cached hash maps to a block with other contents"

    def run_until_done(self, max_steps=10_000):
        for _ in range(max_steps):
            if not self.s.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("requests never finished")


def assert_all_free(s: Scheduler):
    pool = s.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert not s.kv_cache_manager.req_to_blocks


# -- continuous batching basics -----------------------------------------------------------
def test_prefill_and_decode_share_a_step_and_finished_place_is_taken():
    s = make_scheduler(max_num_seqs=2)
    r = FakeRunner(s)
    s.add_request(make_request("a", [5] * 10, max_tokens=2, ignore_eos=True))
    r.step()  # a prefills
    s.add_request(make_request("b", [6] * 7, max_tokens=3, ignore_eos=True))
    s.add_request(make_request("c", [7] * 3, max_tokens=1, ignore_eos=True))
    out = r.step()  # a decodes, b prefills in the same pass; c waits (max_num_seqs=2)
    assert [(x.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 7)]
    assert out.num_decode_tokens == 1 and out.num_prefill_tokens == 7
    assert "a" not in s.requests  # max_tokens=2 reached: finished, blocks freed at once
    out = r.step()
    assert [x.request_id for x in out.scheduled] == ["b", "c"]  # c takes a's place next step
    assert "a" in out.finished_request_ids
    r.run_until_done()
    assert_all_free(s)


def test_chunked_prefill_splits_a_long_prompt_over_steps():
    s = make_scheduler(max_num_batched_tokens=8, max_model_len=64)
    r = FakeRunner(s)
    s.add_request(make_request("long", list(range(1, 21)), max_tokens=2, ignore_eos=True))
    chunks = []
    while "long" in s.requests:
        out = r.step()
        chunks.append((out.scheduled[0].num_new_tokens, out.scheduled[0].sample))
    assert chunks == [(8, False), (8, False), (4, True), (1, True)]
    assert_all_free(s)


def test_preemption_by_recompute_latest_arrival_first_and_resumes():
    # 7 blocks: both 8-token prompts are admitted (2 blocks each, next-token reserve and the
    # 1-block watermark still free), but 18 tokens each (5 blocks) do not fit together.
    s = make_scheduler(num_blocks=7, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    r = FakeRunner(s)
    s.add_request(make_request("early", [3] * 8, max_tokens=10, ignore_eos=True, arrival_time=1.0))
    s.add_request(make_request("late", [4] * 8, max_tokens=10, ignore_eos=True, arrival_time=2.0))
    preempted = []
    for _ in range(200):
        if not s.has_unfinished_requests():
            break
        preempted += r.step().preempted_request_ids
    assert preempted and set(preempted) == {"late"}
    assert s.requests == {}
    assert_all_free(s)


def test_priority_victim_is_the_lowest_priority():
    s = make_scheduler(num_blocks=7, block_size=4, max_num_batched_tokens=64, scheduling_policy="priority")
    r = FakeRunner(s)
    s.add_request(make_request("low", [3] * 8, max_tokens=10, ignore_eos=True, priority=5, arrival_time=1.0))
    s.add_request(make_request("high", [4] * 8, max_tokens=10, ignore_eos=True, priority=0, arrival_time=2.0))
    preempted = []
    while s.has_unfinished_requests():
        preempted += r.step().preempted_request_ids
    assert preempted and set(preempted) == {"low"}


def test_requests_that_can_never_fit_are_rejected():
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len"):
        s.add_request(make_request("x", [1] * 33))
    with pytest.raises(ValueError, match="whole KV cache"):
        s.add_request(make_request("y", [1] * 17))
    s.add_request(make_request("ok", [1] * 16, max_tokens=1))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(make_request("ok", [1] * 4))


def test_abort_frees_blocks_waiting_or_running():
    s = make_scheduler(max_num_seqs=1)
    r = FakeRunner(s)
    s.add_request(make_request("run", [1] * 9, max_tokens=50, ignore_eos=True))
    s.add_request(make_request("wait", [2] * 9, max_tokens=50, ignore_eos=True))
    r.step()
    assert s.num_running == 1 and s.num_waiting == 1
    s.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert_all_free(s)
    assert s.schedule().is_empty


def test_stop_conditions_eos_stop_ids_min_tokens_length():
    s = make_scheduler()
    s.add_request(make_request("eos", [1, 2], max_tokens=10))
    s.add_request(make_request("minimum", [1, 2], max_tokens=10, min_tokens=2))
    s.add_request(make_request("stopid", [1, 2], max_tokens=10, stop_token_ids=[42]))
    s.add_request(make_request("ignore", [1, 2], max_tokens=2, ignore_eos=True))
    out = s.schedule()
    s.update_from_output(out, {"eos": EOS, "minimum": EOS, "stopid": 42, "ignore": EOS})
    reqs = {r.request_id: r for r in (x.request for x in out.scheduled)}
    assert reqs["eos"].status == RequestStatus.FINISHED_STOPPED
    assert reqs["minimum"].status == RequestStatus.RUNNING  # EOS ignored before min_tokens
    assert reqs["stopid"].status == RequestStatus.FINISHED_STOPPED and reqs["stopid"].stop_reason == 42
    assert reqs["ignore"].status == RequestStatus.RUNNING
    out = s.schedule()
    s.update_from_output(out, {"minimum": 9, "ignore": EOS})
    assert reqs["minimum"].status == RequestStatus.RUNNING
    assert reqs["ignore"].status == RequestStatus.FINISHED_LENGTH


# -- prefix caching -------------------------------------------------------------------------
def test_second_request_with_shared_prefix_prefills_fewer_tokens():
    s = make_scheduler(block_size=4, max_num_batched_tokens=64)
    r = FakeRunner(s)
    system = list(range(100, 120))  # 20 tokens = 5 full blocks
    s.add_request(make_request("first", system + [1, 2, 3], max_tokens=1))
    first = r.step().scheduled[0]
    r.run_until_done()
    s.add_request(make_request("second", system + [7, 8], max_tokens=1))
    second = r.step().scheduled[0]
    assert first.num_new_tokens == 23 and first.start_pos == 0
    assert second.start_pos == 20 and second.num_new_tokens == 2
    stats = s.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (23 + 22, 20)
    assert s.make_stats().prefix_cache_queries == 0  # deltas
    r.run_until_done()
    assert_all_free(s)


def test_fully_cached_prompt_recomputes_its_last_token():
    s = make_scheduler(block_size=4)
    r = FakeRunner(s)
    prompt = list(range(1, 17))  # exactly 4 blocks
    s.add_request(make_request("a", prompt, max_tokens=1))
    r.run_until_done()
    s.add_request(make_request("b", prompt, max_tokens=1))
    sr = r.step().scheduled[0]
    assert (sr.start_pos, sr.num_new_tokens, sr.sample) == (12, 4, True)  # last block recomputed
    s.add_request(make_request("c", prompt + [99], max_tokens=1))
    sr = r.step().scheduled[0]
    assert (sr.start_pos, sr.num_new_tokens) == (16, 1)


def test_prompt_logprobs_requests_skip_the_cache():
    s = make_scheduler(block_size=4)
    r = FakeRunner(s)
    s.add_request(make_request("a", list(range(1, 13)), max_tokens=1))
    r.run_until_done()
    s.add_request(make_request("b", list(range(1, 13)), max_tokens=1, prompt_logprobs=1))
    assert r.step().scheduled[0].start_pos == 0


def test_prompt_logprobs_request_still_inserts_its_blocks():
    # vLLM v1 skips only the lookup: the prompt-logprobs request's full blocks (hashed as any
    # other request's: same tokens, no extra key) serve the next request with that prefix.
    s = make_scheduler(block_size=4)
    r = FakeRunner(s)
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks
    s.add_request(make_request("a", prompt, max_tokens=1, prompt_logprobs=1))
    assert r.step().scheduled[0].start_pos == 0
    r.run_until_done()
    s.add_request(make_request("b", prompt, max_tokens=1))
    sr = r.step().scheduled[0]
    assert (sr.start_pos, sr.num_new_tokens) == (12, 1)
    plain = make_request("c", prompt, max_tokens=1)
    s.kv_cache_manager._update_block_hashes(plain, len(prompt))
    assert plain.block_hashes == sr.request.block_hashes[:3]
    r.run_until_done()
    assert_all_free(s)


def fan_out(rid, prompt, n, **kw) -> list[Request]:
    """n sequences of one prompt, linked as LLMEngine links an n > 1 request's sequences."""
    seqs = [make_request(f"{rid}-{i}", prompt, **kw) for i in range(n)]
    for seq in seqs[1:]:
        seq.prompt_leader = seqs[0]
    return seqs


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
def test_siblings_wait_for_the_leaders_prompt_then_hit_every_full_block(policy):
    s = make_scheduler(block_size=4, max_num_batched_tokens=8, scheduling_policy=policy)
    r = FakeRunner(s)
    prompt = list(range(1, 23))  # 22 tokens: 5 full blocks, prefilled in chunks of 8
    for seq in fan_out("p", prompt, 4, max_tokens=3, ignore_eos=True, arrival_time=0.0):
        s.add_request(seq)
    s.add_request(make_request("later", [90, 91], max_tokens=6, ignore_eos=True, arrival_time=1.0))
    ran = [[(sr.request_id, sr.start_pos, sr.num_new_tokens) for sr in r.step().scheduled] for _ in range(4)]
    # The leader's prompt in chunks; the siblings are released in the step that schedules
    # its last chunk (its full blocks are hashed then, and written by that step's forward
    # pass before attention reads them), and take those 5 blocks from the cache.
    assert ran[0] == [("p-0", 0, 8)]
    assert ran[1] == [("p-0", 8, 8)]
    assert ran[2] == [("p-0", 16, 6), ("p-1", 20, 2)]
    # Released siblings keep their place: ahead of the later request.
    assert ran[3] == [("p-0", 22, 1), ("p-1", 22, 1), ("p-2", 20, 2), ("p-3", 20, 2), ("later", 0, 2)]
    stats = s.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (22 * 4 + 2, 20 * 3)
    r.run_until_done()
    assert_all_free(s)


def _three_siblings_after_the_leaders_first_chunk():
    """A 22-token prompt fanned out to 3 sequences, after one step: the leader computed 8 of
    its prompt tokens (2 full blocks, hashed), the siblings wait."""
    s = make_scheduler(block_size=4, max_num_batched_tokens=8)
    r = FakeRunner(s)
    seqs = fan_out("p", list(range(1, 23)), 3, max_tokens=2, ignore_eos=True)
    for seq in seqs:
        s.add_request(seq)
    assert [sr.request_id for sr in r.step().scheduled] == ["p-0"]
    assert seqs[0].num_computed_tokens == 8
    return s, r, seqs


def test_leader_preempted_mid_prompt_is_waited_for_and_all_finish():
    s, r, seqs = _three_siblings_after_the_leaders_first_chunk()
    s._preempt(seqs[0])  # as the scheduler preempts a victim by recompute
    assert [q.request_id for q in s.waiting] == ["p-0", "p-1", "p-2"]
    out = r.step()
    # It resumes from its own cached blocks; the siblings still wait.
    assert [(sr.request_id, sr.start_pos) for sr in out.scheduled] == [("p-0", 8)]
    r.run_until_done()
    assert all(q.num_output_tokens == 2 for q in seqs)
    assert_all_free(s)


def test_aborted_leader_releases_its_siblings():
    s, r, seqs = _three_siblings_after_the_leaders_first_chunk()
    s.finish_requests("p-0", RequestStatus.FINISHED_ABORTED)
    out = r.step()
    assert [(sr.request_id, sr.start_pos) for sr in out.scheduled] == [("p-1", 8)]  # the 2 blocks written
    r.run_until_done()
    assert all(q.num_output_tokens == 2 for q in seqs[1:])
    assert_all_free(s)


def test_without_prefix_caching_siblings_start_at_once():
    s = make_scheduler(block_size=4, max_num_batched_tokens=64, enable_prefix_caching=False)
    r = FakeRunner(s)
    for seq in fan_out("p", list(range(1, 11)), 3, max_tokens=2, ignore_eos=True):
        s.add_request(seq)
    out = r.step()
    assert [(sr.request_id, sr.start_pos, sr.num_new_tokens) for sr in out.scheduled] == [
        ("p-0", 0, 10), ("p-1", 0, 10), ("p-2", 0, 10)]
    r.run_until_done()
    assert_all_free(s)


def test_lru_eviction_and_unhashed_blocks_reused_first():
    s = make_scheduler(num_blocks=8, block_size=4)
    r = FakeRunner(s)
    s.add_request(make_request("old", [1] * 8 + [2], max_tokens=1))
    r.run_until_done()
    s.add_request(make_request("new", [3] * 8 + [4], max_tokens=1))
    r.run_until_done()
    pool = s.kv_cache_manager.block_pool
    assert len(pool.cached_blocks) == 4
    # 8 blocks: 4 cached + 4 unhashed free. Taking 4 uses the unhashed ones, evicting nothing.
    s.add_request(make_request("x", [9] * 15, max_tokens=1))
    r.step()
    assert len(pool.cached_blocks) == 4 + 3
    r.run_until_done()
    # Now a request that needs every block evicts least recently used first: "old"'s.
    s.add_request(make_request("y", [8] * 4 + [7], max_tokens=1))
    r.step()
    assert s.kv_cache_manager.get_computed_blocks(make_request("probe", [3] * 8 + [4]))[1] == 8
    assert s.kv_cache_manager.get_computed_blocks(make_request("probe2", [1] * 8 + [2]))[1] < 8


def test_reset_prefix_cache_drops_only_unreferenced_blocks():
    s = make_scheduler(block_size=4)
    r = FakeRunner(s)
    s.add_request(make_request("done", [1] * 8 + [2], max_tokens=1))
    r.run_until_done()
    s.add_request(make_request("live", [5] * 8 + [6], max_tokens=50, ignore_eos=True))
    r.step()
    assert s.reset_prefix_cache()
    pool = s.kv_cache_manager.block_pool
    assert all(b.ref_cnt > 0 for b in pool.cached_blocks.values())
    assert len(pool.cached_blocks) == 2
    r.check_invariants()


def test_identical_prompts_under_memory_pressure_share_then_preempt():
    s = make_scheduler(num_blocks=9, block_size=4, max_num_batched_tokens=64)
    r = FakeRunner(s)
    prompt = list(range(1, 18))  # 17 tokens: 4 full blocks + 1
    s.add_request(make_request("a", prompt, max_tokens=12, ignore_eos=True, arrival_time=1.0))
    s.add_request(make_request("b", prompt, max_tokens=12, ignore_eos=True, arrival_time=2.0))
    first = r.step()
    assert [x.start_pos for x in first.scheduled] == [0, 16]  # b hits a's blocks in the same step
    preempted = []
    while s.has_unfinished_requests():
        preempted += r.step().preempted_request_ids
    assert "b" in preempted
    assert_all_free(s)


# -- policies -------------------------------------------------------------------------------
def test_fair_policy_round_robins_tenants():
    s = make_scheduler(num_blocks=512, max_num_seqs=2, max_num_batched_tokens=64, scheduling_policy="fair")
    r = FakeRunner(s)
    for i in range(200):
        s.add_request(make_request(f"A{i}", [1, 2, 3], max_tokens=4, ignore_eos=True, tenant="A"))
    r.step()
    s.add_request(make_request("B0", [4, 5, 6], max_tokens=4, ignore_eos=True, tenant="B"))
    finished_order = []
    while "B0" not in finished_order:
        out = r.step()
        finished_order += sorted(out.finished_request_ids)
    a_finished = [x for x in finished_order if x.startswith("A")]
    assert len(a_finished) < 20


def test_priority_request_scheduled_in_the_next_step_behind_50():
    s = make_scheduler(num_blocks=512, max_num_seqs=8, max_num_batched_tokens=64, scheduling_policy="priority")
    r = FakeRunner(s)
    for i in range(50):
        s.add_request(make_request(f"p10-{i}", [1, 2, 3], max_tokens=100, ignore_eos=True, priority=10))
    r.step()
    r.step()
    assert s.num_running == 8
    s.add_request(make_request("urgent", [9, 9], max_tokens=4, ignore_eos=True, priority=0))
    out = r.step()
    assert "urgent" in [x.request_id for x in out.scheduled]
    assert out.preempted_request_ids  # a priority-10 request made room


# -- admission: no admit/preempt thrash ------------------------------------------------------
def run_counting(s: Scheduler, r: FakeRunner, max_steps=2_000):
    """Run to the end; returns (preempted ids in order, per-request prefill tokens scheduled)."""
    preempted, prefill = [], Counter()
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return preempted, prefill
        out = r.step()
        preempted += out.preempted_request_ids
        for sr in out.scheduled:
            prefill[sr.request_id] += max(0, min(sr.seq_len, sr.request.num_prompt_tokens) - sr.start_pos)
    raise AssertionError("requests never finished")


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
def test_low_priority_request_is_not_admitted_only_to_be_preempted(policy):
    # The workload of tests/test_prompt_logprobs.py's preemption test, without the model:
    # 12 blocks of 16 tokens; A (121-token prompt, 60 out) needs all 12 blocks by its end,
    # B (60-token prompt, 8 out, priority 1: the victim) does not fit beside it. Before the
    # admission rule, B was admitted whenever 2 blocks were free (a 31-token chunk beside
    # A's decode token) and preempted in the next step, 17 times (1 after its prompt, 16
    # in its prefill), recomputing 60 + 16 * 31 prompt tokens. Now it waits for A's blocks.
    s = make_scheduler(num_blocks=12, block_size=16, max_model_len=192, max_num_batched_tokens=32,
                       enable_prefix_caching=False, scheduling_policy=policy)
    r = FakeRunner(s)
    s.add_request(make_request("A", list(range(1, 122)), max_tokens=60, ignore_eos=True, arrival_time=1.0))
    s.add_request(make_request("B", list(range(300, 360)), max_tokens=8, ignore_eos=True, priority=1, arrival_time=2.0))
    preempted, prefill = run_counting(s, r)
    assert len(preempted) <= 1, preempted
    assert prefill["B"] <= 2 * 60  # at most one recompute of its prompt
    assert prefill["A"] == 121
    assert_all_free(s)


def test_admission_reserves_the_running_requests_next_block():
    # Three running requests reach a block boundary together; a newcomer whose prompt fits
    # the free blocks, but not beside their next blocks, waits instead of being preempted.
    s = make_scheduler(num_blocks=12, block_size=4, max_model_len=48, max_num_batched_tokens=64, watermark=0)
    r = FakeRunner(s)
    for i in range(3):
        s.add_request(make_request(f"run{i}", [10 + i] * 7, max_tokens=20, ignore_eos=True, arrival_time=i))
    r.step()  # 7 prompt tokens each (2 blocks); each samples its 8th token
    assert s.kv_cache_manager.num_free_blocks == 6
    s.add_request(make_request("new", [9] * 11, max_tokens=20, ignore_eos=True, arrival_time=9.0))
    s.add_request(make_request("late", [8] * 3, max_tokens=20, ignore_eos=True, arrival_time=10.0))
    # This step they compute token 8 (still in block 2); the next one they need block 3
    # each. "new" (11 tokens and its next one: 3 blocks) fits beside those 3 blocks; "late"
    # (1 block) would have been admitted into them and preempted at once.
    out = r.step()
    assert [x.request_id for x in out.scheduled] == ["run0", "run1", "run2", "new"]
    assert s.kv_cache_manager.num_free_blocks == 3 and s.num_waiting == 1
    out = r.step()
    assert out.preempted_request_ids == [] and s.kv_cache_manager.num_free_blocks == 0
    run_counting(s, r)  # later growth (beyond the next step) may preempt: not foreseeable
    assert_all_free(s)


def test_a_request_that_fills_the_whole_cache_is_admitted_alone():
    # No deadlock with the watermark: a 2-block cache, prompts of exactly 2 blocks (the
    # watermark could never be kept beside them), queued behind each other.
    for watermark in (0.01, 0.5):
        s = make_scheduler(num_blocks=2, block_size=4, max_model_len=8, max_num_batched_tokens=8, watermark=watermark)
        assert s.watermark_blocks == 1
        r = FakeRunner(s)
        s.add_request(make_request("full", list(range(1, 9)), max_tokens=5, ignore_eos=True))
        s.add_request(make_request("grows", [5] * 5, max_tokens=3, ignore_eos=True))
        s.add_request(make_request("one", [6], max_tokens=7, ignore_eos=True))
        preempted, _ = run_counting(s, r)
        assert preempted == []
        assert s.requests == {}
        assert_all_free(s)
    s = make_scheduler(num_blocks=1, block_size=4, max_model_len=4)
    r = FakeRunner(s)
    for i in range(3):
        s.add_request(make_request(f"r{i}", [i + 1] * 3, max_tokens=4, ignore_eos=True))
    assert run_counting(s, r)[0] == []


def test_watermark_blocks_follow_vllm_and_bad_values_are_refused():
    assert make_scheduler(num_blocks=64).watermark_blocks == 1  # int(0.64) -> at least 1
    assert make_scheduler(num_blocks=1000).watermark_blocks == 10  # vLLM: int(0.01 * 1000)
    assert make_scheduler(num_blocks=1000, watermark=0).watermark_blocks == 0
    for bad in (-0.1, 1, 1.5):
        with pytest.raises(ValueError, match="watermark"):
            make_scheduler(watermark=bad)


def test_watermark_is_kept_free_when_admitting_beside_running_requests():
    # 100 blocks -> watermark 1 block. A running request holds 50 and needs no new block
    # next step; a newcomer needing all 50 free blocks (its prompt and next token) would
    # leave none spare: it waits; one needing 49 is admitted.
    for size, admitted in ((50 * 4 - 1, False), (49 * 4 - 1, True)):
        s = make_scheduler(num_blocks=100, block_size=4, max_model_len=400, max_num_batched_tokens=512)
        r = FakeRunner(s)
        s.add_request(make_request("run", [1] * 198, max_tokens=50, ignore_eos=True))
        r.step()  # 198 tokens + the sampled one: 50 blocks, the next token (200th) fits in them
        s.add_request(make_request("new", [2] * size, max_tokens=1))
        out = r.step()
        assert ("new" in [x.request_id for x in out.scheduled]) is admitted


def test_high_priority_arrival_still_preempts_for_memory():
    s = make_scheduler(num_blocks=16, block_size=4, max_model_len=64, max_num_batched_tokens=64,
                       scheduling_policy="priority")
    r = FakeRunner(s)
    for i in range(3):
        s.add_request(make_request(f"low{i}", [i + 1] * 16, max_tokens=30, ignore_eos=True, priority=5, arrival_time=i))
    r.step()
    r.step()
    assert s.num_running == 3
    s.add_request(make_request("urgent", [9] * 12, max_tokens=4, ignore_eos=True, priority=0, arrival_time=9.0))
    out = r.step()
    assert "urgent" in [x.request_id for x in out.scheduled]
    assert out.preempted_request_ids and all(rid.startswith("low") for rid in out.preempted_request_ids)
    preempted, _ = run_counting(s, r)
    assert "urgent" not in preempted
    assert_all_free(s)


# -- properties ---------------------------------------------------------------------------
PREFIXES = [[], list(range(1, 9)), list(range(50, 63)), [7] * 5]

op = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 14), st.integers(1, 12), st.integers(0, 3),
              st.integers(1, 3), st.booleans()),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 40)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(op, min_size=1, max_size=60),
    num_blocks=st.integers(8, 40),
    block_size=st.sampled_from([2, 4, 8]),
    budget=st.sampled_from([8, 16, 64]),
    caching=st.booleans(),
    policy=st.sampled_from(["fcfs", "priority", "fair"]),
    window=st.sampled_from([None, None, 1, 3, 8]),
)
def test_random_workloads_never_leak_or_double_free(ops, num_blocks, block_size, budget, caching, policy, window):
    usable = num_blocks - (window is not None)
    s = make_scheduler(
        num_blocks=num_blocks, block_size=block_size, max_model_len=usable * block_size,
        max_num_seqs=4, max_num_batched_tokens=budget, enable_prefix_caching=caching, scheduling_policy=policy,
        sliding_window=window,
    )
    r = FakeRunner(s)
    added = []
    for o in ops:
        if o[0] == "add":
            # n sequences of one prompt, as LLMEngine fans out an n > 1 request: the later
            # ones name the first as their prompt_leader; the first may ask for prompt logprobs.
            _, prefix, suffix_len, max_tokens, prio, n, plp = o
            prompt = PREFIXES[prefix] + [200 + (len(added) * 7 + k) % 13 for k in range(suffix_len)]
            rid = f"r{len(added)}"
            group = []
            for i in range(n):
                req = make_request(f"{rid}-{i}", prompt, max_tokens=max_tokens, priority=prio, tenant=f"t{prio % 2}",
                                   prompt_logprobs=1 if plp and i == 0 else None, arrival_time=float(len(added)))
                req.prompt_leader = group[0] if group else None
                group.append(req)
            try:
                for req in group:
                    s.add_request(req)
            except ValueError:
                assert len(prompt) > s.max_model_len or -(-len(prompt) // block_size) > usable
                continue
            added.extend(req.request_id for req in group)
        elif o[0] == "step":
            r.step()
        elif added:
            s.finish_requests([added[o[1] % len(added)]], RequestStatus.FINISHED_ABORTED)
            r.check_invariants()
    r.run_until_done()
    assert_all_free(s)
    for rid in added:
        assert rid not in s.requests


# -- sliding window: blocks behind the window go back to the pool --------------------------
def test_sliding_window_frees_blocks_behind_the_window_each_step():
    # block_size 4, window 6, 8 tokens a step: after a step with num_computed_tokens = c,
    # blocks whose positions are all < c + 1 - 6 are free and nulled in the table.
    s = make_scheduler(num_blocks=16, block_size=4, sliding_window=6, max_num_batched_tokens=8, max_model_len=64)
    kv = s.kv_cache_manager
    null_id = kv.null_block.block_id
    assert null_id == 15 and kv.num_usable_blocks == 15 and kv.num_free_blocks == 15
    r = FakeRunner(s)
    req = make_request("a", list(range(100, 130)), max_tokens=12, ignore_eos=True)
    s.add_request(req)
    seen_nulls = 0
    while s.has_unfinished_requests():
        r.step()
        if req.is_finished:
            break
        c = req.num_computed_tokens
        table = kv.get_block_ids("a")
        num_skipped = max(0, c + 1 - 6) // 4
        assert table[:num_skipped] == [null_id] * num_skipped
        assert null_id not in table[num_skipped:]
        assert len(table) == -(-c // 4)  # the table keeps its length
        live = len(table) - num_skipped
        assert kv.num_free_blocks == 15 - live
        assert live <= -(-(6 - 1 + 8) // 4) + 1  # cdiv(W - 1 + chunk, block_size) + 1
        seen_nulls = max(seen_nulls, num_skipped)
    assert seen_nulls >= 8  # 42 tokens: most blocks were freed along the way
    assert_all_free(s)


def test_full_attention_keeps_every_block():
    s = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=8, max_model_len=64)
    r = FakeRunner(s)
    req = make_request("a", list(range(100, 130)), max_tokens=4, ignore_eos=True)
    s.add_request(req)
    for _ in range(5):
        r.step()
    assert s.kv_cache_manager.num_free_blocks == 16 - -(-req.num_computed_tokens // 4)
    assert s.kv_cache_manager.null_block is None


def test_windowed_prompt_longer_than_the_cache_runs():
    # 8 blocks of 4 (7 usable) hold 28 tokens; a 60-token prompt + 20 tokens runs with a
    # window of 8 (at most cdiv(8 - 1 + 8, 4) + 1 = 5 blocks at once) but is refused
    # without one.
    prompt = [300 + i for i in range(60)]
    full = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=8, max_model_len=100)
    with pytest.raises(ValueError, match="more than the whole KV cache"):
        full.add_request(make_request("a", prompt))
    s = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=8, max_model_len=100, sliding_window=8)
    r = FakeRunner(s)
    req = make_request("a", prompt, max_tokens=20, ignore_eos=True)
    s.add_request(req)
    min_free = s.kv_cache_manager.num_free_blocks
    while s.has_unfinished_requests():
        r.step()
        min_free = min(min_free, s.kv_cache_manager.num_free_blocks)
    assert req.num_output_tokens == 20 and req.num_preemptions == 0
    assert min_free >= 7 - 5
    assert_all_free(s)
    # Even a window of 8 cannot run in 3 usable blocks with 8-token steps.
    tiny = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=8, max_model_len=100, sliding_window=8)
    with pytest.raises(ValueError, match="more than the whole KV cache"):
        tiny.add_request(make_request("b", prompt))


def test_window_prefix_hit_needs_only_the_last_window_of_blocks():
    # A's blocks stay cached (evictable) after it finishes, including those freed behind its
    # window. B shares A's 40-token prompt: with the first blocks evicted, full attention
    # would get no hit, the window needs only the blocks of the last window.
    s = make_scheduler(num_blocks=32, block_size=4, sliding_window=6, max_num_batched_tokens=8, max_model_len=64)
    kv, pool = s.kv_cache_manager, s.kv_cache_manager.block_pool
    r = FakeRunner(s)
    prompt = [400 + i for i in range(40)]
    a = make_request("a", prompt, max_tokens=2, ignore_eos=True)
    s.add_request(a)
    r.run_until_done()
    assert len(pool.cached_blocks) == 10  # 41 computed tokens: 10 full blocks, all cached
    for h in a.block_hashes[:4]:  # evict blocks 0-3
        pool._evict(pool.get_cached_block(h))
    b = make_request("b", prompt + [500, 501], max_tokens=3, ignore_eos=True)
    hits, num_cached = kv.get_computed_blocks(b)
    # 41 tokens -> at most 10 hit blocks; the window needs cdiv(6 - 1, 4) = 2 of them.
    assert num_cached == 40
    assert hits[:4] == [kv.null_block] * 4 and all(h is not kv.null_block for h in hits[8:])
    # A miss inside the last window breaks the hit: the longest prefix that ends with 2
    # cached blocks is 8 blocks (7 and 8 cached, 9 evicted).
    pool._evict(pool.get_cached_block(a.block_hashes[9]))
    hits, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 36 and len(hits) == 9
    s.add_request(b)
    out = r.step()
    (sr,) = out.scheduled
    assert sr.start_pos == 36 and b.num_cached_tokens == 36
    r.run_until_done()  # the fake runner checks B reads A's tokens in its window
    assert b.num_output_tokens == 3
    assert_all_free(s)


def test_freed_window_blocks_stay_cached_and_evictable():
    s = make_scheduler(num_blocks=16, block_size=4, sliding_window=4, max_num_batched_tokens=8, max_model_len=64)
    pool = s.kv_cache_manager.block_pool
    r = FakeRunner(s)
    a = make_request("a", [600 + i for i in range(24)], max_tokens=8, ignore_eos=True)
    s.add_request(a)
    for _ in range(3):
        r.step()
    assert a.num_computed_tokens == 24
    freed = [pool.get_cached_block(h) for h in a.block_hashes[:5]]  # positions < 24 + 1 - 4 = 21
    assert all(b is not None and b.ref_cnt == 0 for b in freed)
    free_ids = [b.block_id for b in pool.free_queue]
    assert all(b.block_id in free_ids for b in freed)
    # Unhashed free blocks are reused first, then the cached ones (LRU).
    assert free_ids.index(freed[0].block_id) >= pool.num_free_blocks - 5
    r.run_until_done()
    assert_all_free(s)


@pytest.mark.parametrize("caching", [True, False])
def test_window_preemption_recomputes_and_frees_again(caching):
    # A low-priority windowed request is preempted (recompute) by a high-priority arrival
    # (one sequence at a time) after blocks fell out of its window; it resumes from
    # position 0 (or from a window-sized prefix-cache hit) and both finish, the fake runner
    # checking every read.
    s = make_scheduler(num_blocks=12, block_size=2, sliding_window=5, max_num_batched_tokens=6, max_model_len=80,
                       enable_prefix_caching=caching, scheduling_policy="priority", max_num_seqs=1)
    kv = s.kv_cache_manager
    r = FakeRunner(s)
    low = make_request("low", [700 + i for i in range(20)], max_tokens=6, ignore_eos=True, priority=1)
    s.add_request(low)
    for _ in range(5):
        r.step()
    assert kv.null_block.block_id in kv.get_block_ids("low")
    high = make_request("high", [800 + i for i in range(9)], max_tokens=5, ignore_eos=True, priority=0)
    s.add_request(high)
    out = r.step()
    assert out.preempted_request_ids == ["low"] and low.num_computed_tokens == 0
    assert "low" not in kv.req_to_blocks
    r.run_until_done()
    assert low.num_preemptions == 1 and low.num_output_tokens == 6 and high.num_output_tokens == 5
    if caching:  # resumed from the cached last window of its 22 computed tokens
        assert low.num_cached_tokens == 0  # counted at its first schedule only
    assert_all_free(s)


def test_window_newcomer_admitted_beside_a_running_request():
    # A newcomer with a 60-token prompt needs 15 blocks for all its tokens under full
    # attention (more than 12 usable); with a window of 4 it needs at most 4 at once, so it
    # is admitted beside the running request instead of waiting for it to finish.
    s = make_scheduler(num_blocks=13, block_size=4, sliding_window=4, max_num_batched_tokens=8, max_model_len=128,
                       watermark=0)
    r = FakeRunner(s)
    a = make_request("a", [1, 2, 3], max_tokens=40, ignore_eos=True)
    s.add_request(a)
    r.step()
    b = make_request("b", [900 + i for i in range(60)], max_tokens=4, ignore_eos=True)
    s.add_request(b)
    out = r.step()
    assert {sr.request_id for sr in out.scheduled} == {"a", "b"}
    r.run_until_done()
    assert a.num_preemptions == 0 and b.num_preemptions == 0
    assert_all_free(s)


def test_bad_sliding_window_is_refused():
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="sliding_window"):
            make_scheduler(sliding_window=bad)


@pytest.mark.parametrize("window", [None, 5])
def test_victim_of_the_allocating_step_leaves_no_unwritten_block_cached(window):
    # `low` gets its next chunk's blocks (registered in the prefix cache as full after the
    # step) and is then preempted in the same schedule() by a higher-priority arrival: its
    # step never runs, so those blocks must not stay cached (the fake runner checks every
    # cached block holds its hash's tokens). Found while testing the window (it held for
    # full attention too).
    s = make_scheduler(num_blocks=16, block_size=2, max_num_batched_tokens=6, max_model_len=32,
                       scheduling_policy="priority", max_num_seqs=1, sliding_window=window)
    pool = s.kv_cache_manager.block_pool
    r = FakeRunner(s)
    low = make_request("low", [700 + i for i in range(20)], max_tokens=6, ignore_eos=True, priority=1)
    s.add_request(low)
    for _ in range(3):
        r.step()
    assert low.num_computed_tokens == 18
    s.add_request(make_request("high", [800 + i for i in range(9)], max_tokens=5, ignore_eos=True, priority=0))
    out = r.step()  # low's last 2 prompt tokens get block 9, then the budget left admits high
    assert out.preempted_request_ids == ["low"]
    # Blocks 0-8 (positions < 18) were written; block 9 was only allocated.
    assert len(low.block_hashes) == 10 and pool.get_cached_block(low.block_hashes[9]) is None
    r.run_until_done()
    assert low.num_output_tokens == 6
    assert_all_free(s)
