"""A typed, read-only view of an ``InferenceService``'s spec, built once per reconcile.

The view's classes are generated from the CRD's own schema (:data:`crd_schema.SPEC`): one
frozen dataclass per object of the schema, one field per property, named in snake_case
(``engine.kvCacheDtype`` -> ``spec.engine.kv_cache_dtype``, ``autoscaling.targetKVCacheUsage`` ->
``spec.autoscaling.target_kv_cache_usage``). Nothing is restated by hand: a field added to the
schema is in the view, with its default, the moment it is in ``crd_schema``.

How a view is filled (:func:`of`):

- the sections in :data:`ALWAYS_PRESENT` are created when absent (so callers never test for
  them); then the schema's defaults are applied as an API server applies them
  (:func:`kvfleet.operator.crd.apply_defaults`: a default fills a missing property of an object
  that exists), and ``runtime.image`` falls back to :data:`crd_schema.DEFAULT_IMAGE`;
- any other absent object is ``None`` (``engine.speculative is None``: off; ``engine.kv_cache is
  None``: the default tiers), an absent scalar without a default is ``None``;
- a list of objects is a tuple of views, a list of scalars a tuple; objects the schema keeps
  opaque (``runtime.env``, ``affinity``, ``extraArgs``, ``podAnnotations``, quantities) are plain
  values, deep-copied from the resource so that no builder can change it.

Enum values stay the spec's strings; compare them with the members of
:mod:`kvfleet.operator.spec_enums` (a ``StrEnum`` equals its string). :func:`effective_dict` is
the same defaulted spec as a dict.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from kvfleet.operator import crd, crd_schema

ALWAYS_PRESENT = ("model", "model.download", "runtime", "runtime.resources", "engine", "autoscaling",
                  "autoscaling.scaleUp", "autoscaling.scaleDown", "autoscaling.metrics", "tuning",
                  "tuning.gpuMemoryUtilization", "rollout", "disruption", "router", "router.inferencePool")
"""The objects every view has (camelCase paths under ``spec``), absent or not in the resource."""


def snake(name: str) -> str:
    """A schema property's field name: ``kvCacheDtype`` -> ``kv_cache_dtype``,
    ``targetKVCacheUsage`` -> ``target_kv_cache_usage``."""
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)).lower()


_SCALARS = {"integer": int, "number": float, "string": str, "boolean": bool}


def _is_object(schema: Mapping[str, Any]) -> bool:
    return schema.get("type") == "object" and bool(schema.get("properties"))


def _annotation(schema: Mapping[str, Any], cls: type | None) -> Any:
    if schema.get("type") == "array":
        return (tuple[cls, ...] if cls is not None else tuple) | None
    if cls is not None:
        return cls | None
    if schema.get("x-kubernetes-int-or-string") or "anyOf" in schema:
        return int | str | None
    if schema.get("type") == "object":
        return dict | None
    return _SCALARS.get(schema.get("type", ""), Any) | None


def _make_class(name: str, schema: Mapping[str, Any]) -> type:
    """The frozen dataclass of one object schema (its nested objects' classes first)."""
    fields, children = [], {}
    for prop, sub in schema["properties"].items():
        child = None
        if _is_object(sub):
            child = _make_class(prop[0].upper() + prop[1:], sub)
        elif sub.get("type") == "array" and _is_object(sub.get("items") or {}):
            child = _make_class(prop[0].upper() + prop[1:], sub["items"])
        if child is not None:
            children[prop] = child
        fields.append((snake(prop), _annotation(sub, child),
                       dataclasses.field(default=None)))
    cls = dataclasses.make_dataclass(name, fields, frozen=True, namespace={"__doc__": schema.get("description")})
    cls.__module__ = __name__
    cls._schema = schema  # type: ignore[attr-defined]
    cls._children = children  # type: ignore[attr-defined]
    cls._keys = {snake(p): p for p in schema["properties"]}  # type: ignore[attr-defined]
    return cls


Spec = _make_class("Spec", crd_schema.SPEC)
"""The view's class: ``Spec.model``, ``Spec.engine``, ..., one field per property of ``spec``."""


def _all_classes() -> list[type]:
    out, stack = [], [Spec]
    while stack:
        cls = stack.pop()
        out.append(cls)
        stack.extend(cls._children.values())  # type: ignore[attr-defined]
    return out


ALL_CLASSES = _all_classes()
"""Every class of the view (one per object of the schema)."""
CLASSES: dict[str, type] = {cls.__name__: cls for cls in reversed(ALL_CLASSES)}
"""The classes by name (``Engine``, ``Tiers``, ...; the first of a name), also module attributes
for annotations."""
globals().update({k: v for k, v in CLASSES.items() if k not in globals()})


def _fill(cls: type, raw: Mapping[str, Any]) -> Any:
    kwargs = {}
    for field_name, prop in cls._keys.items():  # type: ignore[attr-defined]
        value = raw.get(prop)
        child = cls._children.get(prop)  # type: ignore[attr-defined]
        if value is None:
            kwargs[field_name] = None
        elif child is not None and isinstance(value, list):
            kwargs[field_name] = tuple(_fill(child, v) for v in value)
        elif child is not None:
            kwargs[field_name] = _fill(child, value)
        elif isinstance(value, list):
            kwargs[field_name] = tuple(copy.deepcopy(value))
        else:
            kwargs[field_name] = copy.deepcopy(value)
    return cls(**kwargs)


def _with_sections(raw: dict[str, Any], paths: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """``raw`` with the objects at ``paths`` (dotted, relative to it) created where absent."""
    for path in paths:
        node = raw
        for key in path.split("."):
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
    return raw


def effective_dict(isvc: Mapping[str, Any]) -> dict[str, Any]:
    """``spec`` as a dict with the :data:`ALWAYS_PRESENT` sections created and the CRD's defaults
    applied (a deep copy; the resource is never changed)."""
    spec = _with_sections(copy.deepcopy(dict(isvc.get("spec") or {})), ALWAYS_PRESENT)
    spec = crd.apply_defaults(spec, crd_schema.SPEC)
    if not spec["runtime"].get("image"):
        spec["runtime"]["image"] = crd_schema.DEFAULT_IMAGE
    return spec


def of(isvc: Mapping[str, Any]) -> Any:
    """The typed view of ``isvc``'s spec (a :data:`Spec`), defaults applied; build it once per
    reconcile and hand it down."""
    return _fill(Spec, effective_dict(isvc))


def section(schema: Mapping[str, Any], raw: Mapping[str, Any] | None) -> Any:
    """The view of one section given as a dict (``raw`` None: the section empty), its defaults
    applied: e.g. ``section(crd_schema.AUTOSCALING, {"mode": "operator"})`` (tests, and pure
    functions handed one section). A schema that is not one of the spec's gets a class of its own."""
    cls = _SECTION_CLASSES.get(id(schema))
    if cls is None or cls._schema is not schema:  # type: ignore[attr-defined]
        cls, path = _make_class("Section", schema), None
    else:
        path = _PATHS.get(id(schema))
    raw = copy.deepcopy(dict(raw or {}))
    if path is not None:  # one of the spec's sections: its ALWAYS_PRESENT objects, as in of()
        prefix = path + "."
        raw = _with_sections(raw, [p[len(prefix):] for p in ALWAYS_PRESENT if p.startswith(prefix)])
    return _fill(cls, crd.apply_defaults(raw, schema))


def _paths(schema: Mapping[str, Any], path: str = "") -> dict[int, str]:
    out = {id(schema): path}
    for prop, sub in (schema.get("properties") or {}).items():
        if _is_object(sub):
            out.update(_paths(sub, f"{path}.{prop}" if path else prop))
    return out


_SECTION_CLASSES: dict[int, type] = {id(cls._schema): cls for cls in ALL_CLASSES}  # type: ignore[attr-defined]
_PATHS = _paths(crd_schema.SPEC)


__all__ = ["ALL_CLASSES", "ALWAYS_PRESENT", "CLASSES", "Spec", "effective_dict", "of", "section", "snake"]
