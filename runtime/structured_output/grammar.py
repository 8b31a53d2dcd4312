"""One structured-output spec compiled by xgrammar, and the matcher of one constrained sequence.

:func:`compile_spec` turns a :class:`~kvfleet.runtime.sampling_params.StructuredOutputsParams`
into an ``xgrammar.CompiledGrammar`` (a JSON schema, any JSON object, a regex, a list of
choices, an EBNF or Lark grammar, a structural tag); the library's compile error becomes a
:class:`~kvfleet.runtime.sampling_params.StructuredOutputError` carrying its message.
:class:`Grammar` is the per-sequence ``xgrammar.GrammarMatcher`` behind the scheduler's
:class:`~kvfleet.runtime.core.request.GrammarState`: it fills its row of the step's token bitmask
and is advanced with each sampled token. xgrammar: Dong et al. 2024, "XGrammar: Flexible and
Efficient Structured Generation Engine for Large Language Models" (arXiv:2411.15100).
"""

from __future__ import annotations

import json
import logging
import re

import torch
import xgrammar as xgr

from kvfleet.runtime.sampling_params import StructuredOutputError, StructuredOutputsParams

logger = logging.getLogger(__name__)

_NATIVE_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*(Check failed:.*? is false:\s*)?")

_KIND_TEXT = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "structural_tag": "structural tag",
}


def library_message(exc: BaseException) -> str:
    """xgrammar's error text without its C++ source location (``[13:34:06] /project/cpp/x.cc:94:``)."""
    text = str(exc).strip()
    return _NATIVE_PREFIX.sub("", text).strip() or type(exc).__name__


def _ebnf_literal(text: str) -> str:
    """``text`` as an EBNF string literal (xgrammar's / GBNF's escapes)."""
    escaped = (
        text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    )
    return f'"{escaped}"'


def choice_grammar(choices: tuple[str, ...]) -> str:
    """The EBNF grammar whose language is exactly ``choices`` (as vLLM's ``choice_as_grammar``)."""
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


def compile_spec(compiler: xgr.GrammarCompiler, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
    """Compile ``spec`` (blocking: milliseconds for small schemas, longer for big ones).

    JSON kinds use xgrammar's ``any_whitespace=not spec.disable_any_whitespace``: by default
    fixed separators, so output cannot loop on whitespace. ``json`` uses ``strict_mode`` (no
    properties or items the schema does not name); ``json_object`` is ``{"type": "object"}``
    with any properties. ``grammar`` is EBNF when it contains ``::=``, else Lark.

    Raises:
        StructuredOutputError: the library refused the spec (its message, prefixed by the kind).
    """
    any_ws = not spec.disable_any_whitespace
    kind = spec.kind
    try:
        if kind == "json":
            schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
            return compiler.compile_json_schema(schema, any_whitespace=any_ws, strict_mode=True)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_ws, strict_mode=False)
        if kind == "regex":
            return compiler.compile_regex(spec.regex)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(spec.choice))
        if kind == "grammar":
            if "::=" in spec.grammar:
                return compiler.compile_grammar(spec.grammar)
            return compiler.compile_lark(spec.grammar)
        return compiler.compile_structural_tag(spec.structural_tag)
    except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar raises RuntimeError from C++, pydantic's ValueError
        raise StructuredOutputError(f"invalid {_KIND_TEXT[kind]}: {library_message(exc)}") from None


class Grammar:
    """The grammar state of one sequence (implements ``core.request.GrammarState``).

    Args:
        compiled: the request's compiled grammar (shared by its ``n`` sequences).
    """

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.num_accepted = 0

    def accept_token(self, token: int) -> bool:
        """Advance by ``token``; True when the sequence must stop: the grammar accepted its stop
        token (complete), or rejected ``token`` (cannot happen for a token sampled under this
        matcher's mask; logged)."""
        if not self.matcher.accept_token(token):
            logger.error("the grammar rejected token %d after %d tokens; the sequence stops", token, self.num_accepted)
            return True
        self.num_accepted += 1
        return self.matcher.is_terminated()

    def validate_tokens(self, tokens: list[int]) -> int:
        """How many of ``tokens`` the grammar accepts in a row from its state now, stopping before
        one it rejects or after the one that completes it; the state is rolled back."""
        n = 0
        for token in tokens:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                break
            n += 1
        if n:
            self.matcher.rollback(n)
        return n

    def fill_bitmasks(self, bitmask: torch.Tensor, row: int, draft: list[int]) -> list[bool]:
        """Rows ``row .. row + len(draft)`` of ``bitmask``: the allowed tokens now and after each
        prefix of ``draft`` (speculative verification: row ``j`` scores the token after
        ``draft[:j]``); the state is rolled back. ``draft`` must be valid
        (:meth:`validate_tokens`). Per row, False when every token is allowed."""
        out = [self.matcher.fill_next_token_bitmask(bitmask, row)]
        for j, token in enumerate(draft):
            self.matcher.accept_token(token)
            out.append(self.matcher.fill_next_token_bitmask(bitmask, row + j + 1))
        if draft:
            self.matcher.rollback(len(draft))
        return out

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into ``bitmask[row]`` (int32, 32 tokens per word, CPU);
        False when every token is allowed (the row need not be masked)."""
        return self.matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()
