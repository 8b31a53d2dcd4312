"""Prefix caching in the KV cache manager and block pool (kvfleet.runtime.core.kv_cache_manager,
block_pool), through the scheduler and without a model: shared prefixes prefill fewer tokens, a
fully cached prompt recomputes its last token, prompt-logprobs requests skip the cache, the
sequences of an ``n > 1`` request wait for their leader's prompt then hit every full block, LRU
eviction, ``reset_prefix_cache``, identical prompts under memory pressure. The fake runner
(support/fake_runner.py) checks the paging contract after every step."""


from __future__ import annotations

import pytest
from support.fake_runner import FakeRunner, assert_all_free, make_request, make_scheduler

from kvfleet.runtime.core.request import Request, RequestStatus


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
