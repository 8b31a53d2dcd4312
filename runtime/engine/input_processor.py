"""The engine's input side: the one place a request's prompt and parameters are checked.

:class:`InputProcessor` turns ``(request_id, prompt, SamplingParams, ...)`` into a
:class:`PreparedRequest`: the prompt tokenized (text) or checked (token ids: integers in the
vocabulary), its length checked against ``max_model_len``, the token controls checked
(``logit_bias`` / ``allowed_token_ids`` in the vocabulary) and ``bad_words`` tokenized, the
model's extra EOS ids added as stop ids, one scheduler ``Request`` per output sequence
(``n > 1`` fans out into ``{id}-{i}``, seeds ``seed + i``) and the output side's
:class:`~kvfleet.runtime.engine.output_processor.RequestState`; a structured-output spec starts
compiling. It touches no engine state (the async engine calls it on the event loop).

The rules themselves are plain functions, :func:`out_of_vocab` and :func:`fits_context`; the
HTTP server, which answers bad prompts early (before tokenizing the rest, with its own error
bodies), calls the same functions. Torch-free.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvfleet.runtime.core.request import Request
from kvfleet.runtime.engine.output_processor import RequestState, SequenceState
from kvfleet.runtime.lora_request import LoRARequest
from kvfleet.runtime.sampling_params import SamplingParams, StructuredOutputsParams


def out_of_vocab(ids: list[int], vocab_size: int, limit: int = 5) -> list[int]:
    """The first ``limit`` ids of ``ids`` outside ``[0, vocab_size)``, in order (empty: all
    in range). All in range is found at C speed (~0.1 s for 10M ids)."""
    if not ids or (0 <= min(ids) and max(ids) < vocab_size):
        return []
    bad: list[int] = []
    for t in ids:
        if not 0 <= t < vocab_size:
            bad.append(t)
            if len(bad) == limit:
                break
    return bad


def fits_context(num_prompt_tokens: int, num_output_tokens: int, max_model_len: int) -> bool:
    """Whether a prompt and the output tokens it must have room for fit in ``max_model_len``
    (the engine asks room for none: a prompt of ``max_model_len`` tokens still runs; the
    OpenAI server for ``max_tokens``, at least one)."""
    return num_prompt_tokens + num_output_tokens <= max_model_len


@dataclass
class PreparedRequest:
    """A validated, tokenized request, ready for ``LLMEngine.add_prepared`` (the async engine
    prepares in the caller's thread and adds in the engine thread): the output side's
    ``state`` and one scheduler ``Request`` per output sequence. ``grammar``: the future of its
    compiled grammar (structured outputs), None when unconstrained."""

    state: RequestState
    requests: list[Request] = field(default_factory=list)
    grammar: Future | None = None


class InputProcessor:
    """Checks and prepares requests for one engine.

    Args:
        tokenizer: the model's tokenizer.
        vocab_size: the model's vocabulary (token ids must be below it).
        max_model_len: the longest sequence (a longer prompt is refused).
        eos_token_id: the tokenizer's EOS token id (None: none).
        extra_eos_ids: further EOS ids of the model's generation config (added as stop ids).
        prompt_logprobs_error: why prompt logprobs cannot be computed for this model (None: they can).
        grammar_init: starts compiling a structured-output spec, returns its future.
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        max_model_len: int,
        eos_token_id: int | None,
        extra_eos_ids: list[int],
        prompt_logprobs_error: str | None,
        grammar_init: Callable[[StructuredOutputsParams], Future],
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.extra_eos_ids = list(extra_eos_ids)
        self.prompt_logprobs_error = prompt_logprobs_error
        self.grammar_init = grammar_init

    def process(
        self,
        request_id: str,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        *,
        priority: int = 0,
        tenant: str | None = None,
        arrival_time: float | None = None,
        lora: LoRARequest | None = None,
        resume_output_ids: list[list[int]] | None = None,
    ) -> PreparedRequest:
        """Validate and tokenize a request (thread-safe as far as the tokenizer is).

        ``resume_output_ids`` (one list per output sequence, ``n`` of them) resumes a request
        that another replica started (docs/routing.md, "Resume"): each sequence starts with
        these output tokens already generated (they count toward ``max_tokens``, penalties,
        ``min_tokens``, the seeded generator's step and the grammar), and only later tokens and
        their text are reported.

        Raises:
            ValueError: with the offending parameter's name first: ``request_id`` (not a
                non-empty string), ``prompt`` (empty, wrong type, token ids out of the
                vocabulary, or longer than ``max_model_len``), ``sampling_params`` (wrong
                type), ``prompt_logprobs`` (asked of a model whose logits the runner cannot
                reproduce), ``priority`` (not an int), ``logit_bias`` / ``allowed_token_ids``
                (token ids out of the vocabulary). A structured-output spec starts compiling
                here (``grammar``); its errors come when the engine adds the request.
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        if sampling_params.prompt_logprobs is not None and self.prompt_logprobs_error:
            raise ValueError(f"prompt_logprobs are not supported for this model: {self.prompt_logprobs_error}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        prompt_text, prompt_ids = self._prompt(prompt)
        if resume_output_ids is not None:
            self._check_resume(resume_output_ids, len(prompt_ids), sampling_params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        params = sampling_params = self._check_token_controls(sampling_params)
        if self.extra_eos_ids and not params.ignore_eos:
            params = params.clone(stop_token_ids=list(params.stop_token_ids) + self.extra_eos_ids)
        state = RequestState(request_id, prompt_text, prompt_ids, sampling_params, arrival, priority,
                             lora_name=lora.lora_name if lora else None, lora_int_id=lora.lora_int_id if lora else 0)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        requests: list[Request] = []
        n = params.n
        for i in range(n):
            child_params = params
            if n > 1:
                # Only the first child computes the prompt logprobs: the prompt is the same.
                # With prefix caching on, the others wait for it to compute the prompt (their
                # prompt_leader), then take its full blocks from the prefix cache.
                child_params = params.clone(
                    n=1,
                    seed=None if params.seed is None else params.seed + i,
                    prompt_logprobs=params.prompt_logprobs if i == 0 else None,
                )
            child_id = request_id if n == 1 else f"{request_id}-{i}"
            requests.append(Request(
                child_id, prompt_ids, child_params, self.eos_token_id, arrival_time=arrival, priority=priority,
                tenant=tenant, prompt_leader=requests[0] if i else None, lora_name=state.lora_name,
                lora_int_id=state.lora_int_id,
            ))
            resumed = list(resume_output_ids[i]) if resume_output_ids is not None else []
            # Resumed tokens are output already made (like a preempted request's): prefilled again
            # with the prompt, never reported again; the detokenizer reads them as context.
            requests[-1].output_token_ids = resumed
            state.seqs.append(SequenceState.start(self.tokenizer, child_id, i, prompt_ids + resumed, child_params))
        spec = params.structured_outputs
        return PreparedRequest(state, requests, self.grammar_init(spec) if spec is not None else None)

    def _prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """``(prompt text or None, token ids)``, checked."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            prompt_text, prompt_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            prompt_text, prompt_ids = None, list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt_ids):
                raise ValueError("prompt token ids must be integers")
            bad = out_of_vocab(prompt_ids, self.vocab_size)
            if bad:
                raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}), got {bad}")
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not prompt_ids:
            raise ValueError("prompt must not be empty (it has no tokens)")
        if not fits_context(len(prompt_ids), 0, self.max_model_len):
            raise ValueError(f"prompt is {len(prompt_ids)} tokens, longer than max_model_len ({self.max_model_len})")
        return prompt_text, prompt_ids

    def _check_resume(self, resume: list[list[int]], num_prompt: int, params: SamplingParams) -> None:
        """ValueError (naming ``resume_output_ids``) unless ``resume`` holds ``n`` lists of
        vocabulary ids, each shorter than ``max_tokens`` and fitting ``max_model_len``."""
        name = "resume_output_ids"
        if not isinstance(resume, (list, tuple)) or len(resume) != params.n:
            raise ValueError(f"{name} must hold one list of token ids per output sequence (n={params.n})")
        if params.prompt_logprobs is not None:
            raise ValueError(f"{name} cannot be combined with prompt_logprobs")
        for ids in resume:
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                             for t in ids):
                raise ValueError(f"{name} must be lists of integer token ids")
            bad = out_of_vocab(list(ids), self.vocab_size)
            if bad:
                raise ValueError(f"{name} token ids must be in [0, {self.vocab_size}), got {bad}")
            if params.max_tokens is not None and len(ids) >= params.max_tokens:
                raise ValueError(f"{name} has {len(ids)} tokens, not fewer than max_tokens ({params.max_tokens})")
            if not fits_context(num_prompt + len(ids), 1, self.max_model_len):
                raise ValueError(f"prompt and {name} do not fit max_model_len ({self.max_model_len})")

    def _check_token_controls(self, params: SamplingParams) -> SamplingParams:
        """``logit_bias`` / ``allowed_token_ids`` in the vocabulary (ValueError naming the field);
        ``bad_words`` tokenized into ``bad_words_token_ids`` (each word with and without a leading
        space, as vLLM)."""
        for name, ids in (("logit_bias", list(params.logit_bias or ())),
                          ("allowed_token_ids", params.allowed_token_ids or [])):
            bad = out_of_vocab(ids, self.vocab_size)
            if bad:
                raise ValueError(f"{name} token ids must be in [0, {self.vocab_size}), got {bad}")
        if not params.bad_words:
            return params
        seqs: list[list[int]] = []
        for word in params.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in seqs:
                    seqs.append(ids)
        return params.clone(bad_words_token_ids=seqs)
