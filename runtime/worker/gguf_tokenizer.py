"""The tokenizer of a GGUF file: converted once, stored compactly, loaded lean.

Contract:

- :func:`build` writes the tokenizer files of a GGUF file into a folder: transformers' own GGUF
  tokenizer conversion (``AutoTokenizer.from_pretrained(gguf_file=)``: its vocabulary, merges,
  special tokens and chat template), saved by ``save_pretrained``, with ``tokenizer.json``'s BPE merges
  then written in ``tokenizers``' "left right" string form wherever no merge holds a space (the same
  merges in the same order; ``tokenizers`` reads both forms). Parsing the pair form of Gemma 3's
  515k merges takes ~355 MB of transient memory, the string form ~165 MB.
- :func:`load` reads such a folder as a ``PreTrainedTokenizerFast`` (the ``tokenizers`` pipeline of
  ``tokenizer.json`` and ``tokenizer_config.json``'s special tokens and chat template, the same ids
  and text as the model's own tokenizer class, which also keeps Python copies of the vocabulary and
  merges: ~140 MB for Gemma's 262k tokens), then hands the freed heap back to the system.
  :func:`build` writes the added tokens into ``tokenizer_config.json`` (``added_tokens_decoder``, as
  ``tokenizer.json`` holds them), so that loading never parses ``tokenizer.json`` in Python.
- :func:`release_heap` returns the C heap's free pages to the system (glibc's ``malloc_trim``; a
  no-op elsewhere): a tokenizer's transient parse leaves ~270 MB of freed but resident heap behind.

Both steps keep a GGUF load's peak memory near its weights (docs/performance.md, "GGUF files as
stored"); a bad tokenizer in the file is transformers' error, raised as is.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import json
import re
from pathlib import Path

TOKENIZER_FILE = "tokenizer.json"
_PAIR = re.compile(r'\["((?:[^"\\ ]|\\.)*)","((?:[^"\\ ]|\\.)*)"\]')
"""One merge in the pair form of a compact (``to_str``) ``tokenizer.json``: two JSON strings, neither
with a space or an escaped space."""


def release_heap() -> None:
    """Give the C heap's free pages back to the system (glibc ``malloc_trim(0)``)."""
    gc.collect()
    name = ctypes.util.find_library("c")
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(name or "libc.so.6").malloc_trim(0)


def compact_merges(text: str) -> str:
    """Compact (``Tokenizer.to_str()``) ``tokenizer.json`` text with its BPE merges as "left right"
    strings, or ``text`` unchanged when it has no merge pairs or a merge part holds a space (the
    string form splits on it). The model is the JSON's last key and its merges the model's last."""
    key = '"merges":[['
    start = text.rfind(key)
    if start < 0 or not text.endswith("]]}}"):
        return text
    start += len(key) - 1
    body = text[start:len(text) - 3]
    if "\\u0020" in body or _PAIR.sub("", body).strip(","):
        return text  # a part with a space (or an unexpected shape): left in the pair form
    return text[:start] + _PAIR.sub(r'"\1 \2"', body) + text[len(text) - 3:]


def build(path: Path, folder: Path) -> bool:
    """Convert GGUF file ``path``'s tokenizer (transformers) and write its files into ``folder``;
    False (nothing written) when the conversion found no vocabulary (a reader without one was
    handed to it: the caller builds again with transformers' own)."""
    from transformers import AutoTokenizer

    path = Path(path)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if tok.backend_tokenizer.get_vocab_size(with_added_tokens=False) < 2:
        return False
    tok.save_pretrained(str(folder))
    _write_added_tokens(tok.backend_tokenizer, Path(folder))
    text = compact_merges(tok.backend_tokenizer.to_str())
    del tok
    release_heap()
    (Path(folder) / TOKENIZER_FILE).write_text(text, encoding="utf-8")
    del text
    release_heap()
    return True


def _write_added_tokens(backend, folder: Path) -> None:
    """``tokenizer_config.json`` with ``added_tokens_decoder``: the added tokens as ``tokenizer.json``
    holds them. Without it transformers' ``from_pretrained`` parses all of ``tokenizer.json`` in Python
    for them (Gemma 3's: 124 MB of transient objects, ~14 MB of them left resident)."""
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["added_tokens_decoder"] = {
        str(i): {"content": t.content, "single_word": t.single_word, "lstrip": t.lstrip, "rstrip": t.rstrip,
                 "normalized": t.normalized, "special": t.special}
        for i, t in sorted(backend.get_added_tokens_decoder().items())}
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")


def load(folder: Path):
    """The tokenizer in ``folder`` (:func:`build`'s files, or any ``tokenizer.json`` folder)."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
    release_heap()
    return tok


def merges_form(folder: Path) -> str:
    """``"strings"`` or ``"pairs"``: how ``folder``'s ``tokenizer.json`` spells its merges (for tests)."""
    merges = json.loads((Path(folder) / TOKENIZER_FILE).read_text(encoding="utf-8"))["model"].get("merges") or []
    return "pairs" if merges and isinstance(merges[0], list) else "strings"
