"""Tensor and pipeline parallelism: the engine process is the *driver worker* (rank 0), and it
spawns the other ranks of its node as *workers*, vLLM's process layout: ``tensor_parallel_size *
pipeline_parallel_size`` ranks, rank ``r`` tensor-parallel rank ``r % tp`` of stage ``r // tp``.

Weights are sharded by the model's own transformers tensor-parallel plan and split into stages by
transformers' pipeline split (``DistributedConfig(tp_size=tp, pp_size=pp)``, layer ranges as vLLM's
``get_pp_indices``: :mod:`kvfleet.runtime.worker.pipeline`); each rank's runner holds the KV cache of
its ``num_kv_heads / tp`` heads of its stage's layers, with rank 0's block ids. Rank 0 schedules,
samples and detokenizes; each step, :meth:`MultiprocExecutor.execute_model` broadcasts the step's
plain data (``RunnerInput``) and every rank's runner runs it (nano-vllm's ``call("run", ...)``).
:meth:`MultiprocExecutor.shutdown` stops them; a dead worker or a failed collective is raised as
:class:`TensorParallelError` (naming the rank), never a hang. With ``nnodes > 1`` this process
spawns only node 0's ranks; the other nodes run ``kvfleet serve --headless`` and join through
``master_addr:master_port`` (:mod:`kvfleet.runtime.worker.multinode`). Limits: one parallel engine per
process, ``device`` ``auto``/``cpu``/``cuda``. Docs: docs/engine.md, "Tensor/Pipeline parallelism".
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import subprocess
import threading
import time
import traceback
import weakref
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from kvfleet.runtime import env
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.worker import multinode
from kvfleet.runtime.worker.pipeline import PendingLogits, layer_partition

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = env.TP_STARTUP_TIMEOUT.get()
"""Seconds the driver waits for its workers to reach the rendezvous (spawn + imports)."""
COLLECTIVE_TIMEOUT = timedelta(minutes=30)
"""Timeout of the process groups' collectives (covers model loading; a dead peer is
detected long before, by its closed connection)."""
_STOP = "__kvfleet_stop__"
_ERROR_KEY = "kvfleet/error/{rank}"
_READY_KEY = "kvfleet/ready"


_GATHERED = ("colwise_gather_output", "colwise_rep")   # plan styles whose output every rank holds whole


class TensorParallelError(RuntimeError):
    """A tensor-parallel worker failed or died (the message names its rank and error)."""


# ------------------------------------------------------------------------------ checks
def check_tensor_parallel(hf_config: Any, tensor_parallel_size: int, model_name: str = "the model") -> None:
    """Check that a model can be split ``tensor_parallel_size`` ways.

    Args:
        hf_config: the model's transformers config (its text config is used).
        tensor_parallel_size: the number of ranks.
        model_name: for the messages.

    Raises:
        ValueError: naming ``tensor_parallel_size``: below 1, it does not divide
            ``num_attention_heads`` or ``num_key_value_heads``, the model type has no
            tensor-parallel plan in transformers (``base_model_tp_plan``), or its plan gathers
            the attention projections' outputs (every rank would hold all KV heads; Phi-3, OLMo 2).
    """
    tp = tensor_parallel_size
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    if tp == 1:
        return
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    for field_name, value in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if value % tp:
            raise ValueError(f"tensor_parallel_size ({tp}) must divide the model's {field_name} ({value}) "
                             f"({model_name}: {heads} attention heads, {kv_heads} KV heads)")
    if not getattr(text, "base_model_tp_plan", None):
        raise ValueError(f"tensor_parallel_size ({tp}): {model_name} ({getattr(text, 'model_type', '?')}) has no "
                         "tensor-parallel plan in transformers (config.base_model_tp_plan); run it with "
                         "tensor_parallel_size=1")
    for key, style in text.base_model_tp_plan.items():   # (Phi-3's qkv_proj, OLMo 2's k_proj)
        if ".self_attn." in key and key.endswith(("k_proj", "qkv_proj")) and style in _GATHERED:
            raise ValueError(f"tensor_parallel_size ({tp}): {model_name}'s tensor-parallel plan gathers its attention "
                             f"projections ({key}: {style!r}), so every rank computes all {kv_heads} KV heads, while "
                             f"each rank's KV cache holds {kv_heads // tp}; run it with tensor_parallel_size=1")


def _device_for_rank(device: str, rank: int, tp: int) -> str:
    """The device string of local rank ``rank`` (of ``tp`` on this node): ``cpu``, or ``cuda:<rank>``.

    Raises:
        ValueError: ``device`` names one CUDA device (``cuda:N``), fewer CUDA devices than
            ``tp`` are visible, or ``cpu`` is asked on a machine with CUDA.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        if torch.cuda.is_available():
            # transformers builds the tensor-parallel device mesh (and places the shards) on
            # the machine's accelerator, whatever was asked (initialize_distributed_mesh,
            # transformers/distributed/utils.py:307 in 5.24).
            raise ValueError(
                f"tensor_parallel_size ({tp}) with device cpu on a machine with CUDA: transformers "
                "would place the shards on the GPU; hide it (CUDA_VISIBLE_DEVICES=) to run on the CPU"
            )
        return "cpu"
    if device != "cuda":
        raise ValueError(f"tensor_parallel_size ({tp}) needs device auto, cpu or cuda (rank r uses cuda:r), "
                         f"got {device!r}")
    if torch.cuda.device_count() < tp:
        raise ValueError(f"tensor_parallel_size ({tp}) is more than the {torch.cuda.device_count()} visible "
                         "CUDA devices")
    return f"cuda:{rank}"


# ------------------------------------------------------------------------------ messages
def _min_over_ranks(value: int, group) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


# ------------------------------------------------------------------------------ worker
def _init_process_group(rank: int, world: int, store: dist.Store, device: str):
    """Join the device process group (gloo/NCCL) through the driver's rendezvous store and
    create the gloo control group."""
    from transformers.distributed.utils import get_distributed_backend

    backend = get_distributed_backend(torch.device(device).type)
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore("kvfleet/pg", store),
        rank=rank,
        world_size=world,
        timeout=COLLECTIVE_TIMEOUT,
    )
    return dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)  # the engine died: never outlive it
        time.sleep(1.0)


def worker_main(rank: int, config_dict: dict[str, Any], model_path: str, store_host: str, store_port: int,
                parent_pid: int | None, local_rank: int | None = None) -> None:
    """Body of worker ``rank`` (its own process, see :func:`main`, or a headless node's own
    process with ``parent_pid`` None): join the groups, load this rank's shard, size and allocate
    the local KV cache, then run the driver's steps (their plain data) until the stop message.
    Exit status 0 after a stop, 1 on an error (its traceback is written to the rendezvous store
    under ``kvfleet/error/<rank>``), 3 when its parent or (multi-node) node 0 is gone."""
    torch.set_num_threads(env.TP_WORKER_THREADS.get())
    # Ctrl+C reaches the whole process group: the driver decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if parent_pid is not None:
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="parent-watch").start()
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s tp-worker-{rank} %(levelname)s %(name)s: %(message)s")
    store = dist.TCPStore(store_host, store_port, is_master=False, timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
    config = EngineConfig(**config_dict)
    tp, world = config.tensor_parallel_size, config.world_size
    local_rank = rank if local_rank is None else local_rank
    if config.nnodes > 1:
        multinode.start_heartbeat(rank, store_host, store_port)
    code = 0
    try:
        device = _device_for_rank(config.device, local_rank, world // config.nnodes)
        store.add(_READY_KEY, 1)
        cpu_group = _init_process_group(rank, world, store, device)
        import transformers

        from kvfleet.runtime.worker.model_loader import load_model
        from kvfleet.runtime.worker.model_runner import ModelRunner

        transformers.utils.logging.disable_progress_bar()  # rank 0 shows the one progress bar
        loaded = load_model(model_path, tokenizer=config.tokenizer, dtype=config.dtype, device=device,
                            tensor_parallel_size=tp, batch_invariant=config.batch_invariant,
                            pipeline_parallel_size=config.pipeline_parallel_size)
        runner = ModelRunner(config, loaded)
        num_blocks = _min_over_ranks(runner.determine_num_blocks(), cpu_group)
        runner.initialize_kv_cache(num_blocks)
        with torch.inference_mode():
            while True:
                box: list[Any] = [None]
                dist.broadcast_object_list(box, src=0, group=cpu_group)
                kind, payload = box[0]
                if kind == _STOP:
                    break
                if kind == "execute_model":
                    runner.execute_model(payload)  # the same plain step as rank 0: paired collectives
                else:
                    raise TensorParallelError(f"unknown message from the driver: {kind!r}")
    except BaseException as exc:  # report, then exit non-zero
        code = 1
        if parent_pid is not None and os.getppid() != parent_pid:
            os._exit(3)  # the driver is gone (so are the collectives): nobody to report to
        text = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        try:
            store.set(_ERROR_KEY.format(rank=rank), text)
        except Exception:
            pass
        logging.getLogger(__name__).error("tensor-parallel worker %d failed: %s", rank, text)
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
    os._exit(code)  # skip interpreter teardown of torch/gloo threads


# ------------------------------------------------------------------------------ driver
class MultiprocExecutor:
    """Starts and owns the workers of a tensor-parallel engine; this process becomes rank 0.

    Args:
        config: the engine configuration (``tensor_parallel_size > 1``).
        model_path: a path or hub id ``from_pretrained`` loads (already resolved by
            :func:`kvfleet.runtime.worker.model_loader.resolve_model_path`).
        model_name: the display name for :attr:`loaded` (default: from the path).

    After construction, :attr:`loaded` is rank 0's shard of the model. Use
    :meth:`determine_num_blocks` (all ranks agree on the minimum), then
    :meth:`execute_model` for every step once the KV cache is allocated.

    Raises:
        ValueError: a bad ``device`` for tensor parallelism (see module docstring).
        RuntimeError: another tensor-parallel engine is running in this process.
        TensorParallelError: a worker failed to start or load (its error in the message).
    """

    def __init__(self, config: EngineConfig, model_path: str, model_name: str | None = None) -> None:
        if dist.is_initialized():
            raise RuntimeError(
                "tensor_parallel_size: torch.distributed is already initialised in this process "
                "(one tensor-parallel engine per process)"
            )
        self.config = config
        self.tp = tp = config.tensor_parallel_size
        self.world = world = config.world_size
        """Ranks in all: ``tp`` per pipeline stage (:mod:`kvfleet.runtime.worker.pipeline`)."""
        local_ranks = multinode.node_ranks(world, config.nnodes, 0)
        self.device = _device_for_rank(config.device, 0, len(local_ranks))
        self.procs: list[subprocess.Popen] = []
        self._closed = False
        self.broken = False
        """Set when a forward pass or a message failed on rank 0: the ranks may be out of step
        (a worker waiting in a collective), so no further step is run and shutdown() does not
        talk to the workers, it terminates them."""
        self.cpu_group = None
        self.monitor: multinode.HeartbeatMonitor | None = None
        """With ``nnodes > 1``: the watch over every worker rank's heartbeat."""
        # The rendezvous store; the process groups, the readiness count and the workers' errors
        # all live in it. One node: port 0 (the OS picks a free one, no race with other
        # processes); several: master_port, which the other nodes dial at master_addr.
        multi = config.nnodes > 1
        self.store_host = config.master_addr if multi else "127.0.0.1"
        try:
            self.store = dist.TCPStore(self.store_host, config.master_port if multi else 0, world_size=None,
                                       is_master=True, timeout=timedelta(seconds=STARTUP_TIMEOUT_S),
                                       wait_for_workers=False)
        except Exception as exc:
            raise TensorParallelError(f"nnodes {config.nnodes}: cannot open the rendezvous store on port "
                                      f"{config.master_port} (master_port): {exc}") from exc
        self.store_port = self.store.port
        if multi:
            self.store.set(multinode.CONFIG_KEY, multinode.leader_config_json(config))
        for local, rank in enumerate(local_ranks):
            if local:
                self.procs.append(multinode.spawn_worker(rank, local, config, model_path, self.store_host,
                                                         self.store_port, os.getpid()))
        # At exit or garbage collection without shutdown(): no stop message, terminate at once.
        self._finalizer = weakref.finalize(self, multinode.shutdown_procs, self.procs, 0.0)
        atexit.register(self._finalizer)
        try:
            self._wait_ready()
            self.cpu_group = _init_process_group(0, world, self.store, self.device)
            from kvfleet.runtime.worker.model_loader import load_model

            self.loaded = load_model(model_path, tokenizer=config.tokenizer, dtype=config.dtype, device=self.device,
                                     tensor_parallel_size=tp, batch_invariant=config.batch_invariant,
                                     pipeline_parallel_size=config.pipeline_parallel_size)
            if model_name:
                self.loaded.name = model_name
            if multi:
                self.monitor = multinode.HeartbeatMonitor(list(range(1, world)), self.store_host, self.store_port)
        except BaseException as exc:
            self._fail_and_shutdown(exc)
        logger.info("tensor parallelism %d x pipeline stages %d: %d ranks (%s), workers pids %s", tp,
                    config.pipeline_parallel_size, world, self.device, [p.pid for p in self.procs])
        if multi:
            logger.info("parallel ranks over %d nodes: this node runs ranks %s, the others join at %s:%d",
                        config.nnodes, list(local_ranks), config.master_addr, self.store_port)

    @classmethod
    def start(cls, config: EngineConfig) -> MultiprocExecutor:
        """Resolve ``config.model``, check that it splits ``tensor_parallel_size`` ways (from its
        config alone, before any process starts), then start the workers.

        Raises:
            ValueError: see :func:`check_tensor_parallel` and :func:`_device_for_rank`.
            FileNotFoundError: the model path does not exist.
            TensorParallelError: a worker failed to start or load.
        """
        from transformers import AutoConfig

        from kvfleet.runtime.worker.model_loader import resolve_model_path

        _device_for_rank(config.device, 0, config.world_size // config.nnodes)
        path, name = resolve_model_path(config.model)
        hf_config = AutoConfig.from_pretrained(path)
        check_tensor_parallel(hf_config, config.tensor_parallel_size, name)
        if config.pipeline_parallel_size > 1:  # the split (and $KVFLEET_PP_LAYER_PARTITION) before any process starts
            layer_partition(hf_config.get_text_config().num_hidden_layers, config.pipeline_parallel_size)
        return cls(config, path, name)

    # -------------------------------------------------------------- health
    def _worker_errors(self) -> list[str]:
        errors = []
        for rank in range(1, self.world):
            proc = self.procs[rank - 1] if rank <= len(self.procs) else None  # node 0's own ranks
            key = _ERROR_KEY.format(rank=rank)
            text = None
            try:
                if self.store.check([key]):
                    text = self.store.get(key).decode(errors="replace").splitlines()[0]
            except Exception:
                pass
            if text is None and proc is not None and proc.poll() is not None:
                text = f"exited with code {proc.returncode}"
            if text is not None:
                errors.append(f"rank {rank} (pid {proc.pid}): {text}" if proc is not None else f"rank {rank}: {text}")
        if self.monitor is not None and self.monitor.lost is not None:
            errors.append(self.monitor.lost)
        return errors

    def failure(self, exc: BaseException) -> BaseException:
        """The error to raise for ``exc``: a :class:`TensorParallelError` naming the failed
        workers when there are any (waiting up to 2 s for a dying worker's report), else ``exc``."""
        deadline = time.monotonic() + 2.0
        while True:
            errors = self._worker_errors()
            if errors or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if not errors:
            return exc
        return TensorParallelError(f"tensor-parallel worker failed: {'; '.join(errors)} (driver: {exc!r})")

    def _fail_and_shutdown(self, exc: BaseException) -> NoReturn:
        """Terminate the workers and raise :meth:`failure` for ``exc`` (``exc`` itself,
        traceback intact, when no worker reported an error). Call from an ``except`` block."""
        failure = self.failure(exc)
        self.shutdown(terminate=True)
        if failure is exc:
            raise exc
        raise failure from exc

    def check_workers(self) -> None:
        """Raises: TensorParallelError when a worker has exited (or the executor is shut down)."""
        if self._closed:
            raise TensorParallelError("the tensor-parallel workers were shut down")
        if self.broken:
            raise TensorParallelError("an earlier step failed on the tensor-parallel ranks; they may be out of step: "
                                      "restart the engine")
        dead = [p for p in self.procs if p.poll() is not None]
        if dead or (self.monitor is not None and self.monitor.lost is not None):
            self.broken = True  # the peers may wait in a collective: shutdown() terminates, no stop message
            raise TensorParallelError(f"tensor-parallel worker failed: {'; '.join(self._worker_errors())}")

    def check_health(self) -> None:
        """:meth:`check_workers` while running (a no-op after :meth:`shutdown`): cheap, the async
        engine calls it every loop round, so a lost rank kills the loop even when idle."""
        if not self._closed:
            self.check_workers()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while self.store.add(_READY_KEY, 0) < self.world - 1:  # every rank but 0, on any node
            self.check_workers()
            if self.config.nnodes > 1 and (errors := self._worker_errors()):  # another node refused to join
                raise TensorParallelError(f"tensor-parallel worker failed: {'; '.join(errors)}")
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel workers did not start within {STARTUP_TIMEOUT_S:.0f} s "
                                          f"({self.store.add(_READY_KEY, 0)} of {self.world - 1} joined)")
            time.sleep(0.05)

    # -------------------------------------------------------------- setup and steps
    def determine_num_blocks(self, runner) -> int:
        """``runner.determine_num_blocks()`` on rank 0, minimised over all ranks (each worker
        sizes its own cache at the same time). On failure the workers are shut down.

        Raises: what ``determine_num_blocks`` raises, or TensorParallelError (a worker failed)."""
        try:
            return _min_over_ranks(runner.determine_num_blocks(), self.cpu_group)
        except BaseException as exc:
            self._fail_and_shutdown(exc)

    def execute_model(self, runner, runner_input):
        """One step on every rank: the step's plain data (a ``RunnerInput``) goes to the
        workers, whose runners run it as ``runner`` (rank 0's) does here; their collectives
        (the sharded layers' all-reduces, the LM head's all-gather) pair up. Returns rank 0's
        ``ModelRunnerOutput``.

        Raises: TensorParallelError: a worker is dead, or the step failed (the ranks may then be
            out of step: no further step runs)."""
        self.broadcast(("execute_model", runner_input))
        try:
            return runner.execute_model(runner_input)
        except BaseException as exc:
            self.broken = True
            raise self.failure(exc) from exc

    def receive_logits(self, output):
        """``output`` with a pipeline step's logits received from the last stage (rank 0 runs
        ahead of it by up to ``pp`` micro-batches); other steps' outputs as they are.

        Raises: TensorParallelError: a rank is dead (the ranks may be out of step: no further step runs)."""
        if isinstance(output.logits, PendingLogits):
            try:
                output.logits = output.logits.wait()
            except BaseException as exc:
                self.broken = True
                raise self.failure(exc) from exc
        return output

    def broadcast(self, msg: Any) -> None:
        """Send one message to every worker (``broadcast_object_list`` on the gloo group).

        Raises: TensorParallelError: a worker is dead or the broadcast failed."""
        self.check_workers()
        try:
            dist.broadcast_object_list([msg], src=0, group=self.cpu_group)
        except BaseException as exc:
            self.broken = True
            raise self.failure(exc) from exc

    def shutdown(self, *, terminate: bool = False) -> None:
        """Stop the workers (stop message, join, then terminate/kill) and leave the process
        groups. Idempotent; never raises.

        Args:
            terminate: SIGTERM the workers at once, without the stop message (after a failed
                start, when they may be waiting in some other collective)."""
        if self._closed:
            return
        self._closed = True
        if self.monitor is not None:
            self.monitor.stop()
        self.broken = self.broken or terminate
        stopped = False
        if self.cpu_group is not None and not self.broken and all(p.poll() is None for p in self.procs):
            try:
                dist.broadcast_object_list([(_STOP, None)], src=0, group=self.cpu_group)
                stopped = True
            except Exception:
                logger.warning("could not send the stop message to the tensor-parallel workers", exc_info=True)
        # After a stop message the workers exit by themselves; otherwise (a worker died, so the
        # others may wait in a collective forever) they are terminated at once.
        multinode.shutdown_procs(self.procs, 10.0 if stopped else 0.0)
        logger.info("tensor-parallel workers stopped (exit codes %s)", [p.returncode for p in self.procs])
        self._finalizer()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                logger.warning("destroy_process_group failed", exc_info=True)
        atexit.unregister(self._finalizer)


def main(argv: list[str] | None = None) -> None:
    """``python -m kvfleet.runtime.worker.executor --rank R ...``: a worker process (started by
    :class:`MultiprocExecutor`, not by hand)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kvfleet.runtime.worker.executor")
    for name in ("rank", "local-rank", "store-port", "parent-pid"):
        parser.add_argument(f"--{name}", type=int, required=True)
    parser.add_argument("--store-host", default="127.0.0.1")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--config", required=True, help="the EngineConfig as JSON")
    args = parser.parse_args(argv)
    worker_main(args.rank, json.loads(args.config), args.model_path, args.store_host, args.store_port,
                args.parent_pid, local_rank=args.local_rank)


if __name__ == "__main__":
    main()
