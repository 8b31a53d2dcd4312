"""``POST /v1/completions``: :class:`OpenAIServingCompletion`.

Prompts (strings, token ids, or lists of either) are checked (length bound, token ids in range,
prompt + ``max_tokens`` within ``max_model_len``), tokenized on the tokenizer thread and submitted
as one engine request each, ``{id}-{i}``; choice ``c`` of prompt ``i`` is index ``i * n + c``.
``echo`` prepends the prompt text (token-id prompts decoded, only then) and, with ``logprobs``,
its logprobs (built once per prompt); ``echo`` with ``max_tokens: 0`` returns the prompt only.
Structured outputs (``response_format``, ``structured_outputs``, ``guided_*``) as on chat:
:mod:`.structured_outputs`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response

from kvfleet.runtime.engine.input_processor import out_of_vocab
from kvfleet.runtime.engine.outputs import CompletionOutput, RequestOutput
from kvfleet.runtime.engine.protocol import EngineClient
from kvfleet.runtime.entrypoints.openai import logprobs as LP
from kvfleet.runtime.entrypoints.openai import protocol as P
from kvfleet.runtime.entrypoints.openai.errors import APIError, checked
from kvfleet.runtime.entrypoints.openai.serving_engine import (
    OpenAIServing,
    StreamWriter,
    body_response,
    resolve_max_tokens,
    usage,
)
from kvfleet.runtime.entrypoints.openai.structured_outputs import structured_outputs_of
from kvfleet.runtime.sampling_params import SamplingParams


def _check_token_ids(ids: list[int], vocab_size: int) -> None:
    """The engine's own check (``out_of_vocab``), answered as a 400 before anything is tokenized."""
    bad = out_of_vocab(ids, vocab_size, limit=1)  # C loops: ~0.1 s for 10M ids on the event loop
    if bad:
        raise APIError(
            400, f"prompt token id {bad[0]} is out of range [0, {vocab_size})", param="prompt", code="invalid_value"
        )


@dataclass
class _Completion:
    """One tokenized completions request, as the response builders need it."""

    body: P.CompletionRequest
    model: str
    prompt_ids: list[list[int]]
    detok: LP.TokenText
    prompt_texts: list[str] = field(default_factory=list)
    """The prompts as text (``echo`` only)."""
    request_id: str = field(default_factory=lambda: P.random_id("cmpl"))
    created: int = field(default_factory=P.now)

    @property
    def k(self) -> int:
        return self.body.logprobs if self.body.logprobs is not None else -1

    def echo_logprobs(self, i: int, out: RequestOutput | None) -> tuple[P.CompletionLogProbs, int]:
        """The echoed prompt's legacy logprobs and the text offset after it."""
        return LP.echo_logprobs(self.prompt_ids[i], out.prompt_logprobs if out else None, self.k, self.detok)

    def choices(self, i: int, out: RequestOutput | None) -> list[P.CompletionResponseChoice]:
        body, echo_only = self.body, self.body.echo_only
        # Cut back to an explicit prompt_logprobs (echo + a larger logprobs scores more).
        plp = out.prompt_logprobs if out else None
        plp_body = LP.prompt_logprobs_body(plp, self.prompt_ids[i], body.prompt_logprobs)
        # The echoed prompt's logprobs are the same for every choice of a prompt: once.
        echo_lp = self.echo_logprobs(i, out) if body.echo and body.logprobs is not None else None
        choices = []
        for c in sorted(out.outputs if out else [], key=lambda c: c.index):
            lp = None
            text = "" if echo_only else c.text
            if body.logprobs is not None:
                offset = 0
                if echo_lp is not None:
                    lp, offset = echo_lp
                if not echo_only:
                    out_lp, _ = LP.completion_logprobs(c, 0, len(c.token_ids), self.k, self.detok, offset)
                    lp = LP.join_logprobs(lp, out_lp) if lp is not None else out_lp
            if body.echo:
                text = self.prompt_texts[i] + text
            choices.append(
                P.CompletionResponseChoice(
                    index=i * body.n + c.index,
                    text=text,
                    logprobs=lp,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    prompt_logprobs=plp_body,
                )
            )
        return choices

    def response(self, final: dict[int, RequestOutput]) -> Response:
        """The JSON body (on a worker thread: with echo, logprobs 20 and n up to 128 it reaches
        hundreds of MB)."""
        choices = [ch for i in range(len(self.prompt_ids)) for ch in self.choices(i, final.get(i))]
        outputs = [c for i in range(len(self.prompt_ids)) if i in final for c in final[i].outputs]
        resp = P.CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage([len(x) for x in self.prompt_ids], outputs),
            kv_transfer_params=next((f.extra["kv_transfer_params"] for f in final.values()
                                     if "kv_transfer_params" in f.extra), None),
        )
        return body_response(resp)


class _CompletionStream(StreamWriter):
    def __init__(self, req: _Completion):
        body = req.body
        super().__init__(
            P.CompletionStreamResponse,
            request_id=req.request_id,
            created=req.created,
            model=req.model,
            n=body.n,
            prompt_lens=[len(x) for x in req.prompt_ids],
            include_usage=body.include_usage,
            echo_only=body.echo_only,
        )
        self.req = req
        self.token_ids = req.body.kvfleet_token_ids
        self.offsets: dict[int, int] = {}
        self.echoed: dict[int, tuple[P.CompletionLogProbs, int]] = {}  # per prompt: the same for each choice

    def echo(self, i: int, idx: int, out: RequestOutput) -> tuple[str, P.CompletionLogProbs | None] | None:
        if not self.req.body.echo:
            return None
        if self.req.body.logprobs is None:
            return self.req.prompt_texts[i], None
        if i not in self.echoed:
            self.echoed[i] = self.req.echo_logprobs(i, out)
        lp, self.offsets[idx] = self.echoed[i]
        return self.req.prompt_texts[i], lp

    def logprobs(self, c: CompletionOutput, idx: int) -> P.CompletionLogProbs | None:
        if self.req.body.logprobs is None:
            return None
        lp, self.offsets[idx] = LP.completion_logprobs(
            c, 0, len(c.token_ids), self.req.k, self.req.detok, self.offsets.get(idx, 0)
        )
        return lp

    def delta(self, idx: int, text: str, lp: P.CompletionLogProbs | None) -> P.CompletionStreamChoice:
        return P.CompletionStreamChoice(index=idx, text=text, logprobs=lp)

    def finish(self, idx: int, c: CompletionOutput) -> P.CompletionStreamChoice:
        return P.CompletionStreamChoice(index=idx, text="", finish_reason=c.finish_reason, stop_reason=c.stop_reason)



class OpenAIServingCompletion(OpenAIServing):
    """``/v1/completions`` over the app's engine."""

    async def create_completion(self, body: P.CompletionRequest, http_request: Request) -> Response:
        self.state.check_model(body.model)
        checked(body.check_supported)
        prompts = checked(body.prompts)
        spec, spec_param = checked(lambda: structured_outputs_of(body))
        engine = self.state.require_engine()
        prompt_ids = await self._tokenize(engine, prompts)
        params = [self._sampling_params(body, ids, engine.max_model_len) for ids in prompt_ids]
        if spec is not None:
            params = [sp.clone(structured_outputs=spec) for sp in params]
        detok = LP.TokenText(engine.tokenizer, self.as_token_ids(body))
        req = _Completion(body, self.state.response_model(body.model), prompt_ids, detok)
        if body.request_id:
            req.request_id = body.request_id
        if body.echo:
            req.prompt_texts = await self._prompt_texts(engine, prompts, prompt_ids)
        requests = [(ids, sp, f"{req.request_id}-{i}") for i, (ids, sp) in enumerate(zip(prompt_ids, params))]
        gen = await self.submit(engine, http_request, requests, body, spec_param)
        if not body.stream:
            final = await self.collect(gen)
            return await asyncio.to_thread(req.response, final)  # off the event loop: /health keeps answering
        return self.stream_response(gen, _CompletionStream(req))

    async def _tokenize(self, engine: EngineClient, prompts: list[str | list[int]]) -> list[list[int]]:
        """Each prompt's token ids: strings tokenized on the tokenizer thread, ids checked."""
        tokenizer, max_model_len = engine.tokenizer, engine.max_model_len
        for p in prompts:
            if isinstance(p, str):
                self.check_prompt_bound(p, max_model_len, "prompt")
            else:  # token ids: one that fills the context alone is refused before its ids are checked
                resolve_max_tokens(None, len(p), max_model_len, "max_tokens", "prompt")
        texts = [p for p in prompts if isinstance(p, str)]
        encoded = iter(await self.on_tokenizer_thread(lambda: [tokenizer.encode(t) for t in texts]) if texts else [])
        prompt_ids: list[list[int]] = []
        for p in prompts:
            ids = next(encoded) if isinstance(p, str) else list(p)
            if not isinstance(p, str):
                _check_token_ids(ids, engine.vocab_size)
            if not ids:
                raise APIError(
                    400, "prompt must not be empty (it tokenizes to no tokens)", param="prompt", code="invalid_value"
                )
            prompt_ids.append(ids)
        return prompt_ids

    @staticmethod
    def _sampling_params(body: P.CompletionRequest, ids: list[int], max_model_len: int) -> SamplingParams:
        # echo with max_tokens 0: the engine generates one token, which is not returned (vLLM).
        requested = 1 if body.echo_only else body.max_tokens
        max_tokens = resolve_max_tokens(requested, len(ids), max_model_len, "max_tokens", "prompt")
        return checked(lambda: body.to_sampling_params(max_tokens))

    async def _prompt_texts(
        self, engine: EngineClient, prompts: list[str | list[int]], prompt_ids: list[list[int]]
    ) -> list[str]:
        """The prompts as text, for ``echo``: token-id prompts decoded (as vLLM does) on the
        tokenizer thread (a 32 MiB body of id lists takes seconds to decode)."""
        tokenizer = engine.tokenizer
        id_prompts = [ids for p, ids in zip(prompts, prompt_ids) if not isinstance(p, str)]
        decoded = iter(
            await self.on_tokenizer_thread(lambda: [tokenizer.decode(x) for x in id_prompts]) if id_prompts else []
        )
        return [p if isinstance(p, str) else next(decoded) for p in prompts]
