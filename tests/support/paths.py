"""Paths of the checkout that tests read: the repository root and the tests' data files."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository root (holds pyproject.toml, runtime/, operator/, kernels/, charts/, docs/)."""

DATA = ROOT / "tests" / "data"
"""Recorded inputs and golden outputs: ``cpuinfo/`` (``/proc/cpuinfo`` flag sets), ``golden/``."""

GOLDEN = DATA / "golden"
"""The operator's children of every example, and the published GIE InferencePool CRD."""
