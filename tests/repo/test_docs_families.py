"""docs/performance.md's table of model families ("Model families on the fused path") is the one
:func:`kvfleet.runtime.worker.recipes.families_table` renders from the recipe table, not a
hand-kept copy."""

from __future__ import annotations

import re
from pathlib import Path

from kvfleet.runtime.worker.recipes import families_table

DOC = Path(__file__).resolve().parents[2] / "docs" / "performance.md"


def test_the_docs_families_table_is_the_rendered_one():
    text = DOC.read_text()
    found = re.search(r"<!-- families-table:[^>]*-->\n(.*?)\n<!-- /families-table -->", text, re.S)
    assert found, "docs/performance.md has no generated families table"
    assert found.group(1) == families_table(), (
        "docs/performance.md's families table is stale: paste `python -m kvfleet.runtime.worker.recipes`")
