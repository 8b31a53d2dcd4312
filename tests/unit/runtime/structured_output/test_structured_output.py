"""The structured-output layer (kvfleet.runtime.structured_output: grammar, manager) over xgrammar:
library errors named with their kind, spec validation, the compiled-grammar cache, bitmasks only
on constrained rows, the per-sequence matcher. The engine with schemas:
tests/unit/runtime/engine/test_structured_output.py; over HTTP: tests/e2e/test_structured_output_server.py."""

from __future__ import annotations

import pytest
import torch

from kvfleet.runtime.core.request import Request
from kvfleet.runtime.sampling_params import SamplingParams, StructuredOutputError, StructuredOutputsParams


@pytest.fixture(scope="module")
def manager(smollm2):
    from kvfleet.runtime.structured_output.manager import StructuredOutputManager

    m = StructuredOutputManager(smollm2.tokenizer, 49152, [smollm2.tokenizer.eos_token_id])
    yield m
    m.shutdown()


@pytest.mark.parametrize(("spec", "message"), [
    (StructuredOutputsParams(json={"type": "strin"}), 'invalid JSON schema: Unsupported type "strin"'),
    (StructuredOutputsParams(json="{not json"), "invalid JSON schema: "),
    (StructuredOutputsParams(json={"type": "integer", "minimum": 5, "maximum": 1}), "minimum greater than maximum"),
    (StructuredOutputsParams(regex="[a-"), "invalid regex: Regex parsing error at position 4"),
    (StructuredOutputsParams(grammar='root ::= foo'), 'invalid grammar: EBNF parser error at line 1, column 10'),
])
def test_library_errors_name_the_kind_with_the_library_message(manager, spec, message):
    with pytest.raises(StructuredOutputError) as info:
        manager.grammar_init(spec).result(timeout=60)
    assert message in str(info.value) and "/project/cpp" not in str(info.value)


def test_spec_validation():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    a = StructuredOutputsParams(json={"b": 1, "a": 2})
    assert a.key() == StructuredOutputsParams(json={"a": 2, "b": 1}).key() != StructuredOutputsParams(
        json={"a": 2, "b": 1}, disable_any_whitespace=False).key()


def test_cache_masks_and_matcher(manager, smollm2):
    tok = smollm2.tokenizer
    spec = StructuredOutputsParams(choice=['say "yes"', "no\n"])
    before = manager.num_compiles
    f1, f2 = manager.grammar_init(spec), manager.grammar_init(StructuredOutputsParams(choice=['say "yes"', "no\n"]))
    assert f1 is f2 and manager.num_compiles - before <= 1
    grammar = manager.new_grammar(f1.result(timeout=60))
    # Row 0 unconstrained, row 1 constrained: row 0 is untouched, row 1 keeps only allowed tokens.
    reqs = [Request("u", [1], SamplingParams()), Request("c", [1], SamplingParams())]
    reqs[1].structured_output = grammar
    logits = torch.randn(2, 49152)
    before_row0 = logits[0].clone()
    assert manager.apply_bitmask(logits, [r.structured_output for r in reqs]) == 1
    assert torch.equal(logits[0], before_row0)
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed and all(tok.decode([t]) and ('say "yes"'.startswith(tok.decode([t])) or
                                                "no\n".startswith(tok.decode([t]))) for t in allowed)
    assert manager.apply_bitmask(logits, [None]) == 0  # nothing constrained: nothing masked
    for t in tok.encode("no\n", add_special_tokens=False):
        assert grammar.accept_token(t) is False
    assert grammar.accept_token(tok.eos_token_id) is True  # complete + stop token: the sequence stops

    # A number with bounds: the matcher accepts 1.5 and refuses 3 and -1 (what the mask forbids).
    import xgrammar as xgr

    bounded = manager.grammar_init(StructuredOutputsParams(json={"type": "number", "minimum": 1, "maximum": 2}))
    accepts = [xgr.GrammarMatcher(bounded.result(timeout=60)).accept_string(t) for t in ("1.5", "3", "-1")]
    assert accepts == [True, False, False]
