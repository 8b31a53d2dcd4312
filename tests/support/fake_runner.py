"""A fake model runner for the scheduler's tests: it plays the runner's part in the paging contract
without a model. It "writes" each scheduled token id into the slot the block table gives, and
then checks that every position a request attends to holds that request's token -- which is what
correct paging, sharing and prefix caching mean -- and the block-accounting invariants after
every step. With ``speculate=k`` it proposes ``k`` drafts per request and step (right two times
in three) and verifies them as the real runner does (greedy acceptance): the rejected drafts' slots
must never be read as the request's tokens nor end up in the prefix cache.
``make_scheduler`` / ``make_request`` build small schedulers and requests;
``run_counting`` runs a workload to its end, counting preemptions and prefill tokens."""

from __future__ import annotations

import zlib
from collections import Counter

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.core.request import Request
from kvfleet.runtime.core.sched.scheduler import Scheduler
from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.spec_decode.rejection import accept_greedy
from kvfleet.runtime.worker.request_state import RequestStates

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


def next_token(request: Request, position: int | None = None) -> int:
    """Deterministic stand-in for the sampler: the token at output ``position`` (default: the
    next one) depends only on the request and the position; EOS now and then."""
    h = hash((request.request_id, request.num_output_tokens if position is None else position)) % 97
    return EOS if h == 0 else 1 + h


def guess(request: Request, position: int) -> int:
    """A stand-in proposer's draft of output ``position``: right two times in three."""
    right = next_token(request, position)
    return right if zlib.crc32(f"{request.request_id}/{position}".encode()) % 3 else 1 + right % 97


class FakeRunner:
    """Plays the model runner's part in the paging contract."""

    def __init__(self, scheduler: Scheduler, speculate: int = 0) -> None:
        self.s = scheduler
        self.speculate = speculate
        """Drafts proposed per request and step (speculative decoding; 0: none)."""
        self.bs = scheduler.block_size
        self.slots: dict[int, int] = {}  # slot -> token id "stored" there
        self.hash_tokens: dict[bytes, tuple[int, ...]] = {}
        self.outputs = []
        self.just_admitted = False
        self.runner_states = RequestStates()  # the model runner's side of the plain-data seam

    def step(self):
        waiting = {q.request_id: q.priority for q in self.s.waiting}
        # Siblings of an n > 1 request still tied to their leader, with the leader's state
        # before this step is planned.
        tied = {q.request_id: (q.prompt_leader, q.prompt_leader.status, q.prompt_leader.num_computed_tokens)
                for q in self.s.waiting if q.prompt_leader is not None}
        out = self.s.schedule()
        # The runner's plain view (new data once, then diffs) rebuilds exactly the scheduler's step.
        rows = self.runner_states.update(out.runner_input)
        assert [(r.request_id, r.start_pos, r.token_ids, list(r.block_ids), r.sample, r.spec_token_ids)
                for r in rows] == [(sr.request_id, sr.start_pos, sr.token_ids, sr.block_ids, sr.sample,
                                    sr.spec_token_ids) for sr in out.scheduled]
        assert not out.finished_request_ids & self.runner_states.requests.keys()  # finished: dropped
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
            tokens = sr.request.all_token_ids + sr.spec_token_ids
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
                # Blocks allocated for an earlier step's rejected drafts stay for the positions that
                # come next (vLLM's lookahead slots do too): up to `speculate` positions past seq_len.
                k = self.speculate
                assert live <= kv.max_num_blocks_per_request(sr.seq_len + k, sr.num_new_tokens + k)
        sampled, drafts = {}, {}
        for sr in out.scheduled:
            if not sr.sample:
                continue
            n = sr.request.num_output_tokens
            truth = [next_token(sr.request, n + j) for j in range(len(sr.spec_token_ids) + 1)]
            sampled[sr.request_id] = accept_greedy(truth, sr.spec_token_ids)
            nxt = n + len(sampled[sr.request_id])  # the output's length after this step
            drafts[sr.request_id] = [guess(sr.request, nxt + j) for j in range(self.speculate)]
        self.s.update_from_output(out, sampled, drafts if self.speculate else None)
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
