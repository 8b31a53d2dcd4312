"""One JSON-object option (``--kv-events-config``, ``--kv-transfer-config``, ...) into its pydantic
model: the shared rules of every ``*_config`` option given as JSON on the command line or in the
environment. Torch-free."""

from __future__ import annotations

import json
from typing import TypeVar

from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)


def parse_json_option(model: type[M], value, option: str) -> M | None:
    """``value`` as a ``model``: a JSON object string (empty: None), a mapping, a ``model``, or None.

    Raises:
        ValueError: naming ``option``: not JSON, not an object, or a field pydantic refuses."""
    if value is None or isinstance(value, model):
        return value
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{option}: not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{option}: a JSON object is expected, got {type(value).__name__}")
    return model.model_validate(value)
