"""The scheduler (kvfleet.runtime.core.sched.scheduler), without a model: continuous batching,
chunked prefill, preemption by recompute, rejection, aborts, stop conditions, admission without
admit/preempt thrash and the watermark, and (Hypothesis) random workloads -- arrivals, shared
prefixes, aborts, memory pressure, sliding windows -- that never leak or double-free a block.
The fake runner (support/fake_runner.py) checks the paging contract after every step. Prefix
caching: ../test_prefix_caching.py; sliding window: ../test_sliding_window.py; the policies:
test_request_queue.py."""


from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from support.fake_runner import EOS, FakeRunner, assert_all_free, make_request, make_scheduler, run_counting

from kvfleet.runtime.core.request import RequestStatus


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


def test_a_request_in_a_micro_batch_in_flight_is_left_out_never_preempted_and_its_state_kept():
    """Pipeline parallelism (engine/micro_batches): a request in a step whose tokens are not back
    is not scheduled again (not even its next prefill chunk), is no preemption victim, and when it
    is aborted meanwhile the runner hears of it only once that step is back (it samples it)."""
    s = make_scheduler(max_num_batched_tokens=8, max_model_len=64)
    s.add_request(make_request("long", list(range(1, 21)), max_tokens=2, ignore_eos=True, arrival_time=2.0))
    first = s.schedule()  # 8 of its 20 prompt tokens
    s.in_flight.update(sr.request_id for sr in first.scheduled)
    assert s.schedule().scheduled == []  # its next chunk waits for this one
    s.add_request(make_request("b", [5] * 3, max_tokens=1, ignore_eos=True, arrival_time=1.0))
    second = s.schedule()
    assert [(x.request_id, x.num_new_tokens) for x in second.scheduled] == [("b", 3)]
    assert s._victim().request_id == "b"  # "long" arrived later, but it is in flight
    s.in_flight.add("b")
    assert s._victim() is None
    s.finish_requests(["long"], RequestStatus.FINISHED_ABORTED)
    s.in_flight.discard("b")
    s.update_from_output(second, {"b": 9})  # b finishes (max_tokens 1)
    assert s.schedule().finished_request_ids == {"b"}  # "long": its step is still in flight
    s.in_flight.discard("long")
    assert s.schedule().finished_request_ids == {"long"}
    assert_all_free(s)


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


# -- admission: no admit/preempt thrash ------------------------------------------------------
@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
def test_low_priority_request_is_not_admitted_only_to_be_preempted(policy):
    # The workload of tests/unit/runtime/engine/test_prompt_logprobs.py's preemption test, without the model:
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


# -- properties ---------------------------------------------------------------------------
PREFIXES = [[], list(range(1, 9)), list(range(50, 63)), [7] * 5]

op = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 14), st.integers(1, 12), st.integers(0, 3),
              st.integers(1, 3), st.booleans()),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 40)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Drafts once took blocks the admission rule had kept for the running requests' next tokens.
@example(ops=[("add", 0, 1, 9, 0, 2, False), ("add", 0, 1, 5, 0, 2, False)], num_blocks=8, block_size=2, budget=8,
         caching=False, policy="fcfs", window=None, speculate=3)
# A rejected draft's block stays for the next positions: the window's bound counts them (found in CI).
@example(ops=[("add", 0, 1, 1, 0, 1, False), ("add", 0, 1, 5, 0, 3, False)], num_blocks=8, block_size=2, budget=8,
         caching=False, policy="fcfs", window=3, speculate=3)
@given(
    ops=st.lists(op, min_size=1, max_size=60),
    num_blocks=st.integers(8, 40),
    block_size=st.sampled_from([2, 4, 8]),
    budget=st.sampled_from([8, 16, 64]),
    caching=st.booleans(),
    policy=st.sampled_from(["fcfs", "priority", "fair"]),
    window=st.sampled_from([None, None, 1, 3, 8]),
    speculate=st.sampled_from([0, 0, 3]),
)
def test_random_workloads_never_leak_or_double_free(ops, num_blocks, block_size, budget, caching, policy, window,
                                                    speculate):
    usable = num_blocks - (window is not None)
    s = make_scheduler(
        num_blocks=num_blocks, block_size=block_size, max_model_len=usable * block_size,
        max_num_seqs=4, max_num_batched_tokens=budget, enable_prefix_caching=caching, scheduling_policy=policy,
        sliding_window=window,
    )
    r = FakeRunner(s, speculate=speculate)
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


# -- speculative decoding -------------------------------------------------------------------
def test_drafts_are_verified_in_one_step_and_rejected_ones_rolled_back():
    s = make_scheduler(max_model_len=64)
    r = FakeRunner(s, speculate=3)
    s.add_request(make_request("a", [5] * 6, max_tokens=20, ignore_eos=True))
    r.step()  # prefill: samples one token, proposes 3 drafts
    req = s.requests["a"]
    assert len(req.spec_token_ids) == 3
    out = r.step()
    sr = out.scheduled[0]
    assert sr.num_new_tokens == 4 and sr.spec_token_ids and sr.sample
    assert sr.token_ids[1:] == sr.spec_token_ids
    # After verification only the accepted tokens count as computed: one token is left to compute.
    assert req.num_computed_tokens == req.num_tokens - 1
    r.run_until_done()
    assert_all_free(s)


def test_drafts_are_cut_to_max_tokens_the_budget_and_max_model_len():
    s = make_scheduler(max_model_len=16, max_num_batched_tokens=32)
    r = FakeRunner(s, speculate=8)
    s.add_request(make_request("a", [5] * 6, max_tokens=4, ignore_eos=True))
    r.step()
    out = r.step()
    # 1 output token so far, max_tokens 4: at most 2 drafts (all accepted + the bonus = 4).
    assert len(out.scheduled[0].spec_token_ids) <= 2
    r.run_until_done()
    s.add_request(make_request("b", [5] * 12, max_tokens=30, ignore_eos=True))
    r.run_until_done()  # max_model_len 16: drafts never run a sequence past it
    assert all(sr.seq_len <= 16 for o in r.outputs for sr in o.scheduled)
    assert_all_free(s)
