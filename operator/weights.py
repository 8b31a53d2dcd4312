"""Where the runtime's weights come from, and how long getting them may take (pure).

- :func:`parse_model_uri`: ``hf://ORG/NAME[@REV]``, ``hf://ORG/NAME/[FOLDER/]FILE.gguf[@REV]``,
  ``pvc://CLAIM/PATH``, ``file:///PATH``;
- :func:`model_cache_dir` / :func:`model_path_in_pod`: one cache directory per ``repo@revision``
  under :data:`MODELS_DIR`, so a new revision never rewrites files under running pods;
- :func:`startup_seconds` (the startup probe's budget) and :func:`progress_deadline_seconds`
  (the Deployment's, covering the ``fetch-model`` download budget too).

A URI or size that cannot be used raises :class:`kvfleet.operator.crd.InvalidSpec`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from kvfleet.operator import fetch, spec_view
from kvfleet.operator.crd import InvalidSpec

MODELS_DIR = "/models"
DEFAULT_STARTUP_SECONDS = 600
"""Startup probe budget when the model size is unknown, seconds."""
STARTUP_BASE_SECONDS = 120
STARTUP_SECONDS_PER_GIB = 20
"""Startup budget from the model size: base + per GiB of weights (reading, placing on GPU,
compiling kernels), seconds."""


def parse_model_uri(uri: str) -> dict[str, str | None]:
    """Split a model URI.

    Returns ``{"scheme": "hf"|"pvc"|"file", "repo", "revision", "claim", "path", "file"}`` (unused keys
    None); ``file``: the one GGUF file of an ``hf://ORG/NAME/[FOLDER/]FILE.gguf`` URI, its path in the
    repository (a GGUF repository holds one file per quantization, llama.cpp publishers' often in
    subfolders: only that one is fetched and served).

    Raises:
        InvalidSpec: unknown scheme or malformed URI (reason ``InvalidModelURI``).
    """
    out: dict[str, str | None] = {"scheme": None, "repo": None, "revision": None, "claim": None, "path": None,
                                  "file": None}
    if uri.startswith("hf://"):
        rest = uri[len("hf://"):]
        repo, _, revision = rest.partition("@")
        parts = repo.split("/")
        file_parts = parts[2:] if len(parts) > 2 and parts[-1].endswith(".gguf") else []
        if file_parts:
            parts = parts[:2]
        if len(parts) != 2 or not all(parts) or any(p in ("", ".", "..") for p in file_parts):
            raise InvalidSpec("InvalidModelURI", "hf:// URI must be hf://ORG/NAME[@REVISION] or "
                                                 f"hf://ORG/NAME/[FOLDER/]FILE.gguf[@REVISION], got {uri!r}")
        out.update(scheme="hf", repo="/".join(parts), revision=revision or None, file="/".join(file_parts) or None)
    elif uri.startswith("pvc://"):
        claim, _, path = uri[len("pvc://"):].partition("/")
        if not claim:
            raise InvalidSpec("InvalidModelURI", f"pvc:// URI must be pvc://CLAIM[/PATH], got {uri!r}")
        out.update(scheme="pvc", claim=claim, path=path.strip("/") or None)
    elif uri.startswith("file:///"):
        out.update(scheme="file", path="/" + uri[len("file:///"):].lstrip("/"))
    else:
        raise InvalidSpec("InvalidModelURI", f"model.uri scheme must be hf://, pvc:// or file:///, got {uri!r}")
    return out


def model_size_bytes(spec: spec_view.Spec) -> int | None:
    """``spec.model.size`` in bytes (a Kubernetes quantity), or None when unset."""
    size = spec.model.size
    if size is None:
        return None
    from kubernetes.utils import parse_quantity

    try:
        return int(parse_quantity(size))
    except ValueError as e:
        raise InvalidSpec("InvalidModelSize", f"model.size {size!r}: {e}") from None


def startup_seconds(spec: spec_view.Spec) -> int:
    """Startup probe budget, seconds: ``runtime.startupTimeoutSeconds``, else
    :data:`STARTUP_BASE_SECONDS` + :data:`STARTUP_SECONDS_PER_GIB` per GiB of
    ``model.size``, else :data:`DEFAULT_STARTUP_SECONDS`."""
    if spec.runtime.startup_timeout_seconds:
        return int(spec.runtime.startup_timeout_seconds)
    size = model_size_bytes(spec)
    if size is None:
        return DEFAULT_STARTUP_SECONDS
    return STARTUP_BASE_SECONDS + int(math.ceil(size / 2**30 * STARTUP_SECONDS_PER_GIB))


def progress_deadline_seconds(spec: spec_view.Spec) -> int:
    """The Deployment's ``progressDeadlineSeconds``: the startup budget, plus for ``hf://``
    models the whole download budget (every attempt timing out, and the back-offs), plus 600 s."""
    total = startup_seconds(spec) + 600
    if spec.model.uri.startswith("hf://"):
        dl = spec.model.download
        total += int(math.ceil(fetch.budget_seconds(float(dl.timeout_seconds), int(dl.retries))))
    return total


def model_cache_dir(repo: str, revision: str | None) -> str:
    """The cache directory name of ``hf://repo@revision`` (``ORG--NAME@REVISION``, ``main``
    when unpinned): one per revision, so a new revision never rewrites files in use."""
    return f"{repo}@{revision or 'main'}".replace("/", "--")


def model_path_in_pod(model: Mapping[str, Any]) -> str:
    """Where the runtime finds the weights inside the pod."""
    if model["scheme"] == "hf":
        folder = f"{MODELS_DIR}/{model_cache_dir(str(model['repo']), model['revision'])}"
        return f"{folder}/{model['file']}" if model.get("file") else folder
    if model["scheme"] == "pvc":
        return f"{MODELS_DIR}/{model['path']}" if model["path"] else MODELS_DIR
    return str(model["path"])
