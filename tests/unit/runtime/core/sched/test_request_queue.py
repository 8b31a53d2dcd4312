"""The scheduling policies (kvfleet.runtime.core.sched.request_queue: ``fcfs``, ``priority``,
``fair``) as the scheduler applies them, without a model: the preemption victim is the lowest
priority, tenants are served round robin, a priority request overtakes a queue of 50, and a
high-priority arrival still preempts for memory."""


from __future__ import annotations

from support.fake_runner import FakeRunner, assert_all_free, make_request, make_scheduler, run_counting


def test_priority_victim_is_the_lowest_priority():
    s = make_scheduler(num_blocks=7, block_size=4, max_num_batched_tokens=64, scheduling_policy="priority")
    r = FakeRunner(s)
    s.add_request(make_request("low", [3] * 8, max_tokens=10, ignore_eos=True, priority=5, arrival_time=1.0))
    s.add_request(make_request("high", [4] * 8, max_tokens=10, ignore_eos=True, priority=0, arrival_time=2.0))
    preempted = []
    while s.has_unfinished_requests():
        preempted += r.step().preempted_request_ids
    assert preempted and set(preempted) == {"low"}


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
