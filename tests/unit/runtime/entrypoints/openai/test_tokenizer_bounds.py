"""runtime/entrypoints/openai/tokenizer_bounds.py: the prompt length bound on the real SmolLM2
tokenizer (it holds on adversarial texts, and is tight) and on real ``tokenizers`` pipelines that
drop or fuse characters (no bound). (The server's use of it: test_limits.py.)"""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kvfleet.runtime.entrypoints.openai.tokenizer_bounds import PromptLengthBound, prompt_length_bound

L_SMOLLM2 = 81
"""The longest SmolLM2 token: "\\n" and 80 spaces."""


@pytest.fixture(scope="module")
def tok(smollm2):
    return smollm2.tokenizer


@pytest.mark.slow
def test_bound_of_the_default_tokenizer_holds_and_is_tight(tok):
    bound = prompt_length_bound(tok)
    assert bound is not None and bound.chars_per_token == L_SMOLLM2
    longest = "\n" + " " * 80
    assert len(tok.encode(longest * 37)) == 37 == bound.min_tokens(longest * 37)  # tight
    # bytes missing from the GGUF vocabulary vanish: such characters are not counted
    assert tok.encode("\x04" * 50) == [] and "\x04" in bound.ignored_chars
    assert bound.min_tokens("\x04" * 10_000) == 0
    rng = random.Random(0)
    pieces = ["\n", " ", "\t", "\x04", "a", "hello", " world", "<|im_start|>", "é", "你好", "😀", "\ufffd", longest,
              "\x00", "\x7f", " " * 30]  # fmt: skip
    alphabet = [chr(c) for c in [*range(0x250), *range(0x4E00, 0x4E40), 0x1F600, 0x10FFFD]]
    for trial in range(200):
        if trial % 2:
            text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 400)))
        else:
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 2000)))
        assert len(tok.encode(text)) >= bound.min_tokens(text), repr(text[:80])


def _fast(tk: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tk)


def _byte_level_bpe(normalizer=None) -> Tokenizer:
    """A real byte-level BPE trained on a few sentences (every byte in its alphabet)."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    if normalizer is not None:
        tk.normalizer = normalizer
    corpus = ["the cat sat on the mat", "kvfleet serves language models", "caf\u00e9 na\u00efve r\u00e9sum\u00e9"] * 20
    tk.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       special_tokens=["<|endoftext|>"]))  # fmt: skip
    return tk


def test_bound_of_other_byte_level_pipelines():
    plain = prompt_length_bound(_fast(_byte_level_bpe()))
    assert plain is not None and plain.ignored_chars == ""
    # NFC composes up to 4 code points into one: the bound allows for it
    nfc = prompt_length_bound(_fast(_byte_level_bpe(normalizers.NFC())))
    assert nfc is not None and nfc.chars_per_token == 4 * plain.chars_per_token
    nfc_tok = _fast(_byte_level_bpe(normalizers.NFC()))
    composable = "\u03b1\u0313\u0300\u0345" * 200  # U+1F82 decomposed: 4 code points -> 1
    assert len(nfc_tok.encode(composable)) >= nfc.min_tokens(composable)
    rng = random.Random(1)
    for _ in range(50):
        text = "".join(rng.choice(["the", " cat", "\u00e9", "e\u0301", "\u1f82", "\u03b1\u0313\u0300\u0345", "<|endoftext|>"])
                       for _ in range(rng.randint(1, 300)))  # fmt: skip
        assert len(nfc_tok.encode(text)) >= nfc.min_tokens(text)
        assert len(_fast(_byte_level_bpe()).encode(text)) >= plain.min_tokens(text)


def test_pipelines_that_drop_or_fuse_characters_give_no_bound():
    # BERT: the normalizer drops control characters, the pre-tokenizer drops whitespace, and
    # WordPiece maps a word longer than max_input_chars_per_word to one [UNK].
    bert = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##a": 2}, unk_token="[UNK]"))
    bert.normalizer = normalizers.BertNormalizer()
    bert.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    fast = _fast(bert)
    assert len(fast.encode(" " * 1000 + "a" * 1000, add_special_tokens=False)) == 1  # 2000 characters, 1 token
    assert prompt_length_bound(fast) is None
    # a byte-level BPE behind a whitespace-dropping pre-tokenizer or a deleting normalizer
    ws = _byte_level_bpe()
    ws.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.ByteLevel()])
    assert len(_fast(ws).encode(" " * 5000)) == 0 and prompt_length_bound(_fast(ws)) is None
    deleting = _byte_level_bpe(normalizers.Replace(" ", ""))
    assert len(_fast(deleting).encode(" " * 5000)) == 0 and prompt_length_bound(_fast(deleting)) is None
    # a character-level BPE without unk_token silently drops characters it does not know
    chars = Tokenizer(models.BPE({"a": 0, "b": 1}, []))
    assert chars.encode("\u4e00" * 100).ids == [] and prompt_length_bound(_fast(chars)) is None


def test_bound_type_is_plain_data():
    b = PromptLengthBound(chars_per_token=4, ignored_chars="\x00")
    assert b.min_tokens("abcd" * 3 + "\x00" * 100) == 3 and b.min_tokens("abcde") == 2 and b.min_tokens("") == 0


def _large_bpe() -> Tokenizer:
    """A BPE of ~30k tokens (every 2- and 3-letter string, 4-letter ones after) and their merges."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = {c: i for i, c in enumerate(letters)}
    merges = []
    for length in (2, 3, 4):
        for tail in [s for s in vocab if len(s) == length - 1]:
            for c in letters:
                if len(vocab) < 30_000:
                    vocab[tail + c] = len(vocab)
                    merges.append((tail, c))
    return Tokenizer(models.BPE(vocab, merges, unk_token="a"))


def test_pipeline_spec_is_the_tokenizers_own_without_the_vocabulary():
    import json

    from kvfleet.runtime.entrypoints.openai.tokenizer_bounds import _pipeline_spec

    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.normalizer = normalizers.BertNormalizer()
    unigram = Tokenizer(models.Unigram([("<unk>", 0.0), ("a", -1.0)], 0, True))
    for tk in (_byte_level_bpe(normalizers.NFC()), _large_bpe(), wordpiece, unigram):
        full = json.loads(tk.to_str())
        spec = _pipeline_spec(tk)
        assert spec["normalizer"] == full["normalizer"] and spec["pre_tokenizer"] == full["pre_tokenizer"]
        assert "vocab" not in spec["model"] and "merges" not in spec["model"]
        assert spec["model"] == {k: v for k, v in full["model"].items() if k in spec["model"]}
        assert {"type", "byte_fallback"} <= spec["model"].keys() or spec["model"]["type"] == "WordPiece"


def test_the_bound_never_parses_the_whole_tokenizer():
    # The server computes the bound at start; Gemma 3's 262k-entry vocabulary's JSON parsed whole and
    # decoded at once peaked 292 MB over the server's memory (docs/performance.md, "Start-up to ready").
    import json
    import tracemalloc

    fast = _fast(_large_bpe())
    tracemalloc.start()
    try:
        json.loads(fast.backend_tokenizer.to_str())
        whole = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        assert prompt_length_bound(fast) is not None
        mine = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    # parsing the whole JSON alone (its string and objects) peaked at `whole`; the bound holds one
    # chunk of ids and strings at a time (no vocabulary dict either)
    assert mine < whole / 4, (mine, whole)


def test_longest_token_by_ids_is_the_vocabularys():
    from kvfleet.runtime.entrypoints.openai.tokenizer_bounds import _longest_token

    def by_dict(tk: Tokenizer) -> int:  # every entry of get_vocab(), as the bound read it before
        vocab = tk.get_vocab(with_added_tokens=True)
        decoded = tk.decode_batch([[i] for i in sorted(vocab.values())], skip_special_tokens=False)
        return max([1, *map(len, vocab), *map(len, decoded)])

    holes = Tokenizer(models.BPE({"a": 0, "b": 1, "bbbbbbbbbb": 9, "bb": 3}, [("b", "b")]))  # id 9 > the size
    added = _byte_level_bpe()
    added.add_special_tokens(["<|a very long special token|>"])
    for tk in (_byte_level_bpe(normalizers.NFC()), added, _large_bpe(), holes):
        assert _longest_token(tk) == by_dict(tk)
    assert _longest_token(holes) == 10
