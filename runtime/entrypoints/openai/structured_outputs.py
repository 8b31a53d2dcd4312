"""The request fields that ask for structured output, as one ``StructuredOutputsParams``.

Accepted (on ``/v1/chat/completions`` and ``/v1/completions``, as vLLM):

* OpenAI's ``response_format``: ``{"type": "text"}`` (nothing), ``{"type": "json_object"}``
  (any JSON object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``
  (output valid against ``schema``; ``strict`` true or false alike: the output always follows
  the schema, with no properties it does not name);
* vLLM's ``structured_outputs``: ``{"json" | "regex" | "choice" | "grammar" | "json_object":
  ..., "disable_any_whitespace": bool}``;
* vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.

At most one of these per request (400 otherwise). :func:`structured_outputs_of` also returns the
field's name: a spec the grammar library refuses is a 400 naming that field
(:func:`grammar_error`).
"""

from __future__ import annotations

from typing import Any

from kvfleet.runtime.entrypoints.openai import protocol as P
from kvfleet.runtime.entrypoints.openai.errors import APIError
from kvfleet.runtime.sampling_params import StructuredOutputError, StructuredOutputsParams

_SO_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def _from_response_format(rf: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise P.ProtocolError("response_format.json_schema must be an object with a schema", "response_format")
        schema = js.get("schema")
        if not isinstance(schema, dict):
            raise P.ProtocolError("response_format.json_schema.schema must be a JSON schema object", "response_format")
        return StructuredOutputsParams(json=schema)
    raise P.UnsupportedFeature(
        f"response_format type {kind!r} is not supported (text, json_object, json_schema)", "response_format"
    )


def _from_structured_outputs(so: dict[str, Any]) -> StructuredOutputsParams:
    # vLLM's disable_fallback / disable_additional_properties change nothing here (one backend; no
    # properties the schema does not name are ever generated); whitespace_pattern is refused.
    unknown = sorted(set(so) - set(_SO_KEYS) - {"disable_any_whitespace", "disable_fallback",
                                                "disable_additional_properties"})
    if unknown:
        raise P.UnsupportedFeature(
            f"structured_outputs.{unknown[0]} is not supported (json, regex, choice, grammar, json_object)",
            "structured_outputs",
        )
    kw = {k: so[k] for k in _SO_KEYS if so.get(k) not in (None, False)}
    if "choice" in kw and not isinstance(kw["choice"], list):
        raise P.ProtocolError("structured_outputs.choice must be a list of strings", "structured_outputs")
    return StructuredOutputsParams(**kw, disable_any_whitespace=bool(so.get("disable_any_whitespace", True)))


def structured_outputs_of(
    body: P.CompletionRequest | P.ChatCompletionRequest,
) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's structured-output spec and the field it came from (``(None, None)``: none).

    Raises:
        ProtocolError: several fields set, a malformed one, or an unsupported kind (the field named).
    """
    found: list[tuple[StructuredOutputsParams | None, str]] = []
    try:
        if body.response_format is not None:
            found.append((_from_response_format(body.response_format), "response_format"))
        if body.structured_outputs is not None:
            found.append((_from_structured_outputs(body.structured_outputs), "structured_outputs"))
        guided = {
            "guided_json": "json",
            "guided_regex": "regex",
            "guided_choice": "choice",
            "guided_grammar": "grammar",
        }
        for field, key in guided.items():
            if getattr(body, field) is not None:
                found.append((StructuredOutputsParams(**{key: getattr(body, field)}), field))
    except P.ProtocolError:
        raise
    except ValueError as exc:  # StructuredOutputsParams' own checks
        raise P.ProtocolError(str(exc), "structured_outputs") from None
    found = [(spec, field) for spec, field in found if spec is not None]
    if len(found) > 1:
        raise P.ProtocolError(
            f"only one structured-output field may be set, got {', '.join(f for _, f in found)}", found[1][1]
        )
    return found[0] if found else (None, None)


def grammar_error(exc: StructuredOutputError, param: str | None) -> APIError:
    """A spec the grammar library refused, as a 400 naming the request field."""
    field = param or "structured_outputs"
    return APIError(400, f"{field}: {exc}", param=field, code="invalid_grammar")
