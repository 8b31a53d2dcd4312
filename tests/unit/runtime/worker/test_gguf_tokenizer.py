"""A GGUF file's tokenizer (runtime/worker/gguf_tokenizer.py): merges rewritten in the string form
only where that is the same tokenizer, and the default model's tokenizer built and loaded lean with
transformers' own ids, text and chat template."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from kvfleet.runtime.worker import gguf_header, gguf_tokenizer, model_loader

TEXTS = ["The capital of France is", "  two  spaces\n\nnew lines\ttabs", "ünïcödé 日本語 🤖 \"quoted\" [x]",
         "<|im_start|>user\nhi<|im_end|>"]


def _bpe(tokens: list[str], merges: list[tuple[str, str]]) -> Tokenizer:
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "isolated")
    return tok


def test_merges_become_strings_and_the_tokenizer_is_the_same():
    tokens = ["a", "b", "\n", '"', "[", "]", "ab", "\n\n", '""', "[]", "ab\n", " "]
    merges = [("a", "b"), ("\n", "\n"), ('"', '"'), ("[", "]"), ("ab", "\n")]
    tok = _bpe(tokens, merges)
    text = tok.to_str()
    compact = gguf_tokenizer.compact_merges(text)
    assert json.loads(compact)["model"]["merges"] == ["a b", "\n \n", '" "', "[ ]", "ab \n"]
    again = Tokenizer.from_str(compact)
    for s in ('ab\n\nab""[] a', "ba\n[][", ""):
        assert again.encode(s).ids == tok.encode(s).ids


def test_a_merge_with_a_space_keeps_the_pair_form():
    tok = _bpe(["a", " ", "a ", "b"], [("a", " ")])
    text = tok.to_str()
    assert gguf_tokenizer.compact_merges(text) is text
    empty = _bpe(["a"], []).to_str()
    assert gguf_tokenizer.compact_merges(empty) is empty


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Built as the reader builds it: transformers handed the reader without the vocabulary for its
    config (the tokenizer's own parse reads the vocabulary)."""
    folder = tmp_path_factory.mktemp("tok")
    path = model_loader.default_model_path().resolve()
    with gguf_header.shared_reader(path, gguf_header.open_reader(path)):
        assert gguf_tokenizer.build(path, folder)
    return folder


def test_the_default_files_tokenizer_is_transformers_own(built):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = model_loader.default_model_path()
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok = gguf_tokenizer.load(built)
    assert isinstance(tok, PreTrainedTokenizerFast) and gguf_tokenizer.merges_form(built) == "strings"
    for text in TEXTS:
        ids = tok(text).input_ids
        assert ids == ref(text).input_ids, text
        assert tok.decode(ids) == ref.decode(ids)
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert tok.chat_template == ref.chat_template and tok.chat_template
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat, add_generation_prompt=True) == ref.apply_chat_template(
        chat, add_generation_prompt=True)
    assert (tok.eos_token_id, tok.bos_token_id, len(tok)) == (ref.eos_token_id, ref.bos_token_id, len(ref))
    assert tok.all_special_ids == ref.all_special_ids


def test_loading_never_parses_tokenizer_json_in_python(built, monkeypatch):
    """The added tokens are in tokenizer_config.json (as tokenizer.json holds them), so transformers
    does not read all of tokenizer.json into Python objects for them (Gemma 3's: 124 MB transient)."""
    added = json.loads((built / "tokenizer_config.json").read_text(encoding="utf-8"))["added_tokens_decoder"]
    whole = json.loads((built / gguf_tokenizer.TOKENIZER_FILE).read_text(encoding="utf-8"))["added_tokens"]
    assert added == {str(t.pop("id")): t for t in whole} and added
    real = json.load

    def guarded(f, *args, **kwargs):
        assert not str(getattr(f, "name", "")).endswith(gguf_tokenizer.TOKENIZER_FILE), "parsed in Python"
        return real(f, *args, **kwargs)

    monkeypatch.setattr(json, "load", guarded)
    tok = gguf_tokenizer.load(built)
    assert len(tok.added_tokens_decoder) == len(added)
