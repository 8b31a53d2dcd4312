"""The fields completions and chat completions share, and how they become engine
:class:`~kvfleet.runtime.sampling_params.SamplingParams`.

OpenAI's sampling fields plus vLLM's extras (``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ``include_stop_str_in_output``,
``skip_special_tokens``, ``priority``, ``prompt_logprobs``, ``bad_words``, ``allowed_token_ids``,
``structured_outputs`` and the older ``guided_*`` names). Value ranges are checked by
``SamplingParams`` itself; :func:`build_sampling_params` turns its ``ValueError`` into a
:class:`~.common.ProtocolError` naming the field.
"""

from __future__ import annotations

from typing import Any

from kvfleet.runtime.entrypoints.openai.protocol.common import MAX_N, ProtocolError, StrictRequest
from kvfleet.runtime.sampling_params import SamplingParams


class StreamOptions(StrictRequest):
    include_usage: bool | None = False


class KvfleetResume(StrictRequest):
    """The router's resume of a request: ``output_token_ids[k]`` are the tokens choice ``k``
    (stream index: prompt ``i`` choice ``c`` is ``i * n + c``) already delivered."""

    output_token_ids: list[list[int]]


class SamplingFields(StrictRequest):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    """Served model name; None: the (only) served model."""
    n: int = 1
    temperature: float | None = None
    """None: 1.0 (OpenAI's default)."""
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    """End-user id; becomes the request's tenant under the ``fair`` scheduling policy."""
    logit_bias: dict[str, float] | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    """Lower runs first under the ``priority`` scheduling policy (vLLM semantics)."""
    request_id: str | None = None
    prompt_logprobs: int | None = None
    """vLLM's extra: top log-probabilities per prompt token (0-20; 0: the prompt token's
    only), returned as ``prompt_logprobs`` (on each completions choice; on the chat response)."""
    return_tokens_as_token_ids: bool | None = None
    """vLLM's extra: logprobs name tokens ``"token_id:{id}"`` instead of their text (None: the
    server's ``--return-tokens-as-token-ids``)."""
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    response_format: dict[str, Any] | None = None
    """OpenAI's ``text`` / ``json_object`` / ``json_schema`` (vLLM accepts it on completions too)."""
    structured_outputs: dict[str, Any] | None = None
    """vLLM's extra: one of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object``
    (plus ``disable_any_whitespace``)."""
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """vLLM's extra (prefill/decode disaggregation; docs/routing.md): ``{"do_remote_decode": true}``
    asks this replica for the prefill leg (its blocks held for a decode replica, the answer carrying
    ``kv_transfer_params``); a prefill leg's answer makes this a decode leg that pulls them."""
    # kvfleet router extensions (docs/routing.md, "Resume"); clients never send these
    kvfleet_resume: KvfleetResume | None = None
    """Continue a request another replica started from the output token ids it delivered."""
    kvfleet_token_ids: bool = False
    """Stream each delta's token ids (``kvfleet_token_ids`` on its choice), text or not."""

    def _common_checks(self) -> None:
        if self.n > MAX_N:
            raise ProtocolError(f"n must be <= {MAX_N}, got {self.n}", "n")
        if self.stream_options is not None and not self.stream:
            raise ProtocolError("stream_options is only allowed when stream is true", "stream_options")
        plp = self.prompt_logprobs
        if self.stream and plp is not None and (plp > 0 or plp == -1):
            # vLLM's rule: streamed responses have no place for them.
            raise ProtocolError("prompt_logprobs are not available when stream is true", "prompt_logprobs")

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(k): v for k, v in self.logit_bias.items()}
        except ValueError:
            raise ProtocolError("logit_bias keys must be token ids (integers, as JSON strings)", "logit_bias") from None

    def _sampling_kwargs(self) -> dict[str, Any]:
        stop = self.stop
        if isinstance(stop, str):
            stop = [stop]
        kw: dict[str, Any] = dict(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed,
            stop=list(stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self._logit_bias(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=list(self.bad_words or []),
            kv_transfer_params=self.kv_transfer_params,
        )
        return kw

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def build_sampling_params(kwargs: dict[str, Any]) -> SamplingParams:
    """SamplingParams(**kwargs), its ValueError turned into a ProtocolError naming the field."""
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        message = str(exc)
        param = message.split(" ", 1)[0]
        raise ProtocolError(message, param if param.isidentifier() else None) from None
