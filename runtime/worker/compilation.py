"""Compiled forward: ``torch.compile`` (inductor) of the decoder, one graph for every layer.

:class:`CompiledForward` compiles the model's decoder (embeddings, layers, final norm; the LM
head stays outside and runs on the sampled rows only) with ``fullgraph=True``. Attention and the
KV write are the opaque custom op ``kvfleet::unified_attention``
(:mod:`kvfleet.runtime.worker.attention`), which reads the step's metadata from
``forward_context``: the graph's only inputs are ``input_ids [1, T]`` and ``positions [1, T]``,
so it neither guards nor recompiles on the metadata. On CPU the weights are frozen
(``freezing``: constant-folded, prepacked for oneDNN/AMX). Token counts: static graphs for the
``compile_sizes`` (vLLM's name; default 1, 2, 4, 8 on CPU, where inductor prepacks fp32 matmuls
only for static shapes) and one dynamic-shape graph (``mark_dynamic`` with ``min`` above the
largest size) for the rest; a step is padded up to the smallest size that fits (padding tokens
write nowhere and are never sampled), so warm-up compiles ``len(compile_sizes) + 1`` graphs and
nothing after. On CUDA, decode batches of the capture sizes replay CUDA graphs captured over the
compiled graph (:class:`CudaGraphRunner`). Compiled C++ kernels are cached under ``$KVFLEET_CACHE_DIR/inductor``
(``TORCHINDUCTOR_CACHE_DIR``); frozen graphs themselves are not cacheable (inductor bypasses its
FX graph cache for their prepacked mkldnn weights). Details: docs/performance.md, "Compiled forward".
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

from kvfleet.runtime import env
from kvfleet.runtime.worker.attention import OP_KWARG, AttentionMetadata, forward_context

logger = logging.getLogger(__name__)

INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
BACKEND_ENV = env.COMPILE_BACKEND.name
"""``torch.compile`` backend (default ``inductor``); ``eager`` traces with dynamo only (the custom
op and graph capture without inductor's minutes of codegen: smoke checks)."""
MIN_DYNAMIC_TOKENS = 2
"""Smallest token count the dynamic graph runs (dynamo specializes sizes 0 and 1): without a
static size 1, a one-token step is padded to two."""
MAX_TOKENS = 2**20
"""The dynamic graph's largest token count (far above any ``max_num_batched_tokens``)."""
DEFAULT_CPU_COMPILE_SIZES = (1, 2, 4, 8)
"""Static graph sizes on CPU when ``EngineConfig.compile_sizes`` is None: the decode batches of a
few streams, where prepacked matmuls pay most (docs/performance.md, "Compiled forward")."""
DEFAULT_CUDAGRAPH_SIZES = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
"""Decode batch sizes captured as CUDA graphs (vLLM's capture-size idea; larger batches run the
compiled graph directly). Capped at ``max_num_seqs`` (at least 2). No size 1: one decode sequence
replays the size-2 graph with one padding row."""


def configure_cache(root) -> str:
    """Point inductor's cache at ``root/inductor`` unless ``TORCHINDUCTOR_CACHE_DIR`` names
    another folder than inductor's default (a value inductor wrote itself: its ``cache_dir()``
    stores the default in the variable the first time anything asks, e.g. torchao's import);
    returns the folder used. Must run before the first compilation."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    path = os.environ.get(INDUCTOR_CACHE_ENV)
    if not path or os.path.abspath(path) == os.path.abspath(default_cache_dir()):
        path = os.environ[INDUCTOR_CACHE_ENV] = str(root / "inductor")
    return path


def compile_settings(config, device: torch.device, logits_error: str | None) -> dict | None:
    """:class:`CompiledForward` keyword arguments for this engine, or None to run eagerly:
    ``enforce_eager``, tensor or pipeline parallelism (their collectives run eagerly), or a model whose
    logits the runner's LM head does not reproduce (``logits_error``, see
    ``ModelRunner._check_compute_logits``). Points inductor's cache into ``$KVFLEET_CACHE_DIR``."""
    if config.enforce_eager:
        return None
    if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        logger.warning("tensor_parallel_size=%d, pipeline_parallel_size=%d: the model runs eagerly (enforce_eager)",
                       config.tensor_parallel_size, config.pipeline_parallel_size)
        return None
    if logits_error is not None:
        logger.warning("the model runs eagerly (enforce_eager): %s", logits_error)
        return None
    from kvfleet.runtime.worker.model_loader import cache_dir

    logger.info("compiled forward: inductor cache %s", configure_cache(cache_dir()))
    sizes = [s for s in DEFAULT_CUDAGRAPH_SIZES if s <= max(2, config.max_num_seqs)] if device.type == "cuda" else []
    compile_sizes = config.compile_sizes
    if compile_sizes is None:
        compile_sizes = DEFAULT_CPU_COMPILE_SIZES if device.type == "cpu" else ()
    return {"cudagraph_sizes": sizes, "compile_sizes": compile_sizes}


def compile_counts() -> dict[str, int]:
    """Dynamo's process-wide counters: ``graphs`` compiled (``unique_graphs``) and frames
    ``recompiles`` (a guard failed and the frame was compiled again)."""
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"]["unique_graphs"]), "recompiles": int(counters["recompiles"].total())}


class CompiledForward:
    """The decoder's forward, compiled once, called as ``hidden = cf(input_ids, positions, meta)``.

    Args:
        decoder: the model's decoder (``model.get_decoder()``), switched to ``kvfleet_paged``.
        device: where it runs (CPU: frozen weights; CUDA: CUDA graphs for decode batches).
        cudagraph_sizes: decode batch sizes to capture on CUDA (ignored on CPU); empty: none.
        compile_sizes: token counts compiled as static graphs (steps are padded up to the
            smallest that fits); larger steps run the dynamic graph. Empty: the dynamic graph only.
    """

    def __init__(self, decoder: torch.nn.Module, device: torch.device, *, cudagraph_sizes=(),
                 compile_sizes=()) -> None:
        self.decoder = decoder
        self.device = device
        self.backend = env.COMPILE_BACKEND.get()
        self.compile_sizes = sorted(set(int(s) for s in compile_sizes))
        self.dynamic_min = max([MIN_DYNAMIC_TOKENS - 1, *self.compile_sizes]) + 1
        """The dynamic graph's smallest token count (its guard): every static graph's guard
        (``T == size``) excludes it, so dynamo never runs a static step on the dynamic graph."""
        options = {"freezing": True} if device.type == "cpu" and self.backend == "inductor" else None
        # One frame, one cache entry per static size plus the dynamic one: room for all of them.
        limit = len(self.compile_sizes) + 2
        for name in ("recompile_limit", "cache_size_limit"):
            if getattr(torch._dynamo.config, name, limit) < limit:
                setattr(torch._dynamo.config, name, limit)
        self._compiled = torch.compile(self._forward, fullgraph=True, dynamic=False, backend=self.backend,
                                       options=options)
        self.cudagraphs: CudaGraphRunner | None = None
        if device.type == "cuda" and cudagraph_sizes:
            self.cudagraphs = CudaGraphRunner(self._run_compiled, sorted(set(cudagraph_sizes)), device)
        self.warmup_seconds = 0.0

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.decoder(input_ids=input_ids, position_ids=positions, use_cache=False, **{OP_KWARG: True})
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return hidden[0]

    def _run_compiled(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The graph for this token count: static when it is a compile size, else dynamic
        (the count must be ``>= dynamic_min``: :meth:`padded_size` says what to pad to)."""
        if input_ids.shape[1] >= self.dynamic_min:
            # An explicit max: torch 2.13's value ranges fail on min without max.
            torch._dynamo.mark_dynamic(input_ids, 1, min=self.dynamic_min, max=MAX_TOKENS)
            torch._dynamo.mark_dynamic(positions, 1, min=self.dynamic_min, max=MAX_TOKENS)
        return self._compiled(input_ids, positions)

    def padded_size(self, num_tokens: int) -> int:
        """The token count a step of ``num_tokens`` runs at: the smallest compile size ``>=``
        it, else ``max(num_tokens, dynamic_min)``."""
        for size in self.compile_sizes:
            if size >= num_tokens:
                return size
        return max(num_tokens, self.dynamic_min)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``[T, hidden_size]`` of the step's ``T`` tokens (``input_ids`` and
        ``positions`` of shape ``[1, T]``); writes the KV cache through ``meta``."""
        num_tokens = input_ids.shape[1]
        if self.cudagraphs is not None:
            hidden = self.cudagraphs.run(input_ids, positions, meta)
            if hidden is not None:
                return hidden
        padded = self.padded_size(num_tokens)
        if padded > num_tokens:
            pad = padded - num_tokens
            input_ids = torch.nn.functional.pad(input_ids, (0, pad))
            positions = torch.nn.functional.pad(positions, (0, pad))
            slots = torch.nn.functional.pad(meta.slot_mapping, (0, pad), value=-1)
            meta = _replace(meta, slot_mapping=slots, num_actual_tokens=num_tokens)
        with forward_context(meta):
            hidden = self._run_compiled(input_ids, positions)
        return hidden[:num_tokens]

    @torch.inference_mode()
    def warm_up(self, make_step: Callable[[int, int], tuple]) -> float:
        """Compile (and on CUDA capture) before the first request; returns the seconds taken.

        ``make_step(num_seqs, num_tokens)`` builds a throw-away step ``(input_ids, positions,
        meta)`` that writes nowhere (slots -1). Under ``inference_mode`` as the engine's steps
        (a graph compiled with grad mode on would not serve them: a guard on it)."""
        t0 = time.monotonic()
        before = compile_counts()
        for num_tokens in [max(16, self.dynamic_min), *self.compile_sizes]:
            self(*make_step(min(num_tokens, 4), num_tokens))
        if self.cudagraphs is not None:
            self.cudagraphs.capture(make_step)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.warmup_seconds = time.monotonic() - t0
        after = compile_counts()
        logger.info("compiled forward: warm-up %.1f s (%d graph(s) compiled, %d recompile(s))",
                    self.warmup_seconds, after["graphs"] - before["graphs"],
                    after["recompiles"] - before["recompiles"])
        return self.warmup_seconds


def _replace(meta: AttentionMetadata, **changes) -> AttentionMetadata:
    import dataclasses

    return dataclasses.replace(meta, **changes)


class CudaGraphRunner:
    """CUDA graphs of the compiled forward for decode batches (one token per sequence) of the
    capture sizes: a step of ``B`` decode sequences replays the graph of the smallest size
    ``>= B`` after copying its inputs and metadata into the graph's static buffers; the padding
    sequences have one token each, slot -1 (no write) and context length 1 over block 0 (read,
    never sampled). Anything else (prefill, larger batches) returns None: the caller runs the
    compiled graph directly.

    Args:
        forward: ``(input_ids [1, T], positions [1, T]) -> hidden [T, hidden]`` (the compiled
            forward, called inside ``forward_context``).
        sizes: sorted capture sizes.
        device: the CUDA device.
    """

    def __init__(self, forward, sizes: list[int], device: torch.device) -> None:
        self.forward = forward
        self.sizes = sizes
        self.device = device
        self.graphs: dict[int, tuple] = {}
        self.max_blocks = 0
        self.replays = 0

    def _buffers(self, meta: AttentionMetadata) -> None:
        n = self.sizes[-1]
        dev = self.device
        self.max_blocks = meta.block_tables.shape[1]
        self.input_ids = torch.zeros((1, n), dtype=torch.long, device=dev)
        self.positions = torch.zeros((1, n), dtype=torch.long, device=dev)
        self.meta = AttentionMetadata(
            slot_mapping=torch.full((n,), -1, dtype=torch.long, device=dev),
            block_tables=torch.zeros((n, self.max_blocks), dtype=torch.int32, device=dev),
            seq_lens=torch.ones((n,), dtype=torch.int32, device=dev),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=dev),
            max_query_len=1,
            max_seq_len=meta.max_seq_len,
            kv_caches=meta.kv_caches,
            sliding_windows=meta.sliding_windows,
        )

    def _views(self, size: int) -> tuple:
        m = self.meta
        meta = AttentionMetadata(
            slot_mapping=m.slot_mapping[:size], block_tables=m.block_tables[:size], seq_lens=m.seq_lens[:size],
            query_start_loc=m.query_start_loc[:size + 1], max_query_len=1, max_seq_len=m.max_seq_len,
            kv_caches=m.kv_caches, sliding_windows=m.sliding_windows,
        )
        return self.input_ids[:, :size], self.positions[:, :size], meta

    def capture(self, make_step) -> None:
        """Capture every size, largest first, into one shared memory pool. ``make_step`` gives
        a step whose ``block_tables`` width (the longest sequence's block count, here
        ``max_model_len / block_size``) and ``max_seq_len`` hint the graphs keep."""
        _, _, meta = make_step(1, 1, full_width=True)
        self._buffers(meta)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            ids, pos, meta = self._views(size)
            with forward_context(meta):
                for _ in range(2):  # compile / autotune outside the capture
                    self.forward(ids, pos)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.forward(ids, pos)
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize(self.device)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Replay the graph for this decode step, or None when none fits."""
        num = input_ids.shape[1]
        if not self.graphs or meta.block_tables.shape[0] != num or meta.max_query_len != 1:
            return None
        size = next((s for s in self.sizes if s >= num and s in self.graphs), None)
        if size is None or meta.block_tables.shape[1] > self.max_blocks:
            return None
        m = self.meta
        self.input_ids[0, :num].copy_(input_ids[0], non_blocking=True)
        self.positions[0, :num].copy_(positions[0], non_blocking=True)
        m.slot_mapping[:num].copy_(meta.slot_mapping, non_blocking=True)
        m.slot_mapping[num:size].fill_(-1)
        width = meta.block_tables.shape[1]
        m.block_tables[:num, :width].copy_(meta.block_tables, non_blocking=True)
        m.block_tables[:num, width:].zero_()
        m.block_tables[num:size].zero_()
        m.seq_lens[:num].copy_(meta.seq_lens, non_blocking=True)
        m.seq_lens[num:size].fill_(1)
        # query_start_loc stays arange: one token per sequence, padding included.
        graph, out = self.graphs[size]
        graph.replay()
        self.replays += 1
        return out[:num]
