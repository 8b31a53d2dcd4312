"""Incremental detokenization with stop strings matched on text.

:class:`IncrementalDetokenizer` keeps two offsets into the token list, as HF's
``TextStreamer`` and vLLM's ``detokenize_incrementally`` do (``prefix_offset``: start of a few
tokens of context; ``read_offset``: end of the text already produced) and releases new text
only when it does not end in an incomplete UTF-8 sequence (U+FFFD). Stop strings are searched
in the produced text (they may end mid-token or span tokens); a suffix that could still
become a stop string is held back, so text is never emitted and taken back. On a match the
output is cut before the stop string (after it with ``include_stop_str_in_output``). Stop
strings count only once ``min_tokens`` tokens were generated (vLLM's rule).
Why: docs/engine.md, "Detokenization".
"""

from __future__ import annotations

from kvfleet.runtime.sampling_params import SamplingParams

# Tokens of prompt context kept before the output, for correct spacing of the first
# output token (vLLM uses 5 as well: INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
_CONTEXT_TOKENS = 5


_BACKEND_DECODE: dict[type, bool] = {}


def _backend_decode(tokenizer):
    """The Rust ``tokenizers.Tokenizer.decode`` of ``tokenizer`` when calling it gives what
    ``tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)``
    gives: a transformers ``TokenizersBackend`` (fast tokenizer) that overrides neither
    ``decode`` nor ``_decode``. None otherwise (the tokenizer's own decode is used)."""
    cls = type(tokenizer)
    ok = _BACKEND_DECODE.get(cls)
    if ok is None:
        ok = False
        try:
            from transformers.tokenization_utils_base import PreTrainedTokenizerBase
            from transformers.tokenization_utils_tokenizers import TokenizersBackend

            ok = (issubclass(cls, TokenizersBackend) and cls.decode is PreTrainedTokenizerBase.decode
                  and cls._decode is TokenizersBackend._decode)
        except (ImportError, AttributeError):
            pass
        _BACKEND_DECODE[cls] = ok
    backend = getattr(tokenizer, "_tokenizer", None) if ok else None
    return getattr(backend, "decode", None)


class IncrementalDetokenizer:
    """Per-sequence detokenization state.

    Args:
        tokenizer: a transformers tokenizer.
        prompt_token_ids: the prompt (its last few tokens give context for spacing).
        params: the request's sampling parameters (``stop``, ``include_stop_str_in_output``,
            ``skip_special_tokens``, ``min_tokens``).

    Attributes:
        text: all output text produced so far, including held-back text.
        stop_reason: the stop string that matched, once one did.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.skip_special_tokens = params.skip_special_tokens
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.tokens: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.text = ""
        self.stop_reason: str | None = None
        self.stops = list(params.stop)
        self.max_stop_len = max((len(s) for s in self.stops), default=0)
        self._finished = False
        self._bind_decode()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _bind_decode(self) -> None:
        # Same text, half the time: for a transformers fast tokenizer whose decode is the
        # library's own, decode(ids, clean_up_tokenization_spaces=False) is exactly its Rust
        # backend's decode(ids, skip_special_tokens); call that directly.
        fast = _backend_decode(self.tokenizer)
        if fast is not None:
            sst = self.skip_special_tokens
            self._decode = lambda ids: fast(ids, skip_special_tokens=sst)

    def update(self, new_token_ids: list[int], num_output_tokens: int, skip_last: bool = False) -> bool:
        """Add generated tokens.

        Args:
            new_token_ids: tokens appended to the output since the previous call.
            num_output_tokens: output length after them (for ``min_tokens``).
            skip_last: do not detokenize the last of them (it is an EOS / stop token id that
                ends the sequence and is not part of the text, vLLM's rule), unless
                ``include_stop_str_in_output``.

        Returns: True when a stop string matched (``stop_reason`` is set and ``text`` cut).
        """
        if self._finished:
            return self.stop_reason is not None
        if skip_last and not self.params.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        for token in new_token_ids:
            self.tokens.append(token)
            prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
            new_text = self._decode(self.tokens[self.prefix_offset :])
            if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
                delta = new_text[len(prefix_text) :]
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.tokens)
                before = len(self.text)
                self.text += delta
                if self.stops and num_output_tokens >= self.params.min_tokens and self._check_stop(before):
                    return True
        return False

    def _check_stop(self, new_text_start: int) -> bool:
        # Only matches that end in the new text are new: start each search just far
        # enough back (matches wholly inside older text were already ruled out, or fell
        # before min_tokens).
        best = -1
        best_stop = None
        for stop in self.stops:
            idx = self.text.find(stop, max(0, new_text_start - len(stop) + 1))
            if idx != -1 and (best == -1 or idx < best):
                best, best_stop = idx, stop
        if best_stop is None:
            return False
        end = best + len(best_stop) if self.params.include_stop_str_in_output else best
        self.text = self.text[:end]
        self.stop_reason = best_stop
        self._finished = True
        return True

    def finish(self) -> None:
        """The sequence ended (EOS, length, abort): release held-back text."""
        self._finished = True

    @property
    def output_text(self) -> str:
        """Text safe to show now: everything, minus a suffix that might still become a stop
        string (nothing is held back once the sequence finished)."""
        end = self.visible_length
        return self.text if end == len(self.text) else self.text[:end]

    @property
    def visible_length(self) -> int:
        """``len(output_text)``, without copying the text. It never shrinks: text once shown
        is never taken back (a stop string's cut falls inside held-back text)."""
        text = self.text
        if self._finished or not self.stops:
            return len(text)
        hold = 0
        for stop in self.stops:
            # Longest proper prefix of `stop` that is a suffix of the text.
            for k in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:k]):
                    hold = k
                    break
        return len(text) - hold
