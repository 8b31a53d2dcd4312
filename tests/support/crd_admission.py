"""What the Kubernetes API server does with an InferenceService on create, without one: defaults,
the CRD's OpenAPI schema (jsonschema) and its CEL rules (cel-python, with values typed from the
schema as the API server types them). ``admit(obj)`` lists the errors; empty means admitted."""

from __future__ import annotations

from typing import Any

import celpy
import jsonschema
from celpy import celtypes

from kvfleet.operator import crd, crd_schema


def to_cel(value: Any, schema: dict[str, Any]) -> Any:
    """Convert JSON to CEL values the way the API server types them from the schema
    (a ``number`` is a double even when written as 1)."""
    t = schema.get("type")
    if isinstance(value, bool):
        return celtypes.BoolType(value)
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties") if isinstance(schema.get("additionalProperties"), dict) else {}
        return celtypes.MapType({celtypes.StringType(k): to_cel(v, props.get(k, extra)) for k, v in value.items()})
    if isinstance(value, list):
        return celtypes.ListType([to_cel(v, schema.get("items", {})) for v in value])
    if t == "number":
        return celtypes.DoubleType(float(value))
    if isinstance(value, int):
        return celtypes.IntType(value)
    if isinstance(value, float):
        return celtypes.DoubleType(value)
    if isinstance(value, str):
        return celtypes.StringType(value)
    raise TypeError(value)


CEL_ENV = celpy.Environment()


def cel_errors(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Evaluate every x-kubernetes-validations rule that applies to ``value``; the messages
    of the rules that do not hold."""
    out = []
    for rule in schema.get("x-kubernetes-validations", []):
        prog = CEL_ENV.program(CEL_ENV.compile(rule["rule"]))
        result = prog.evaluate({"self": to_cel(value, schema)})
        if result is not True and result != celtypes.BoolType(True):
            out.append(f"{path or '<root>'}: {rule['message']}")
    if isinstance(value, dict):
        for key, sub in value.items():
            sub_schema = schema.get("properties", {}).get(key)
            if sub_schema is None and isinstance(schema.get("additionalProperties"), dict):
                sub_schema = schema["additionalProperties"]
            if sub_schema is not None:
                out += cel_errors(sub, sub_schema, f"{path}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, sub in enumerate(value):
            out += cel_errors(sub, schema["items"], f"{path}[{i}]")
    return out


def schema_errors(obj: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft4Validator(crd_schema.OPENAPI_SCHEMA)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


def admit(obj: dict[str, Any]) -> list[str]:
    """What the API server does on create: default, then OpenAPI schema, then CEL."""
    obj = crd.apply_defaults(obj)
    return schema_errors(obj) + cel_errors(obj, crd_schema.OPENAPI_SCHEMA)
