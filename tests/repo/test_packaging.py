"""The distribution maps the top-level folders to kvfleet.* and installs the CLI."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib

from support.paths import ROOT

FOLDERS = {"runtime": "kvfleet.runtime", "operator": "kvfleet.operator", "kernels": "kvfleet.kernels"}


def test_every_python_package_folder_is_listed_in_pyproject():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    assert {cfg["package-dir"][name] for name in FOLDERS.values()} == set(FOLDERS)
    for folder, package in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            name = ".".join([package, *rel.parts]) if rel.parts else package
            assert name in listed, f"{init.parent} is a package but {name} is not in pyproject's packages"


def test_no_top_level_operator_package_shadows_the_stdlib():
    import operator

    assert hasattr(operator, "itemgetter") and "site-packages" not in (operator.__file__ or "")
    for package in FOLDERS.values():
        assert importlib.import_module(package).__name__ == package


def test_cli_dispatches_and_rejects_unknown_commands():
    run = lambda *a: subprocess.run([sys.executable, "-m", "kvfleet.runtime.cli", *a], capture_output=True, text=True)
    ok = run("--help")
    assert ok.returncode == 0 and "serve" in ok.stdout and "operator" in ok.stdout
    bad = run("frobnicate")
    assert bad.returncode == 2 and "unknown command" in bad.stderr


def test_runtime_exports_its_public_api():
    # README / docs/engine.md name these as the Python API of kvfleet.runtime.
    import kvfleet.runtime as runtime

    for name in runtime.__all__:
        assert getattr(runtime, name) is not None, name
    assert {"LLM", "SamplingParams", "LLMEngine", "AsyncLLMEngine", "EngineConfig"} <= set(runtime.__all__)


def test_the_wheel_ships_the_c_source_the_cpu_kernels_build(tmp_path):
    """``kvfleet.kernels.cpu_woq`` compiles ``cpu_woq.c`` and ``cpu_decoder.c`` (with the header
    ``cpu_gemv.h``) at run time: a non-editable install (the Docker image's ``uv pip install /src``)
    must contain every one, exactly the files the build reads."""
    import zipfile

    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("kvfleet-*.whl")
    from kvfleet.kernels import cpu_lib

    names = zipfile.ZipFile(wheel).namelist()
    for source in (*cpu_lib.SOURCES, *cpu_lib.HEADERS):
        assert f"kvfleet/kernels/{source.name}" in names
