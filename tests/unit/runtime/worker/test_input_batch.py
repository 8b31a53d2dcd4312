"""The persistent input batch (runtime/worker/input_batch.py) gives the very tensors of the
stateless construction, step after step, as requests join, leave, are preempted, prefill in
chunks, hit the prefix cache, reuse an id, and (sliding window) swap table entries for the
null block; both equal a per-token pure-Python oracle. No model: the real scheduler drives it."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.core.request import Request
from kvfleet.runtime.core.sched.output import ScheduledRequest
from kvfleet.runtime.core.sched.scheduler import Scheduler
from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.worker.input_batch import InputBatch, StepArrays, build_inputs

FIELDS = ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc", "logits_indices")


def oracle(scheduled: list[ScheduledRequest], bs: int) -> dict:
    """Per token, in plain Python: what the forward must get."""
    ids, pos, slots, qsl, seq_lens, keep = [], [], [], [0], [], []
    width = max(-(-s.seq_len // bs) for s in scheduled)
    tables = []
    for s in scheduled:
        n = -(-s.seq_len // bs)
        tables.append(list(s.block_ids[:n]) + [0] * (width - n))
        for j, t in enumerate(s.token_ids):
            p = s.start_pos + j
            ids.append(t)
            pos.append(p)
            slots.append(s.block_ids[p // bs] * bs + p % bs)
        qsl.append(qsl[-1] + len(s.token_ids))
        seq_lens.append(s.seq_len)
        if s.sample:
            keep.append(qsl[-1] - 1)
    return {"input_ids": ids, "positions": pos, "slot_mapping": slots, "block_tables": tables,
            "seq_lens": seq_lens, "query_start_loc": qsl, "logits_indices": keep,
            "max_query_len": max(len(s.token_ids) for s in scheduled), "max_seq_len": max(seq_lens)}


def check_equal(a: StepArrays, b: StepArrays, want: dict) -> None:
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype == np.int64, f
        assert x.shape == y.shape, f
        assert np.array_equal(x, y), f
        assert np.asarray(x).tolist() == want[f], f
    assert a.max_query_len == b.max_query_len == want["max_query_len"]
    assert a.max_seq_len == b.max_seq_len == want["max_seq_len"]


def drive(scheduler: Scheduler, batch: InputBatch, steps: int, rng: random.Random, add=None) -> dict:
    seen = {"preempted": 0, "chunked": 0, "mixed": 0, "cached": 0, "steps": 0}
    for step in range(steps):
        if add is not None:
            add(step)
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        if not out.scheduled:
            continue
        bs = scheduler.block_size
        check_equal(batch.build(out.scheduled), build_inputs(out.scheduled, bs), oracle(out.scheduled, bs))
        seen["steps"] += 1
        seen["preempted"] += len(out.preempted_request_ids)
        seen["chunked"] += any(not s.sample for s in out.scheduled)
        seen["mixed"] += out.num_prefill_tokens > 0 and out.num_decode_tokens > 0
        seen["cached"] += any(s.start_pos > 0 and s.start_pos < s.request.num_prompt_tokens for s in out.scheduled)
        tokens = {s.request_id: rng.randrange(100, 1000) for s in out.scheduled if s.sample}
        scheduler.update_from_output(out, tokens)
        assert batch.num_rows <= len(out.scheduled)
    return seen


def _request(rid: str, n: int, rng: random.Random, max_tokens: int, prefix: list[int] | None = None) -> Request:
    prompt = (prefix or []) + [rng.randrange(100, 1000) for _ in range(n)]
    return Request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_joins_leaves_preemption_chunked_prefill(prefix_caching):
    rng = random.Random(0)
    # A small cache (preemption), a small step budget (chunked prefill, mixed steps),
    # requests arriving over time and finishing at different lengths (joins and leaves).
    config = EngineConfig(block_size=4, max_num_seqs=6, max_num_batched_tokens=24,
                          enable_prefix_caching=prefix_caching)
    scheduler = Scheduler(config, num_blocks=28, max_model_len=96)
    batch = InputBatch(4, max_rows=2, max_blocks=2)  # grows
    shared = [rng.randrange(100, 1000) for _ in range(12)]

    def add(step):
        if step % 3 == 0 and step < 60:
            i = step // 3
            scheduler.add_request(_request(f"r{i}", rng.randint(1, 30), rng, rng.randint(1, 25),
                                           prefix=shared if i % 2 else None))

    seen = drive(scheduler, batch, 400, rng, add)
    assert not scheduler.has_unfinished_requests()
    assert seen["preempted"] > 0 and seen["chunked"] > 0 and seen["mixed"] > 0
    if prefix_caching:
        assert seen["cached"] > 0


def test_aborts_and_reused_request_ids():
    rng = random.Random(1)
    config = EngineConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    scheduler = Scheduler(config, num_blocks=64, max_model_len=128)
    batch = InputBatch(4)
    for step in range(40):
        if step % 5 == 0:
            # The same ids again and again: a new Request under an old id must not inherit
            # the old one's row.
            for i in range(3):
                rid = f"x{i}"
                if rid in scheduler.requests:
                    scheduler.finish_requests(rid, scheduler.requests[rid].status.FINISHED_ABORTED)
                scheduler.add_request(_request(rid, rng.randint(1, 20), rng, 30))
        out = scheduler.schedule()
        if not out.scheduled:
            continue
        check_equal(batch.build(out.scheduled), build_inputs(out.scheduled, 4), oracle(out.scheduled, 4))
        scheduler.update_from_output(out, {s.request_id: 7 for s in out.scheduled if s.sample})


def test_sliding_window_null_blocks():
    rng = random.Random(2)
    config = EngineConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    scheduler = Scheduler(config, num_blocks=48, max_model_len=200, sliding_window=8)
    batch = InputBatch(4, sliding_window=True)
    for i in range(4):
        scheduler.add_request(_request(f"w{i}", rng.randint(5, 40), rng, rng.randint(20, 60)))
    null = scheduler.kv_cache_manager.null_block.block_id
    saw_null = False
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        check_equal(batch.build(out.scheduled), build_inputs(out.scheduled, 4), oracle(out.scheduled, 4))
        saw_null |= any(null in s.block_ids for s in out.scheduled)
        scheduler.update_from_output(out, {s.request_id: 5 for s in out.scheduled if s.sample})
    assert saw_null


def test_rows_are_given_back_and_tables_rewritten_on_change():
    """Direct checks of the row bookkeeping with hand-made steps."""
    params = SamplingParams(max_tokens=100)
    a, b = Request("a", [1, 2, 3], params), Request("b", [4, 5], params)
    batch = InputBatch(2, max_rows=1, max_blocks=1)

    def step(*items):
        sched = [ScheduledRequest(r, start, toks, blocks, True) for r, start, toks, blocks in items]
        got = batch.build(sched)
        check_equal(got, build_inputs(sched, 2), oracle(sched, 2))
        return got

    step((a, 0, [1, 2, 3], [7, 3]), (b, 0, [4, 5], [9]))
    assert batch.num_rows == 2
    step((a, 3, [6], [7, 3]))  # b not scheduled: its row goes back
    assert batch.num_rows == 1
    a.num_preemptions += 1  # preempted and recomputed into other blocks
    step((a, 0, [1, 2, 3, 6], [5, 8]), (b, 2, [8], [9, 4]))
    got = step((a, 4, [1], [5, 8, 11]), (b, 3, [2], [9, 4]))
    assert got.block_tables.tolist() == [[5, 8, 11], [9, 4, 0]]


def test_prepare_gives_the_forward_tensors():
    from kvfleet.runtime.worker.input_batch import to_device

    params = SamplingParams(max_tokens=10)
    r1, r2 = Request("a", list(range(10, 15)), params), Request("b", [3], params)
    sched = [ScheduledRequest(r1, 0, r1.prompt_token_ids, [4, 2, 6], True),
             ScheduledRequest(r2, 0, [3], [1], True)]
    ids, pos, meta, keep = InputBatch(2).prepare(sched, [], None, torch.device("cpu"))
    ref = to_device(build_inputs(sched, 2), [], None, torch.device("cpu"))
    assert ids.shape == (1, 6) and ids.dtype == torch.int64 and pos.dtype == torch.int64
    assert meta.block_tables.dtype == meta.seq_lens.dtype == meta.query_start_loc.dtype == torch.int32
    assert meta.slot_mapping.dtype == keep.dtype == torch.int64
    for x, y in zip((ids, pos, keep, meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc),
                    (ref[0], ref[1], ref[3], ref[2].slot_mapping, ref[2].block_tables, ref[2].seq_lens,
                     ref[2].query_start_loc)):
        assert torch.equal(x, y)
    assert meta.slot_mapping.tolist() == [8, 9, 4, 5, 12, 2]
    assert keep.tolist() == [4, 5]
