"""Shared fixtures: the real helm/kubectl binaries, the loaded default model, the Triton interpreter."""

import os
import shutil
from pathlib import Path

import pytest

# --- real helm and kubectl binaries (tests/repo/test_chart*.py, test_gitops.py) ----------
# Installed by `bash .ci/install-helm-kubectl.sh .tools/bin` (part of `.ci/setup --test`).
# Outside CI a missing binary skips the tests that need it, saying how to install it;
# in CI (CI=true) it fails them, so that a broken install step cannot pass as green.


def _k8s_tool(name: str) -> str:
    root = Path(__file__).resolve().parent.parent
    for folder in (os.environ.get("KVFLEET_TOOLS_BIN"), root / ".tools" / "bin"):
        if folder and (Path(folder) / name).is_file() and os.access(Path(folder) / name, os.X_OK):
            return str(Path(folder) / name)
    found = shutil.which(name)
    if found:
        return found
    message = (f"the real `{name}` binary is not installed: run `bash .ci/install-helm-kubectl.sh .tools/bin` "
               f"(or `bash .ci/setup --test`)")
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message + " -- required in CI", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def helm_bin() -> str:
    """Path of the real `helm` (v4) binary."""
    return _k8s_tool("helm")


@pytest.fixture(scope="session")
def kubectl_bin() -> str:
    """Path of the real `kubectl` binary (with its built-in kustomize)."""
    return _k8s_tool("kubectl")


# --- engine: one loaded default model per session (tests/unit/runtime/engine/, worker/) --------------
# Set before transformers / torch are imported: no hub access in tests, and OpenMP
# threads that sleep rather than spin (the 2 shared cores are busy with other tests).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Subprocesses started from the repository root must not import operator/ as the stdlib
# `operator` module (see README, "Set-up").
os.environ.setdefault("PYTHONSAFEPATH", "1")
# The fleet secret every `kvfleet serve` / `kvfleet router` of the suite shares with no flag (issue
# 42): the default file, created by the first of them, in a folder of this run, never the user's.
if not os.environ.get("KVFLEET_FLEET_SECRET"):
    import tempfile

    os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="kvfleet-test-config-")


@pytest.fixture(scope="session")
def smollm2():
    """The default model (SmolLM2-135M-Instruct, fp32, CPU) as a
    ``kvfleet.runtime.worker.model_loader.LoadedModel``, shared by every engine of the session
    (``LLMEngine(config, loaded=smollm2)``). Its attention is switched to the engine's paged
    attention: load another copy (``load_model()``) to run plain transformers on it."""
    from kvfleet.runtime.worker.model_loader import load_model

    return load_model(None, dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def smollm2_two_layers(smollm2, tmp_path_factory):
    """The default model cut to its first two decoder layers (real weights, embedding, final norm
    and LM head), saved as a checkpoint and loaded as the engine loads any model. For tests whose
    cost grows with the layer count while every layer runs the same code at the same shapes:
    the Triton interpreter (tests/unit/kernels/test_triton_in_engine.py) and dynamo's tracing and guards
    (tests/unit/runtime/worker/test_compilation.py)."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvfleet.runtime.worker.model_loader import load_model

    path = tmp_path_factory.mktemp("smollm2-first2")
    cut = AutoModelForCausalLM.from_pretrained(smollm2.source, num_hidden_layers=2, dtype=torch.float32)
    cut.save_pretrained(path)
    smollm2.tokenizer.save_pretrained(path)
    del cut
    loaded = load_model(str(path), dtype="float32", device="cpu")
    assert loaded.model.config.num_hidden_layers == 2
    return loaded


@pytest.fixture(scope="module")
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


# --- Triton interpreter for the kernel tests (tests/unit/kernels/) -------------------
# Without a CUDA device the Triton kernels are tested under the interpreter. The flag must
# be set before the first `import triton` in the process -- and torch._dynamo imports triton
# as soon as transformers touches it (model loading), so a kernel test module cannot set it
# itself in a full run. Nothing else runs Triton code on such a machine.
def pytest_configure(config):
    # Runs after the environment set-up above and before any test module is imported.
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def kernels_build_root(tmp_path_factory):
    """One build root for the CPU kernels' library variants (``<root>/kernels/<name>.so``) for
    the session: tests/unit/kernels/test_cpu_lib.py compiles every variant into it and the image
    test's prebuild (tests/repo/test_images.py) finds them there, so each compiles once, not twice."""
    return tmp_path_factory.mktemp("kernels-build")


# --- CPU kinds (tests/e2e/test_cpu_kinds.py) -------------------------------------------
# The modules whose expectations depend on the kernels the CPU's ISA level selects (the fused
# decoder's matmul kind, the library variant). tests/e2e/test_cpu_kinds.py runs them again in a
# child pytest capped to each lower CPU kind ($KVFLEET_CPU_ISA), so that a change that breaks
# the Zen 4 path or the AVX2 floor fails here too, not only where such a CPU runs the suite.
# The child caps torch's MKL / oneDNN / ATen as well (test_cpu_kinds.TORCH_CAPS): the torch paths the
# fused one is compared with differ per CPU too (issue 40's Zen 4 failure was MKL's AVX2 kernels).
# Not tests/unit/kernels/test_cpu_lib.py: it names each library variant itself (compiles all four,
# runs each one the CPU has), so under a cap it runs a subset of what the main suite ran -- two
# reruns that protected nothing and cost the four variants' compile each. The C step's layers of
# each family, its mixtures of experts, LoRA and act-order int4 run on the AVX2 and AVX-512
# library variants only here (the main suite on an AMX machine loads the amx one): ~25 s a kind
# for those five modules at load 7 on the 2-core Xeon (2026-12-06). Left out, each passing under
# both caps: the engine's and worker's other modules (their per-kind expectations are parametrized
# over the kinds this CPU has, or pinned to one: ~30 min a kind) and the serve e2e.
CPU_KIND_MODULES = (
    "tests/unit/kernels/test_cpu_attention.py",
    "tests/unit/kernels/test_cpu_decoder.py",
    "tests/unit/kernels/test_cpu_decoder_layers.py",
    "tests/unit/kernels/test_cpu_moe.py",
    "tests/unit/kernels/test_cpu_lora.py",
    "tests/unit/kernels/test_cpu_perm.py",
    "tests/unit/runtime/worker/test_cpu_decode.py",
    "tests/unit/runtime/worker/test_moe_experts.py",
    "tests/unit/runtime/engine/test_determinism.py",
)


def pytest_collection_modifyitems(config, items):
    root = Path(__file__).resolve().parent.parent
    for item in items:
        if str(Path(str(item.fspath)).resolve().relative_to(root)) in CPU_KIND_MODULES:
            item.add_marker(pytest.mark.cpu_kinds)


# --- The images (tests/repo/test_images.py) ---------------------------------------------
# Building both images is minutes of disk and package-index waits: it starts in the background
# as soon as collection holds the image test, beside the rest of the suite (tests/support/image_build.py).
def pytest_collection_finish(session):
    from support import image_build

    if session.config.option.collectonly or not any(item.nodeid == image_build.TEST_ID for item in session.items):
        return
    if image_build.why_not() is None:
        image_build.start()


def pytest_sessionfinish(session, exitstatus):
    from support import image_build

    image_build.stop()
