"""ruff (config in pyproject.toml: pyflakes, pycodestyle, bugbear, imports, pyupgrade) is clean.

CI runs the suite, so a lint finding fails CI like any test; locally `.venv/bin/ruff check .`
shows the same findings and `ruff check --fix` repairs the mechanical ones.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from support.paths import ROOT


def _ruff() -> str:
    beside = Path(sys.executable).with_name("ruff")  # installed with the test extras
    found = str(beside) if beside.exists() else shutil.which("ruff")
    assert found, "ruff is not installed: `bash .ci/setup --test` installs the test extras"
    return found


def test_ruff_check_is_clean():
    out = subprocess.run([_ruff(), "check", "--output-format", "concise", "."], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]


def test_ruff_reads_the_project_config():
    # Guards the test above against a config that selects nothing.
    out = subprocess.run([_ruff(), "check", "--show-settings", "pyproject.toml"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "line_length = 120" in out.stdout
    for rule in ("(F401)", "(B006)", "(I001)", "(E711)"):  # pyflakes, bugbear, isort, pycodestyle
        assert rule in out.stdout, rule
