"""The sliding window in the KV cache manager (kvfleet.runtime.core.kv_cache_manager), through the
scheduler and without a model: blocks behind the window go back to the pool each step, prompts
longer than the cache run, a prefix hit needs only the last window of blocks, freed blocks stay
cached, preemption recomputes. The fake runner (support/fake_runner.py) reads only the keys
inside the window. The same through the engine, against transformers:
tests/unit/runtime/engine/test_sliding_window.py."""


from __future__ import annotations

import pytest
from support.fake_runner import FakeRunner, assert_all_free, make_request, make_scheduler


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
