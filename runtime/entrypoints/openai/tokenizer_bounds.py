"""A cheap lower bound on a text's token count, to reject hopeless prompts before tokenizing.

:func:`prompt_length_bound` computes once, from the tokenizer's vocabulary and pipeline, a
:class:`PromptLengthBound` with a number ``L`` such that *every* text of ``n`` characters tokenizes
to at least ``ceil(n / L)`` tokens (:meth:`PromptLengthBound.min_tokens`; characters the tokenizer
may drop, :attr:`PromptLengthBound.ignored_chars`, are not counted), so that the server answers a
prompt far longer than ``max_model_len`` tokens with a 400 from its length alone. ``L`` is the most
characters any token covers (its vocabulary string, or its text decoded alone), times 4 under an
NFC/NFKC normalizer. A pipeline that can drop or fuse characters without bound (BERT's normalizer
and whitespace pre-tokenizer, WordPiece's ``[UNK]``, a slow tokenizer) gives None: such prompts are
simply tokenized. Why the bound holds: docs/server.md, "Why the length bound holds".
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("kvfleet.server")

NFC_MAX_COMPOSITION = 4
"""Most code points canonical composition merges into one (the longest canonical
decomposition in Unicode: U+1F82 -> 4 code points)."""

DECODE_CHUNK = 4096
"""Vocabulary entries decoded at a time when measuring the longest token's text."""

_KEEP_NORMALIZERS = {"NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"}
_KEEP_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "FixedLength"}


def _normalizer_shrink(spec: dict[str, Any] | None) -> float | None:
    """Largest factor by which this normalizer can shorten a text (1: never); None: unbounded
    or unknown."""
    if spec is None:
        return 1.0
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1.0
        for child in spec.get("normalizers", []):
            f = _normalizer_shrink(child)
            if f is None:
                return None
            factor *= f
        return factor
    if kind in _KEEP_NORMALIZERS:
        return 1.0
    if kind in ("NFC", "NFKC"):
        return float(NFC_MAX_COMPOSITION)
    if kind == "Replace":
        pattern = (spec.get("pattern") or {}).get("String")
        content = spec.get("content") or ""
        if pattern is None or not content:  # a regex, or a deletion: unbounded
            return None
        return max(1.0, len(pattern) / len(content))
    return None  # BertNormalizer (drops control characters), Strip, StripAccents, Precompiled, ...


def _pre_tokenizer_keeps_text(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps_text(child) for child in spec.get("pretokenizers", []))
    if kind in ("Split", "Punctuation"):
        return str(spec.get("behavior", "Isolated")).lower() != "removed"
    return kind in _KEEP_PRE_TOKENIZERS  # Whitespace, WhitespaceSplit, BertPreTokenizer drop spaces


def _has_byte_level(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return False
    if spec.get("type") == "Sequence":
        return any(_has_byte_level(child) for child in spec.get("pretokenizers", []))
    return spec.get("type") == "ByteLevel"


def _model_is_bounded(spec: dict[str, Any]) -> bool:
    """Whether every character of the pre-tokenized text ends up in some token: BPE drops a
    character missing from its vocabulary when it has no ``unk_token`` (and fuses a run of
    them into one with ``fuse_unk``), unless bytes fall back to byte tokens (``byte_fallback``)
    or a ByteLevel pre-tokenizer maps the text onto 256 byte characters (the ones missing from
    the vocabulary are handled by :func:`_dropped_ascii`)."""
    model = spec["model"]
    kind = model.get("type")
    if kind == "BPE":
        if model.get("byte_fallback") or _has_byte_level(spec.get("pre_tokenizer")):
            return True
        return model.get("unk_token") is not None and not model.get("fuse_unk")
    if kind == "Unigram":
        return bool(model.get("byte_fallback"))
    return False  # WordPiece: one [UNK] for a whole over-long word; WordLevel: one per word


def _dropped_ascii(spec: dict[str, Any], vocab: Container[str]) -> str | None:
    """The ASCII characters a byte-level BPE drops (their byte-level character is not in the
    vocabulary and there is no byte fallback); None when a UTF-8 continuation byte (0x80-0xBF)
    is missing too, so that whole multi-byte characters could vanish."""
    from tokenizers.pre_tokenizers import ByteLevel

    model = spec["model"]
    if model.get("type") != "BPE" or model.get("byte_fallback") or not _has_byte_level(spec.get("pre_tokenizer")):
        return ""
    byte_chars = ByteLevel(add_prefix_space=False, use_regex=False)  # the library's own byte -> char map
    dropped = "".join(chr(b) for b in range(0x80) if byte_chars.pre_tokenize_str(chr(b))[0][0] not in vocab)
    # U+0080..U+00BF are C2 80..C2 BF in UTF-8: the second mapped character is the continuation byte's
    if any(byte_chars.pre_tokenize_str(chr(c))[0][0][1] not in vocab for c in range(0x80, 0xC0)):
        return None
    return dropped


@dataclass(frozen=True)
class PromptLengthBound:
    """``min_tokens(text)``: a lower bound on the tokens of ``text`` (see the module docstring)."""

    chars_per_token: int
    """``L``: no token covers more characters of the text (normalizer shrink included)."""
    ignored_chars: str = ""
    """Characters the tokenizer drops (not counted)."""

    def min_tokens(self, text: str) -> int:
        """ceil(counted characters / L), in O(len(text)) C-level passes (``str.count``)."""
        n = len(text) - sum(text.count(c) for c in self.ignored_chars)
        return -(-n // self.chars_per_token)


def prompt_length_bound(tokenizer: Any) -> PromptLengthBound | None:
    """The bound of this tokenizer: a text of ``n`` counted characters (code points) tokenizes
    to >= ceil(n / L) tokens; see the module docstring for why, and when there is none.

    Args:
        tokenizer: a transformers tokenizer backed by HF ``tokenizers`` (``backend_tokenizer``).

    Returns: the bound (``L`` >= 1, already multiplied by the normalizer's shrink factor), or
        None when the tokenizer gives none (its pipeline can drop or fuse characters, or it is
        not a ``tokenizers``-backed one).

    Raises:
        ValueError (``json.JSONDecodeError``) or KeyError: a serialized pipeline it cannot
        read (e.g. no ``model``); the server logs it and serves without a bound.

    Cost: one decode per vocabulary entry (about 0.2 s for 49k entries); call it once.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        logger.info("prompt length pre-check off: %s has no tokenizers backend", type(tokenizer).__name__)
        return None
    spec = _pipeline_spec(backend)
    vocab = _Membership(backend)
    shrink = _normalizer_shrink(spec.get("normalizer"))
    bounded = _pre_tokenizer_keeps_text(spec.get("pre_tokenizer")) and _model_is_bounded(spec)
    dropped = _dropped_ascii(spec, vocab) if bounded else None
    if dropped and shrink != 1.0:  # a normalizer could turn other characters into dropped ones
        dropped = None
    if shrink is None or dropped is None:
        logger.info(
            "prompt length pre-check off: the tokenizer (normalizer %s, pre-tokenizer %s, model %s) can drop or "
            "fuse characters",
            (spec.get("normalizer") or {}).get("type"),
            (spec.get("pre_tokenizer") or {}).get("type"),
            spec["model"].get("type"),
        )
        return None
    return PromptLengthBound(math.ceil(_longest_token(backend) * shrink), dropped)


class _Membership:
    """``string in vocabulary`` through the tokenizer (added tokens included), without its vocabulary dict."""

    def __init__(self, backend: Any):
        self.backend = backend

    def __contains__(self, token: str) -> bool:
        return self.backend.token_to_id(token) is not None


def _longest_chunk(backend: Any, entries: list[tuple[int, str]]) -> int:
    decoded = backend.decode_batch([[i] for i, _ in entries], skip_special_tokens=False)
    return max([1, *(len(t) for _, t in entries), *(len(d) for d in decoded)])


def _longest_token(backend: Any) -> int:
    """The most characters of any token: its vocabulary string or its text decoded alone, over every
    id, :data:`DECODE_CHUNK` ids at a time (a 262k vocabulary's strings are never all alive: no
    ``get_vocab()`` dict). Ids run from 0 past the largest added token's; where the ids found there
    are fewer than the vocabulary's size (ids with holes beyond it), every entry of ``get_vocab()``."""
    size = backend.get_vocab_size(with_added_tokens=True)
    upper = max([size, *(i + 1 for i in backend.get_added_tokens_decoder())])
    longest, found = 1, 0
    for start in range(0, upper, DECODE_CHUNK):
        entries = [(i, t) for i in range(start, min(upper, start + DECODE_CHUNK))
                   if (t := backend.id_to_token(i)) is not None]
        found += len(entries)
        longest = max(longest, _longest_chunk(backend, entries))
    if found < size:
        entries = sorted((i, t) for t, i in backend.get_vocab(with_added_tokens=True).items())
        for start in range(0, len(entries), DECODE_CHUNK):
            longest = max(longest, _longest_chunk(backend, entries[start:start + DECODE_CHUNK]))
    return longest


def _pipeline_spec(backend: Any) -> dict[str, Any]:
    """The serialized normalizer, pre-tokenizer and model options :func:`prompt_length_bound`
    reads, without the vocabulary and merges: each component serialized alone (a BPE model's
    options from its attributes), not ``backend.to_str()`` of the whole tokenizer: for Gemma 3's
    262k-entry vocabulary and merges that JSON parsed, the ``get_vocab()`` dict and every entry
    decoded at once peaked 292 MB at the server's start (docs/performance.md, "Start-up to ready")."""
    def part(component: Any) -> dict[str, Any] | None:
        return None if component is None else json.loads(component.__getstate__())

    model = backend.model
    if type(model).__name__ == "BPE":
        options = {k: getattr(model, k) for k in ("unk_token", "fuse_unk", "byte_fallback")}
        model_spec = {"type": "BPE", **options}
    else:  # Unigram, WordPiece, WordLevel: their options are not attributes; the vocabulary goes at once
        model_spec = {k: v for k, v in part(model).items() if k not in ("vocab", "merges")}
    return {"normalizer": part(backend.normalizer), "pre_tokenizer": part(backend.pre_tokenizer), "model": model_spec}
