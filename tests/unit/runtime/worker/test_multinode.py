"""runtime/worker/multinode.py: the rank layout, the options' checks, node 0's options on a
headless node, and the heartbeat watch over a real TCPStore. Two real nodes:
tests/e2e/test_multinode_serve.py."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.entrypoints.openai.serve_args import parse_serve_args
from kvfleet.runtime.worker import multinode


def test_node_ranks_are_contiguous_runs_of_tp_over_nnodes():
    assert list(multinode.node_ranks(4, 2, 0)) == [0, 1]
    assert list(multinode.node_ranks(4, 2, 1)) == [2, 3]
    assert list(multinode.node_ranks(2, 2, 1)) == [1]
    assert list(multinode.node_ranks(3, 1, 0)) == [0, 1, 2]
    with pytest.raises(ValueError, match="must divide"):
        multinode.node_ranks(3, 2, 0)
    with pytest.raises(ValueError, match="node_rank"):
        multinode.node_ranks(4, 2, 2)


@pytest.mark.parametrize(("opts", "message"), [
    ({"tensor_parallel_size": 3, "nnodes": 2}, r"nnodes \(2\) must divide tensor_parallel_size \* pipeline_parallel_size \(3\)"),
    ({"pipeline_parallel_size": 3, "nnodes": 2}, r"must divide tensor_parallel_size \* pipeline_parallel_size \(3\)"),
    ({"tensor_parallel_size": 2, "nnodes": 2, "node_rank": 2, "headless": True}, r"node_rank \(2\) must be below"),
    ({"tensor_parallel_size": 2, "nnodes": 2, "node_rank": 1}, "give --headless"),
    ({"tensor_parallel_size": 2, "nnodes": 2, "headless": True}, "node 0 .* is the leader"),
])
def test_engine_config_rejects_inconsistent_node_options(opts, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**opts)


def test_serve_flags_are_vllms_names():
    args = parse_serve_args(["--tensor-parallel-size", "4", "--nnodes", "2", "--node-rank", "1", "--headless",
                             "--master-addr", "10.0.0.1", "--master-port", "29600"], environ={})
    e = args.engine
    assert (e.nnodes, e.node_rank, e.headless, e.master_addr, e.master_port) == (2, 1, True, "10.0.0.1", 29600)
    args = parse_serve_args(["-pp", "2", "-tp", "2", "--nnodes", "2"], environ={})  # vLLM's short spellings
    assert (args.engine.pipeline_parallel_size, args.engine.tensor_parallel_size, args.engine.world_size) == (2, 2, 4)
    EngineConfig(pipeline_parallel_size=2, nnodes=2, node_rank=1, headless=True)  # one stage per node
    with pytest.raises(SystemExit):  # a usage error: exit 2
        parse_serve_args(["--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1"], environ={})


def test_headless_runs_node_0s_options_and_names_the_ones_that_differ():
    leader = EngineConfig(model="m", tensor_parallel_size=4, nnodes=2, block_size=32).model_dump()
    own = EngineConfig(model="m", tensor_parallel_size=4, nnodes=2, node_rank=1, headless=True)
    run = multinode.check_leader_config(own, leader)
    assert (run.block_size, run.node_rank, run.headless) == (32, 1, True)
    other = EngineConfig(model="x", tensor_parallel_size=2, nnodes=2, node_rank=1, headless=True)
    with pytest.raises(ValueError, match=r"model: this node 'x', node 0 'm'; tensor_parallel_size: this node 2"):
        multinode.check_leader_config(other, leader)
    stages = EngineConfig(model="m", tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=2, node_rank=1,
                          headless=True)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size: this node 2, node 0 1"):
        multinode.check_leader_config(stages, leader)


def test_heartbeat_monitor_names_the_rank_that_stopped_beating():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    monitor = multinode.HeartbeatMonitor([1, 2], "127.0.0.1", store.port, timeout=0.6)
    try:
        t_end = time.monotonic() + 1.5
        while time.monotonic() < t_end:  # both beat: nothing is lost
            store.add("kvfleet/heartbeat/1", 1)
            store.add("kvfleet/heartbeat/2", 1)
            time.sleep(0.1)
        assert monitor.lost is None
        t0 = time.monotonic()
        while monitor.lost is None and time.monotonic() - t0 < 5:  # rank 2 stops
            store.add("kvfleet/heartbeat/1", 1)
            time.sleep(0.1)
        assert monitor.lost is not None and monitor.lost.startswith("rank 2: no heartbeat"), monitor.lost
        assert 0.6 <= monitor.lost_at - t0 < 2.0
    finally:
        monitor.stop()
