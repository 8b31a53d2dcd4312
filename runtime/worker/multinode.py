"""Tensor and pipeline parallelism over several nodes, launched as vLLM launches without Ray
(``--nnodes N --node-rank R --master-addr A --master-port P``, ``--headless`` on every node but 0).

Contract:

- **Rank layout** (:func:`node_ranks`): the ``world = tensor_parallel_size * pipeline_parallel_size``
  ranks (rank ``g`` is tensor-parallel rank ``g % tp`` of pipeline stage ``g // tp``,
  :mod:`kvfleet.runtime.worker.pipeline`) are cut into ``nnodes`` contiguous runs of
  ``k = world / nnodes``; node ``r`` runs ranks ``r*k .. r*k+k-1``
  and its local rank ``i`` (``cuda:i``) is global rank ``r*k + i``. Node 0's process is rank 0
  (:class:`kvfleet.runtime.worker.executor.MultiprocExecutor`): it serves HTTP, schedules and
  samples, and spawns only its own ranks ``1 .. k-1``.
- **Rendezvous**: node 0 owns the TCPStore on ``master_port`` (all interfaces); every rank connects
  to ``master_addr:master_port``. Node 0 publishes its engine options there (``kvfleet/config``);
  a headless node checks that its ``model``, ``tensor_parallel_size``, ``pipeline_parallel_size``
  and ``nnodes`` agree
  (:func:`check_leader_config`) and then runs node 0's options, so that every rank's runner sees the
  same steps the same way.
- **Headless node** (:mod:`kvfleet.runtime.worker.headless`): spawns its ranks ``r*k+1 ..`` and
  runs rank ``r*k`` itself; no HTTP, no scheduler. Exit status 0 after node 0's stop message,
  non-zero otherwise.
- **Liveness**: every worker rank bumps ``kvfleet/heartbeat/<rank>`` in the store every
  ``HEARTBEAT_INTERVAL_S`` (:func:`start_heartbeat`); a worker whose store connection fails (node 0
  is gone) exits at once (status 3). Node 0's :class:`HeartbeatMonitor` reports a rank whose counter
  has not moved for ``KVFLEET_MULTINODE_HEARTBEAT_TIMEOUT`` seconds (default 3) or that wrote an
  error; the engine loop checks it every round (``MultiprocExecutor.check_health``), so a lost node fails
  the replica within seconds even when it is idle (``/health`` dead, the termination log, exit 1).
  A rank that dies during a step fails that step's collective at once (its sockets close).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from kvfleet.runtime import env
from kvfleet.runtime.config import EngineConfig

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5
HEARTBEAT_TIMEOUT_S = env.MULTINODE_HEARTBEAT_TIMEOUT.get()
"""Seconds without a heartbeat after which node 0 declares a rank lost."""
CONFIG_KEY = "kvfleet/config"
HEARTBEAT_KEY = "kvfleet/heartbeat/{rank}"
ERROR_KEY = "kvfleet/error/{rank}"
"""A rank's error report (the executor's ``_ERROR_KEY``)."""
_CHECKED_FIELDS = ("model", "tensor_parallel_size", "pipeline_parallel_size", "nnodes")


def node_ranks(world_size: int, nnodes: int, node_rank: int) -> range:
    """The global ranks node ``node_rank`` runs: ``r*k .. r*k+k-1``, ``k = world_size / nnodes``
    (``world_size``: ``tensor_parallel_size * pipeline_parallel_size``).

    Raises:
        ValueError: ``nnodes`` does not divide ``world_size`` or ``node_rank`` is out of range.
    """
    if nnodes < 1 or world_size % nnodes:
        raise ValueError(f"nnodes ({nnodes}) must divide tensor_parallel_size * pipeline_parallel_size ({world_size})")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank ({node_rank}) must be in 0..{nnodes - 1}")
    k = world_size // nnodes
    return range(node_rank * k, node_rank * k + k)


def leader_config_json(config: EngineConfig) -> str:
    """What node 0 publishes under ``kvfleet/config``: its options, as node 0 (not headless)."""
    return config.model_dump_json()


def check_leader_config(own: EngineConfig, leader: dict[str, Any]) -> EngineConfig:
    """The options a headless node runs: node 0's, with this node's ``node_rank`` and ``headless``.

    Raises:
        ValueError: naming each of ``model``, ``tensor_parallel_size``, ``pipeline_parallel_size``,
            ``nnodes`` that differs
            between this node and node 0.
    """
    diffs = [f"{name}: this node {getattr(own, name)!r}, node 0 {leader.get(name)!r}"
             for name in _CHECKED_FIELDS if getattr(own, name) != leader.get(name)]
    if diffs:
        raise ValueError(f"node {own.node_rank}: options differ from node 0's ({'; '.join(diffs)})")
    return EngineConfig(**{**leader, "node_rank": own.node_rank, "headless": True})


# ------------------------------------------------------------------------------ liveness
def start_heartbeat(rank: int, host: str, port: int) -> threading.Thread:
    """Bump ``kvfleet/heartbeat/<rank>`` every ``HEARTBEAT_INTERVAL_S`` on a store connection of
    its own; when the store is unreachable (node 0 is gone) exit the process with status 3."""

    def beat() -> None:
        key = HEARTBEAT_KEY.format(rank=rank)
        try:
            store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10))
            while True:
                store.add(key, 1)
                time.sleep(HEARTBEAT_INTERVAL_S)
        except Exception as exc:
            logging.getLogger(__name__).error("rank %d: node 0's store is unreachable (%s): exiting", rank, exc)
            os._exit(3)

    thread = threading.Thread(target=beat, daemon=True, name=f"heartbeat-{rank}")
    thread.start()
    return thread


class HeartbeatMonitor:
    """Node 0's watch over the worker ranks' heartbeats (a daemon thread on its own store
    connection). :attr:`lost` becomes a message naming the first rank whose heartbeat stopped for
    ``timeout`` seconds; :attr:`lost_at` the ``time.monotonic()`` it was noticed."""

    def __init__(self, ranks: list[int], host: str, port: int, timeout: float = HEARTBEAT_TIMEOUT_S) -> None:
        self.ranks, self.timeout = ranks, timeout
        self.lost: str | None = None
        self.lost_at: float | None = None
        self._stop = threading.Event()
        self._store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10))
        self._thread = threading.Thread(target=self._run, daemon=True, name="heartbeat-monitor")
        self._thread.start()

    def _run(self) -> None:
        now = time.monotonic()
        seen = {r: (-1, now) for r in self.ranks}
        while not self._stop.wait(HEARTBEAT_INTERVAL_S / 2):
            now = time.monotonic()
            for rank in self.ranks:
                try:
                    count = self._store.add(HEARTBEAT_KEY.format(rank=rank), 0)
                except Exception as exc:  # our own store: only at teardown
                    if not self._stop.is_set():
                        logger.warning("heartbeat monitor: store error %s", exc)
                    return
                last, since = seen[rank]
                if count != last:
                    seen[rank] = (count, now)
                elif now - since > self.timeout:
                    self.lost = (f"rank {rank}: no heartbeat for {now - since:.1f} s "
                                 "(its node died or is cut off from node 0)")
                    self.lost_at = now
                    logger.error("tensor-parallel %s", self.lost)
                    return

    def stop(self) -> None:
        self._stop.set()


def spawn_worker(rank: int, local_rank: int, config: EngineConfig, model_path: str, store_host: str,
                 store_port: int, parent_pid: int) -> subprocess.Popen:
    """Start worker ``rank`` (``local_rank`` on this node) as a fresh interpreter (``python -m
    kvfleet.runtime.worker.executor``), not multiprocessing's spawn: that re-imports the parent's
    __main__, which breaks unguarded scripts. It exits when ``parent_pid`` does."""
    child_env = dict(os.environ)
    child_env.update(
        OMP_NUM_THREADS=str(env.TP_WORKER_THREADS.get()),
        LOCAL_RANK=str(local_rank),  # transformers binds cuda:LOCAL_RANK
        PYTHONSAFEPATH="1",  # a checkout's operator/ must not shadow the stdlib module
    )
    args = [sys.executable, "-m", "kvfleet.runtime.worker.executor", "--rank", str(rank),
            "--local-rank", str(local_rank), "--store-host", store_host, "--store-port", str(store_port),
            "--parent-pid", str(parent_pid), "--model-path", model_path, "--config", config.model_dump_json()]
    return subprocess.Popen(args, env=child_env, stdin=subprocess.DEVNULL)


def _wait(proc: subprocess.Popen, timeout: float) -> bool:
    try:
        proc.wait(max(0.0, timeout))
        return True
    except subprocess.TimeoutExpired:
        return False


def shutdown_procs(procs: list[subprocess.Popen], timeout: float) -> None:
    """Wait up to ``timeout`` s for the workers to exit, then SIGTERM, then SIGKILL; reaps them."""
    deadline = time.monotonic() + timeout
    for proc in procs:
        _wait(proc, deadline - time.monotonic())
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        if not _wait(proc, 2.0):
            proc.kill()
            _wait(proc, 2.0)
