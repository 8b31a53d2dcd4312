"""One settings registry (runtime/env.py): no module outside it reads a ``KVFLEET_*`` variable or
spells one's name as a string, and docs/configuration.md holds the table the registry renders.

The scan reads every Python file of runtime/, operator/ and kernels/ (the distribution) with
``ast`` (not grep: a name held in a constant counts, a docstring does not). It fails on

- a read of ``os.environ`` / ``os.getenv`` (``.get``, ``[...]``, ``in``, ``.pop``, ``.setdefault``,
  ``getenv(...)``) whose key is a ``KVFLEET_*`` string, a module constant holding one, or a key it
  cannot resolve to a string (``os.environ.get(some.ATTR)``, ``os.environ[name]``): unprovable
  counts as a violation;
- ``os.environ`` used as a whole mapping other than a copy: ``os.environ if x is None else x``
  would let a later ``environ.get("KVFLEET_...")`` escape the scan.

Exempt, and why: runtime/env.py (the registry); whole-environment COPIES (``{**os.environ, ...}``,
``dict(os.environ)``, ``os.environ.copy()``, ``.items()``), which hand a child process its
environment and read nothing themselves; writes (``os.environ[K] = v``), which set a child's or a
library's setting. tests/, benchmarks/ and scripts/ are not scanned: they set variables around the
code they run (save, set, restore), as a user would.
"""

from __future__ import annotations

import ast
import re
import runpy
import sys
from pathlib import Path

import pytest

from kvfleet.runtime import env

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("runtime", "operator", "kernels")
REGISTRY = ROOT / "runtime" / "env.py"
DOC = ROOT / "docs" / "configuration.md"
_READS = {"get", "pop", "setdefault", "__getitem__", "__contains__"}
_COPIES = {"copy", "items", "keys", "values"}


def _string_constants(tree: ast.Module) -> dict[str, str]:
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    found[t.id] = node.value.value
    return found


def _is_environ(node: ast.AST, aliases: set[str]) -> bool:
    if isinstance(node, ast.Attribute) and node.attr == "environ":
        return isinstance(node.value, ast.Name) and node.value.id == "os"
    return isinstance(node, ast.Name) and node.id in aliases


def _key_problem(key: ast.AST | None, consts: dict[str, str]) -> str | None:
    """None when ``key`` is provably not a KVFLEET_ name, else why not."""
    if isinstance(key, ast.Constant) and isinstance(key.value, str):
        return f"reads {key.value}" if key.value.startswith(env.PREFIX) else None
    if isinstance(key, ast.Name) and key.id in consts:
        value = consts[key.id]
        return f"reads {value} ({key.id})" if value.startswith(env.PREFIX) else None
    return f"reads an unresolved name ({ast.unparse(key) if key is not None else 'nothing'})"


def violations(path: Path) -> list[str]:
    """What ``path`` does with the environment that the registry should do instead."""
    tree = ast.parse(path.read_text(), filename=str(path))
    consts = _string_constants(tree)
    aliases = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "os"
               for a in n.names if a.name == "environ"}
    getenv = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "os"
              for a in n.names if a.name == "getenv"}
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found: list[str] = []

    def bad(node: ast.AST, why: str) -> None:
        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {why}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "getenv"
                 and isinstance(node.func.value, ast.Name) and node.func.value.id == "os")
                or (isinstance(node.func, ast.Name) and node.func.id in getenv)):
            if (why := _key_problem(node.args[0] if node.args else None, consts)):
                bad(node, why)
        if not _is_environ(node, aliases):
            continue
        parent = parents.get(node)
        if isinstance(parent, ast.Attribute) and parent.value is node:
            call = parents.get(parent)
            if parent.attr in _READS and isinstance(call, ast.Call) and call.func is parent:
                if (why := _key_problem(call.args[0] if call.args else None, consts)):
                    bad(node, why)
            elif parent.attr not in _COPIES:
                bad(node, f"uses os.environ.{parent.attr}")
        elif isinstance(parent, ast.Subscript) and parent.value is node:
            if isinstance(parent.ctx, ast.Load) and (why := _key_problem(parent.slice, consts)):
                bad(node, why)
        elif isinstance(parent, ast.Compare) and node in parent.comparators:
            if (why := _key_problem(parent.left, consts)):
                bad(node, why)
        elif isinstance(parent, ast.Dict) and None in parent.keys and node in parent.values:
            pass  # {**os.environ, ...}: a copy for a child process
        elif isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name) and parent.func.id == "dict":
            pass  # dict(os.environ): a copy
        elif isinstance(parent, ast.ImportFrom):
            pass
        else:
            bad(node, "passes os.environ on as a mapping (read it through kvfleet.runtime.env)")
    return found


PEER_INTERPRETER = ("runtime/bench/peers/vllm_offline.py",)
"""Files another program's interpreter runs (vLLM's venv, by path): they never import kvfleet
(not installed there), so they read their one variable themselves (checked below)."""


def _files() -> list[Path]:
    skip = {REGISTRY, *(ROOT / f for f in PEER_INTERPRETER)}
    return [p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py")) if p not in skip]


def test_the_files_a_peer_runs_never_import_kvfleet():
    # vllm_offline.py imported the registry once and every vLLM run of `kvfleet bench peers` failed
    for rel in PEER_INTERPRETER:
        for node in ast.walk(ast.parse((ROOT / rel).read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] == "kvfleet" or (isinstance(node, ast.ImportFrom) and node.level)
                           for n in names), f"{rel} imports {names}"


def test_the_scan_reads_the_tree_and_catches_each_form(tmp_path, monkeypatch):
    assert len(_files()) > 100
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    src = tmp_path / "m.py"
    src.write_text(
        "import os\nfrom os import environ, getenv\nX_ENV = 'KVFLEET_X'\nOK = 'HOME'\n"
        "a = os.environ.get('KVFLEET_A')\nb = os.environ[X_ENV]\nc = getenv('KVFLEET_C')\n"
        "d = 'KVFLEET_D' in environ\ne = os.environ.get(obj.NAME)\nf = os.environ if f is None else f\n"
        "ok1 = os.environ.get(OK)\nok2 = {**os.environ, 'KVFLEET_Y': '1'}\nok3 = dict(os.environ)\n"
        "os.environ['KVFLEET_Z'] = '1'\nok4 = os.getenv('PATH')\n")
    lines = sorted((v.split(":")[1] for v in violations(src)), key=int)
    assert lines == ["5", "6", "7", "8", "9", "10"]


def test_no_module_outside_the_registry_reads_a_kvfleet_variable():
    found = [v for p in _files() for v in violations(p)]
    assert not found, "read these through kvfleet.runtime.env:\n" + "\n".join(found)


def test_no_module_spells_a_variable_name_outside_the_registry():
    # names the operator writes into pods, and the constants tests import, come from the registry
    # (``env.CACHE_DIR.name``), so a rename is one line; prose that mentions a name is not a name
    name = re.compile(r"KVFLEET_[A-Z0-9_]+")
    found = [f"{p.relative_to(ROOT)}:{n.lineno}: {n.value}" for p in _files()
             for n in ast.walk(ast.parse(p.read_text()))
             if isinstance(n, ast.Constant) and isinstance(n.value, str) and name.fullmatch(n.value)]
    assert not found, "name these through kvfleet.runtime.env:\n" + "\n".join(found)


def test_every_declared_name_is_used_outside_the_registry():
    # a row nobody reads is a stale doc; the attribute names of the registry are the variables' own
    used = "\n".join(p.read_text() for p in _files())
    unused = [name for name in env.registry() if f"env.{name.removeprefix(env.PREFIX)}" not in used]
    assert not unused


@pytest.mark.filterwarnings("ignore:'kvfleet.runtime.env' found in sys.modules:RuntimeWarning")  # runpy, re-run
def test_the_docs_table_is_the_rendered_one(monkeypatch, capsys):
    text = DOC.read_text()
    found = re.search(r"<!-- env-table:[^>]*-->\n(.*?)\n<!-- /env-table -->", text, re.S)
    assert found, "docs/configuration.md has no generated table"
    monkeypatch.setenv("HOME", "/home/user")  # the defaults under ~ print as ~ whoever runs it
    runpy.run_module("kvfleet.runtime.env", run_name="__main__")  # what `python -m kvfleet.runtime.env` prints
    assert found.group(1) == capsys.readouterr().out.rstrip("\n") == env.table(), (
        "docs/configuration.md's table is stale: paste `python -m kvfleet.runtime.env`")


@pytest.mark.parametrize(("value", "expected"), [("", 1), ("  ", 1), ("4", 4)])
def test_a_getter_reads_at_call_time_and_blank_is_the_default(monkeypatch, value, expected):
    monkeypatch.setenv(env.TP_WORKER_THREADS.name, value)
    assert env.TP_WORKER_THREADS.get() == expected


def test_a_bad_value_names_the_variable():
    with pytest.raises(env.EnvError, match="KVFLEET_TP_WORKER_THREADS='x': expected int"):
        env.TP_WORKER_THREADS.get({"KVFLEET_TP_WORKER_THREADS": "x"})
    with pytest.raises(env.EnvError, match="KVFLEET_ATTENTION_BACKEND='cuda': expected one of auto, torch"):
        env.ATTENTION_BACKEND.get({"KVFLEET_ATTENTION_BACKEND": "CUDA"})
    assert env.ATTENTION_BACKEND.get({"KVFLEET_ATTENTION_BACKEND": " Triton "}) == "triton"
    assert env.CPU_DECODER.get({"KVFLEET_CPU_DECODER": "0"}) is False
    assert env.CPU_DECODER.get({}) is True
    assert env.CACHE_DIR.get({"KVFLEET_CACHE_DIR": "~/x"}) == Path.home() / "x"


def test_the_families_name_their_members():
    assert env.SERVE_OPTION.name("api_key") == "KVFLEET_API_KEY"
    assert env.ROUTER_OPTION.name("api_key") == "KVFLEET_ROUTER_API_KEY"
    assert env.SERVE_OPTION.read("max_num_seqs", {"KVFLEET_MAX_NUM_SEQS": " 8 "}) == "8"
    assert env.ROUTER_OPTION.read("port", {"KVFLEET_ROUTER_PORT": ""}) is None
    # vLLM's name counts where kvfleet's is unset, never over it
    vllm = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    assert env.SERVE_OPTION.read("allow_runtime_lora_updating", vllm) == "True"
    assert env.SERVE_OPTION.read("allow_runtime_lora_updating", {**vllm, "KVFLEET_ALLOW_RUNTIME_LORA_UPDATING": "0"}) == "0"


def test_the_cpu_choices_are_the_kernels_own():
    from kvfleet.kernels import cpu_features

    assert env.CPU_ISA.choices == cpu_features.ISA_LEVELS
    assert env.CPU_MATMUL.choices == tuple(cpu_features.MATMUL_KERNELS)
