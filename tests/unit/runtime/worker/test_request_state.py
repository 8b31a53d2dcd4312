"""The scheduler -> runner seam (issue 26): a request's data crosses once, then only diffs.

The runner's own state (worker/request_state) rebuilt from the plain ``RunnerInput`` matches
the scheduler's step in every scheduler test (support/fake_runner.py checks it each step); here:
what crosses per step is O(1) for a decoding request, a preemption is a resume with the whole
table, and a finished request is dropped. Torch-free, no model.
"""

from __future__ import annotations

import pickle

from support.fake_runner import FakeRunner, make_request, make_scheduler

from kvfleet.runtime.worker.request_state import RequestStates


def test_a_decoding_request_sends_its_data_once_then_one_token_and_at_most_one_block_a_step():
    s = make_scheduler(num_blocks=64, block_size=4, max_model_len=64)
    r = FakeRunner(s)
    s.add_request(make_request("a", list(range(10, 20)), max_tokens=30, ignore_eos=True))
    first = r.step().runner_input
    assert [n.request_id for n in first.scheduled_new_reqs] == ["a"] and not first.scheduled_cached_reqs
    assert first.scheduled_new_reqs[0].prompt_token_ids == list(range(10, 20))
    assert first.scheduled_new_reqs[0].block_ids == [b for b in s.kv_cache_manager.get_block_ids("a")]
    for _ in range(20):
        step = r.step().runner_input
        assert not step.scheduled_new_reqs
        (diff,) = step.scheduled_cached_reqs
        assert len(diff.new_token_ids) == 1 and len(diff.new_block_ids) <= 1 and not diff.replace_block_ids
        assert step.num_scheduled_tokens == {"a": 1}
        pickle.dumps(step)  # plain data: what the tensor-parallel driver broadcasts


def test_preemption_resumes_with_the_whole_table_and_finished_requests_are_dropped():
    # A cache too small for both: the later request is preempted and resumed (recompute).
    s = make_scheduler(num_blocks=9, block_size=4, max_model_len=32, max_num_batched_tokens=32)
    r = FakeRunner(s)
    for rid in ("a", "b"):
        s.add_request(make_request(rid, list(range(1, 13)), max_tokens=16, ignore_eos=True))
    states = RequestStates()
    resumed = []
    for _ in range(200):
        if not s.has_unfinished_requests():
            break
        step = r.step().runner_input
        states.update(step)  # a second runner fed the same plain steps (as a tensor-parallel rank is)
        resumed += [d for d in step.scheduled_cached_reqs if d.resumed_from_preemption]
        assert not step.finished_request_ids & states.requests.keys()
    assert resumed and all(d.replace_block_ids for d in resumed)
    r.step()  # the last finished ids reach the runner with the next step
    assert not r.runner_states.requests
