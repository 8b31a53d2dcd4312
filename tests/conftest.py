

# --- real helm and kubectl binaries (tests/test_chart*.py, tests/test_gitops*.py) ----------
# Installed by `bash .ci/install-helm-kubectl.sh .tools/bin` (part of `.ci/setup --test`).
# Outside CI a missing binary skips the tests that need it, saying how to install it;
# in CI (CI=true) it fails them, so that a broken install step cannot pass as green.
import os as _k8s_os
import shutil as _k8s_shutil
from pathlib import Path as _K8sPath

import pytest as _k8s_pytest


def _k8s_tool(name: str) -> str:
    root = _K8sPath(__file__).resolve().parent.parent
    for folder in (_k8s_os.environ.get("KVFLEET_TOOLS_BIN"), root / ".tools" / "bin"):
        if folder and (_K8sPath(folder) / name).is_file() and _k8s_os.access(_K8sPath(folder) / name, _k8s_os.X_OK):
            return str(_K8sPath(folder) / name)
    found = _k8s_shutil.which(name)
    if found:
        return found
    message = (f"the real `{name}` binary is not installed: run `bash .ci/install-helm-kubectl.sh .tools/bin` "
               f"(or `bash .ci/setup --test`)")
    if _k8s_os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        _k8s_pytest.fail(message + " -- required in CI", pytrace=False)
    _k8s_pytest.skip(message)


@_k8s_pytest.fixture(scope="session")
def helm_bin() -> str:
    """Path of the real `helm` (v4) binary."""
    return _k8s_tool("helm")


@_k8s_pytest.fixture(scope="session")
def kubectl_bin() -> str:
    """Path of the real `kubectl` binary (with its built-in kustomize)."""
    return _k8s_tool("kubectl")


# --- engine: one loaded default model per session (tests/test_engine_*.py) --------------
# Set before transformers / torch are imported: no hub access in tests, and OpenMP
# threads that sleep rather than spin (the 2 shared cores are busy with other tests).
_k8s_os.environ.setdefault("HF_HUB_OFFLINE", "1")
_k8s_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Subprocesses started from the repository root must not import operator/ as the stdlib
# `operator` module (see README, "Set-up").
_k8s_os.environ.setdefault("PYTHONSAFEPATH", "1")


@_k8s_pytest.fixture(scope="session")
def smollm2():
    """The default model (SmolLM2-135M-Instruct, fp32, CPU) as a
    ``kvfleet.runtime.worker.model_loader.LoadedModel``, shared by every engine of the session
    (``LLMEngine(config, loaded=smollm2)``). Its attention is switched to the engine's paged
    attention: load another copy (``load_model()``) to run plain transformers on it."""
    from kvfleet.runtime.worker.model_loader import load_model

    return load_model(None, dtype="float32", device="cpu")


@_k8s_pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op torch thread while a module runs, restored afterwards. On the 2 cores
    shared by several test processes, a second OpenMP thread that is descheduled makes every
    op wait for it (decode steps measured ~10x slower). Modules that run the engine in
    threads beside a server use it: ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --- Triton interpreter for the kernel tests (tests/test_kernels_*.py) -------------------
# Without a CUDA device the Triton kernels are tested under the interpreter. The flag must
# be set before the first `import triton` in the process -- and torch._dynamo imports triton
# as soon as transformers touches it (model loading), so a kernel test module cannot set it
# itself in a full run. Nothing else runs Triton code on such a machine.
import os as _kernels_os

import torch as _kernels_torch

if not _kernels_torch.cuda.is_available():
    _kernels_os.environ.setdefault("TRITON_INTERPRET", "1")
