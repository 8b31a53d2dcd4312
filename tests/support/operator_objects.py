"""InferenceService objects for the operator's unit tests: an example as the API server would
store it (uid, generation, the CRD's defaults) and the children by kind."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from kvfleet.operator import crd
from support.paths import ROOT

UID = "0b7f1c1e-5a8e-4a4b-9c33-6c3d2b1a0f00"


def stored(path_or_obj: Path | dict[str, Any], generation: int = 1) -> dict[str, Any]:
    """The example as an API server would store it: uid, generation, defaults."""
    obj = yaml.safe_load(path_or_obj.read_text()) if isinstance(path_or_obj, Path) else copy.deepcopy(path_or_obj)
    obj["metadata"].update(uid=UID, generation=generation)
    return crd.apply_defaults(obj)


def minimal(**spec: Any) -> dict[str, Any]:
    obj = stored(ROOT / "examples/inferenceservice-minimal.yaml")
    obj["spec"].update(spec)
    return obj


def by_kind(children: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["kind"]: c for c in children}
