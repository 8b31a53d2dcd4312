"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes): :class:`OpenAIServingTokenization`.

``/tokenize`` takes a ``prompt`` (encoded as ``/v1/completions`` encodes it: special tokens added
by default) or chat ``messages`` (rendered by :meth:`OpenAIServingChat.prompt_ids`, ``tools`` and a
request's own ``chat_template`` included, so ``count`` equals the chat completion's ``usage.prompt_tokens``) and answers
``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` with
``return_token_strs``). ``/detokenize`` takes ``tokens`` (each in ``[0, vocab_size)``) and
answers ``{"prompt"}``. Both on the tokenizer thread.
"""

from __future__ import annotations

from kvfleet.runtime.entrypoints.openai import protocol as P
from kvfleet.runtime.entrypoints.openai.errors import APIError
from kvfleet.runtime.entrypoints.openai.serving_chat import OpenAIServingChat
from kvfleet.runtime.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    """``/tokenize`` and ``/detokenize`` over the app's engine's tokenizer."""

    def __init__(self, state, chat: OpenAIServingChat):
        super().__init__(state)
        self.chat = chat

    async def tokenize(self, body: P.TokenizeRequest) -> P.TokenizeResponse:
        self.state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt", code="invalid_value")
        engine = self.state.require_engine()
        tokenizer = engine.tokenizer
        if body.messages is not None:
            if not body.messages:
                raise APIError(400, "messages must not be empty", param="messages", code="invalid_value")
            chat = P.ChatCompletionRequest(
                messages=body.messages,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                chat_template_kwargs=body.chat_template_kwargs,
                chat_template=body.chat_template,
            )
            ids = await self.chat.prompt_ids(engine, chat, body.tools, add_special_tokens=bool(body.add_special_tokens))
        else:
            text = body.prompt
            self.check_prompt_bound(text, engine.max_model_len, "prompt")
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await self.on_tokenizer_thread(lambda: tokenizer.encode(text, add_special_tokens=special))
        strs = (
            await self.on_tokenizer_thread(lambda: tokenizer.convert_ids_to_tokens(ids))
            if body.return_token_strs
            else None
        )
        return P.TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids, token_strs=strs)

    async def detokenize(self, body: P.DetokenizeRequest) -> P.DetokenizeResponse:
        self.state.check_model(body.model)
        engine = self.state.require_engine()
        bad = [t for t in body.tokens if not 0 <= t < engine.vocab_size]
        if bad:
            raise APIError(
                400,
                f"token ids must be in [0, {engine.vocab_size}), got {bad[:5]}",
                param="tokens",
                code="invalid_value",
            )
        tokens = body.tokens
        return P.DetokenizeResponse(prompt=await self.on_tokenizer_thread(lambda: engine.tokenizer.decode(tokens)))
