"""``kvfleet serve --headless``: a worker node of a multi-node replica (vLLM's ``--headless``).

Contract: connect to node 0's rendezvous store at ``master_addr:master_port`` (waiting up to
``KVFLEET_TP_STARTUP_TIMEOUT`` for it), take node 0's engine options when this node's ``model``,
``tensor_parallel_size``, ``pipeline_parallel_size`` and ``nnodes`` agree (else report the
difference to node 0 under this node's first rank and exit 2), spawn this node's ranks
``r*k+1 ..`` and run rank ``r*k`` in this process until node 0's stop message (exit 0) or a
failure (non-zero). No HTTP server, no scheduler.
Rank layout and liveness: :mod:`kvfleet.runtime.worker.multinode`.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from datetime import timedelta

import torch.distributed as dist

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.worker.executor import STARTUP_TIMEOUT_S, worker_main
from kvfleet.runtime.worker.model_loader import resolve_model_path
from kvfleet.runtime.worker.multinode import CONFIG_KEY, ERROR_KEY, check_leader_config, node_ranks, spawn_worker

logger = logging.getLogger(__name__)


def run_headless(config: EngineConfig) -> int:
    """Run this node's ranks for node 0 (see the module docstring).
    Does not return normally: the process exits with the rank's status (0 after node 0's stop).

    Raises:
        ValueError: the options disagree with node 0's (:func:`check_leader_config`).
    """
    ranks = node_ranks(config.world_size, config.nnodes, config.node_rank)
    logger.info("headless node %d of %d: ranks %s, node 0 at %s:%d", config.node_rank, config.nnodes,
                list(ranks), config.master_addr, config.master_port)
    store = dist.TCPStore(config.master_addr, config.master_port, is_master=False,
                          timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
    leader = json.loads(store.get(CONFIG_KEY))  # blocks until node 0 published it
    try:
        run = check_leader_config(config, leader)
    except ValueError as exc:  # node 0 fails its start with this reason instead of waiting for us
        store.set(ERROR_KEY.format(rank=ranks[0]), f"ValueError: {exc}")
        raise
    path, _ = resolve_model_path(run.model)
    procs: list[subprocess.Popen] = []
    for local, rank in enumerate(ranks):
        if local:
            procs.append(spawn_worker(rank, local, run, path, config.master_addr, config.master_port, os.getpid()))
    del store
    worker_main(ranks[0], run.model_dump(), path, config.master_addr, config.master_port, None, local_rank=0)
    return 1  # unreachable: worker_main exits the process


def main_headless(config: EngineConfig) -> int:
    """Entry of ``kvfleet serve --headless``: :func:`run_headless`, a bad option as exit status 2."""
    try:
        return run_headless(config)
    except ValueError as exc:
        print(f"kvfleet serve --headless: {exc}", file=sys.stderr)
        return 2
