"""``StructuredOutputManager``: compiles grammars off the engine loop, caches them, and masks
the logits of the constrained rows of a step (the shape of vLLM v1's ``StructuredOutputManager``
with its xgrammar backend).

* :meth:`StructuredOutputManager.grammar_init` hands a spec to a small thread pool and returns
  a ``Future`` of the compiled grammar; futures are cached by the spec's
  :meth:`~kvfleet.runtime.sampling_params.StructuredOutputsParams.key` (LRU, ``cache_size``
  entries), so concurrent requests with one schema compile it once and later ones find it
  done. The engine waits on the future before it queues the request (the async engine awaits
  it on the event loop: only that request waits, never the batch or the engine loop); a
  compile error is raised there (``StructuredOutputError``, HTTP 400).
* :meth:`StructuredOutputManager.new_grammar` makes the per-sequence matcher.
* :meth:`StructuredOutputManager.apply_bitmask` fills one int32 bitmask row per constrained
  row of the step's logits (CPU, xgrammar) and applies them batched in place
  (``xgrammar.apply_token_bitmask_inplace``: a CPU loop on CPU, a Triton kernel on CUDA),
  before any penalty or temperature. Rows without a grammar are not touched, and a step without
  a constrained row never calls it.

The ``xgrammar.TokenizerInfo`` is built on first use (about 0.2 s for a 49k vocabulary), with
``vocab_size`` = the logits' width (the model's vocabulary, which may differ from the
tokenizer's) and the engine's EOS ids as the grammar's stop tokens.
"""

from __future__ import annotations

import collections
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import xgrammar as xgr

from kvfleet.runtime.core.request import GrammarState
from kvfleet.runtime.sampling_params import StructuredOutputsParams
from kvfleet.runtime.structured_output.grammar import Grammar, compile_spec

XGRAMMAR_CACHE_BYTES = 512 * 1024**2
"""Bound of xgrammar's own compiler cache (vLLM's ``VLLM_XGRAMMAR_CACHE_MB`` default, 512 MiB):
unbounded, every distinct schema a client sends would stay in memory."""


class StructuredOutputManager:
    """Grammar compilation, its cache, and the per-step bitmask.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: width of the logits (the model's vocabulary size).
        stop_token_ids: tokens that end a complete grammar (EOS and the model's other EOS ids).
        max_workers: compile threads (default: half the CPUs, 1 to 4, as vLLM sizes its pool);
            each compile also uses up to ``compile_threads`` of xgrammar's own threads.
        cache_size: compiled grammars kept (least recently used dropped first).
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: list[int],
        *,
        max_workers: int | None = None,
        compile_threads: int = 2,
        cache_size: int = 256,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = [t for t in stop_token_ids if t is not None]
        self.compile_threads = compile_threads
        self.cache_size = cache_size
        workers = max_workers or max(1, min(4, (os.cpu_count() or 2) // 2))
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvfleet-grammar")
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple, Future] = collections.OrderedDict()
        self._cache_lock = threading.Lock()
        self._bitmask: torch.Tensor | None = None
        self.num_compiles = 0
        """Grammars compiled so far (cache misses)."""

    # ------------------------------------------------------------------ compilation
    def compiler(self) -> xgr.GrammarCompiler:
        """The xgrammar compiler (built on first call, thread-safe)."""
        with self._compiler_lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None
                )
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=self.compile_threads, cache_limit_bytes=XGRAMMAR_CACHE_BYTES
                )
            return self._compiler

    def _compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        self.num_compiles += 1
        return compile_spec(self.compiler(), spec)

    def grammar_init(self, spec: StructuredOutputsParams) -> Future:
        """A future of ``spec`` compiled (``xgrammar.CompiledGrammar``); its exception is a
        ``StructuredOutputError``. Cached: the same spec returns the same future."""
        key = spec.key()
        with self._cache_lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return future

    def new_grammar(self, compiled: xgr.CompiledGrammar) -> Grammar:
        """A fresh matcher for one sequence."""
        return Grammar(compiled)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ the step
    def apply_bitmask(self, logits: torch.Tensor, grammars: list[GrammarState | None],
                      drafts: list[list[int]] | None = None) -> int:
        """Mask, in place, the logits of every row with a grammar: tokens the grammar does not
        allow next become ``-inf``.

        Args:
            logits: ``[R, vocab_size]`` float32 (any device): one row per entry of ``grammars``,
                or with ``drafts``, ``1 + len(drafts[i])`` consecutive rows for entry ``i``.
            grammars: the step's sampling sequences' grammar matchers (None: unconstrained).
            drafts: per sequence, the speculative tokens its extra rows verify (row ``j`` of a
                sequence is masked by the grammar's state after ``draft[:j]``); None: none.

        Returns: the number of rows masked.
        """
        if not any(g is not None for g in grammars):
            return 0
        starts, num_rows = [], 0
        for i in range(len(grammars)):
            starts.append(num_rows)
            num_rows += 1 + (len(drafts[i]) if drafts else 0)
        width = (logits.shape[1] + 31) // 32
        if self._bitmask is None or self._bitmask.shape[0] < num_rows or self._bitmask.shape[1] != width:
            self._bitmask = xgr.allocate_token_bitmask(max(num_rows, 16), logits.shape[1])
        bitmask = self._bitmask
        masked = []
        for i, g in enumerate(grammars):
            if g is None:
                continue
            draft = drafts[i] if drafts else []
            flags = g.fill_bitmasks(bitmask, starts[i], draft) if draft else [g.fill_bitmask(bitmask, starts[i])]
            masked.extend(starts[i] + j for j, f in enumerate(flags) if f)
        if not masked:
            return 0
        mask = bitmask[:num_rows]
        if logits.device.type != "cpu":
            mask = mask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, mask, indices=masked)
        return len(masked)
