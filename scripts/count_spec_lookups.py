"""Count the operator's string-key lookups (issue 44): ``x.get("key")`` / ``x.get("key", ...)``
and ``x["key"]`` read with a literal string key (not ``x["key"] = ...``, which builds a child),
found by walking each module's AST.

Two counts per file:

- ``all``: every such lookup (spec, status, metadata, children, pods alike);
- ``spec``: those whose key is a property name of the InferenceService spec's schema
  (``crd_schema.SPEC``, at any depth: ``engine``, ``blockSize``, ``algorithm``, ...). Names the
  spec shares with other objects (``replicas``, ``name``, ``type``, ...) count too, so this is an
  upper bound of the spec's own lookups.

The schema's own definition (``crd_schema.py``, ``crd.py``) and the view (``spec_view.py``,
``spec_enums.py``) are left out: they define the keys rather than look them up. Usage::

    python scripts/count_spec_lookups.py [OPERATOR_DIR] [--files]

``OPERATOR_DIR`` defaults to this checkout's ``operator/``; point it at another checkout's (e.g. a
``git worktree`` of an older commit) to compare. The property names always come from the
installed ``kvfleet.operator.crd_schema``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SKIPPED = {"crd_schema.py", "crd.py", "spec_view.py", "spec_enums.py", "__init__.py"}


def spec_keys() -> set[str]:
    """Every property name of the spec's schema, at any depth."""
    from kvfleet.operator.crd_schema import SPEC

    keys: set[str] = set()
    stack = [SPEC]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            keys.update(node.get("properties", {}))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return keys


def lookups(source: str) -> list[str]:
    """The literal string keys looked up in ``source`` (one entry per lookup)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and isinstance(node.slice, ast.Constant)
                and isinstance(node.slice.value, str)):
            out.append(node.slice.value)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out.append(node.args[0].value)
    return out


def count(folder: Path) -> dict[str, tuple[int, int]]:
    """``{file name: (all lookups, spec-key lookups)}`` of the modules in ``folder``."""
    keys = spec_keys()
    result = {}
    for path in sorted(folder.glob("*.py")):
        if path.name in SKIPPED:
            continue
        found = lookups(path.read_text())
        result[path.name] = (len(found), sum(k in keys for k in found))
    return result


def main(argv: list[str]) -> int:
    args = [a for a in argv if not a.startswith("--")]
    folder = Path(args[0]) if args else Path(__file__).resolve().parent.parent / "operator"
    counts = count(folder)
    if "--files" in argv:
        for name, (n_all, n_spec) in counts.items():
            print(f"{name:24s} all {n_all:4d}  spec {n_spec:4d}")
    print(f"total: all {sum(a for a, _ in counts.values())}  spec {sum(s for _, s in counts.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
