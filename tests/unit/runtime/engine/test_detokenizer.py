"""Incremental detokenization and stop strings, with the default model's real tokenizer."""

from __future__ import annotations

import pytest

from kvfleet.runtime.engine.detokenizer import IncrementalDetokenizer
from kvfleet.runtime.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2.tokenizer


def feed(tokenizer, text: str, params: SamplingParams, prompt="Say:"):
    """Feed ``text``'s tokens one at a time; return (detokenizer, visible texts per step, stopped)."""
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), params)
    visible = []
    stopped = False
    for i, t in enumerate(ids, start=1):
        stopped = detok.update([t], i)
        visible.append(detok.output_text)
        if stopped:
            break
    return detok, visible, stopped


@pytest.mark.parametrize("text", ["Hello world, how are you?", "Héllo wörld 🐉 — naïve café ✓ 日本語", "  two  spaces\n\nand\ttabs"])
def test_incremental_text_equals_full_decode(tokenizer, text):
    detok, visible, stopped = feed(tokenizer, text, SamplingParams())
    ids = tokenizer.encode(text)
    assert not stopped
    assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=True)
    for before, after in zip(visible, visible[1:]):
        assert after.startswith(before)  # text only grows
    assert all("\ufffd" not in v for v in visible)


def test_stop_string_in_the_middle_of_a_token(tokenizer):
    text = "Hello world, how are you?"
    assert "Ġworld" in tokenizer.convert_ids_to_tokens(tokenizer.encode(text))
    detok, visible, stopped = feed(tokenizer, text, SamplingParams(stop=["wor"]))
    assert stopped and detok.stop_reason == "wor"
    assert detok.output_text == "Hello "
    detok, _, stopped = feed(tokenizer, text, SamplingParams(stop=["wor"], include_stop_str_in_output=True))
    assert stopped and detok.output_text == "Hello wor"


def test_partial_stop_is_held_back_never_retracted(tokenizer):
    text = "Hello world is big. Hello world peace now"
    detok, visible, stopped = feed(tokenizer, text, SamplingParams(stop=["world peace"]))
    assert stopped and detok.output_text == "Hello world is big. Hello "
    for before, after in zip(visible, visible[1:]):
        assert after.startswith(before)
    # While "world" could still become "world peace", it is not shown.
    assert "Hello world is big. Hello world" not in visible


def test_first_of_several_stops_wins_and_min_tokens_delays(tokenizer):
    text = "one two three four five"
    detok, _, stopped = feed(tokenizer, text, SamplingParams(stop=["four", "two"]))
    assert stopped and detok.stop_reason == "two" and detok.output_text == "one "
    # "two" is complete at token 2 but min_tokens=3 is not reached yet; "four" then matches.
    detok, _, stopped = feed(tokenizer, text, SamplingParams(stop=["four", "two"], min_tokens=3))
    assert stopped and detok.stop_reason == "four" and detok.output_text == "one two three "


def test_finish_releases_held_text_and_eos_is_not_text(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop=["xyz"]))
    ids = tokenizer.encode("abc x")
    for i, t in enumerate(ids, start=1):
        detok.update([t], i)
    assert detok.output_text == "abc "
    detok.finish()
    assert detok.output_text == "abc x"
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams())
    detok.update(tokenizer.encode("Hi") + [tokenizer.eos_token_id], 2, skip_last=True)
    assert detok.output_text == "Hi"


def test_backend_decode_is_the_tokenizers_own(tokenizer):
    """The detokenizer calls the Rust backend's decode directly only where that is exactly
    ``tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)``."""
    import random

    from kvfleet.runtime.engine.detokenizer import _backend_decode

    fast = _backend_decode(tokenizer)
    assert fast is not None  # the default model's tokenizer takes the fast path
    rng = random.Random(0)
    vocab = len(tokenizer)
    for _ in range(2000):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        for skip in (True, False):
            assert fast(ids, skip_special_tokens=skip) == tokenizer.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)

    class OwnDecode(type(tokenizer)):
        def decode(self, *a, **k):
            return "x"

    own = object.__new__(OwnDecode)
    assert _backend_decode(own) is None  # an overridden decode is always called
    assert _backend_decode(object()) is None
