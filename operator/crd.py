"""The one definition of the ``InferenceService`` CustomResourceDefinition.

Its names (group, kind, plural, ...), the status and scale subresources, the printer columns
and kopf's peering CRDs; the schema itself (types, defaults, enums, ranges, CEL rules) is
:mod:`kvfleet.operator.crd_schema`. ``crds/*.yaml`` (and the chart's copies) are generated
from them::

    python -m kvfleet.operator.crd            # rewrite them
    python -m kvfleet.operator.crd --check    # exit 1 when they drift

:func:`apply_defaults` applies the schema's defaults the way an API server does, so the
builders give the same children whether or not a server defaulted the object.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

from kvfleet.operator.crd_schema import OPENAPI_SCHEMA

GROUP = "kvfleet.io"
VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ["kis"]  # not "isvc": KServe's InferenceService owns that one
CATEGORIES = ["kvfleet"]
API_VERSION = f"{GROUP}/{VERSION}"
CRD_NAME = f"{PLURAL}.{GROUP}"


class InvalidSpec(ValueError):
    """A spec the schema accepts but that cannot be built (reason: a CamelCase word); the
    status reports it as ``Degraded``."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


PRINTER_COLUMNS = [
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.uri"},
    {"name": "Replicas", "type": "integer", "jsonPath": ".status.replicas"},
    {"name": "Ready", "type": "string", "jsonPath": ".status.conditions[?(@.type==\"Ready\")].status"},
    {"name": "Reason", "type": "string", "jsonPath": ".status.conditions[?(@.type==\"Ready\")].reason"},
    {"name": "URL", "type": "string", "jsonPath": ".status.url", "priority": 0},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def crd() -> dict[str, Any]:
    """The ``apiextensions.k8s.io/v1`` CustomResourceDefinition object (a fresh dict)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {"app.kubernetes.io/name": "kvfleet", "app.kubernetes.io/part-of": "kvfleet"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL,
                      "singular": SINGULAR, "shortNames": list(SHORT_NAMES),
                      "categories": list(CATEGORIES)},
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": copy.deepcopy(OPENAPI_SCHEMA)},
                "subresources": {
                    "status": {},
                    "scale": {"specReplicasPath": ".spec.replicas",
                              "statusReplicasPath": ".status.replicas",
                              "labelSelectorPath": ".status.selector"},
                },
                "additionalPrinterColumns": copy.deepcopy(PRINTER_COLUMNS),
            }],
        },
    }


def kopf_peering_crds() -> list[dict[str, Any]]:
    """kopf's peering CRDs (``kopf.dev/v1`` ClusterKopfPeering and KopfPeering), needed for
    ``kvfleet operator --peering NAME``; the same objects as kopf's documented peering.yaml."""
    def one(kind: str, plural: str, scope: str) -> dict[str, Any]:
        return {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.kopf.dev"},
            "spec": {
                "scope": scope,
                "group": "kopf.dev",
                "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
                "versions": [{
                    "name": "v1", "served": True, "storage": True,
                    "schema": {"openAPIV3Schema": {
                        "type": "object",
                        "properties": {"status": {"type": "object",
                                                  "x-kubernetes-preserve-unknown-fields": True}},
                    }},
                }],
            },
        }
    return [one("ClusterKopfPeering", "clusterkopfpeerings", "Cluster"),
            one("KopfPeering", "kopfpeerings", "Namespaced")]


# ---------------------------------------------------------------------------------
# defaulting (what the API server does with the structural defaults)


def apply_defaults(obj: Any, schema: dict[str, Any] | None = None) -> Any:
    """Return a deep copy of ``obj`` with the schema's ``default`` values filled in.

    Follows the API server's rule: a default applies to a missing property of an object
    that exists; defaults are not invented for absent parent objects (so ``spec.tuning``
    gets ``enabled: false`` only when ``spec.tuning`` is present). ``schema`` defaults to the
    whole InferenceService schema, and ``obj`` is then a full InferenceService dict.
    """
    schema = OPENAPI_SCHEMA if schema is None else schema
    obj = copy.deepcopy(obj)
    _default_into(obj, schema)
    return obj


def _default_into(obj: Any, schema: dict[str, Any]) -> None:
    if isinstance(obj, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in obj and "default" in sub:
                obj[key] = copy.deepcopy(sub["default"])
            if key in obj:
                _default_into(obj[key], sub)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for item in obj:
            _default_into(item, schema["items"])


# ---------------------------------------------------------------------------------
# the generated files

REPO_ROOT = Path(__file__).resolve().parent.parent


def rendered_files() -> dict[str, str]:
    """``{path relative to the repository root: YAML text}`` of every generated CRD file."""
    import yaml

    header = ("# GENERATED by `python -m kvfleet.operator.crd` from operator/crd.py; do not edit.\n")
    out = {f"crds/{CRD_NAME}.yaml": header + yaml.safe_dump(crd(), sort_keys=False, width=100)}
    out["crds/kopf-peering.yaml"] = header + yaml.safe_dump_all(kopf_peering_crds(), sort_keys=False)
    # The Helm chart ships the same files in its own crds/ folder (Helm installs CRDs only
    # from there); both copies are written and checked together so they cannot drift.
    for rel in list(out):
        out[f"charts/kvfleet/{rel}"] = out[rel]
    return out


def main(argv: list[str] | None = None) -> int:
    """Write (or with ``--check``, compare) the generated CRD files; returns an exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    check = "--check" in argv
    root = REPO_ROOT
    for arg in argv:
        if arg.startswith("--root="):
            root = Path(arg.split("=", 1)[1])
        elif arg != "--check":  # e.g. --help or a typo: never write files on an unknown argument
            print("usage: python -m kvfleet.operator.crd [--check] [--root=DIR]", file=sys.stderr)
            return 0 if arg in ("-h", "--help") else 2
    stale = []
    for rel, text in rendered_files().items():
        path = root / rel
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(rel)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {rel}")
    if stale:
        print("out of date (run `python -m kvfleet.operator.crd`): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
