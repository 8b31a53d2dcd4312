"""Weight-only quantization of a loaded model (``--quantization int8|int4``) through torchao.

The decoder's ``nn.Linear`` layers (attention q/k/v/o and the MLP projections) get torchao
weight-only tensors; activations, the KV cache, the embedding, norms and the LM head stay in
the model dtype, and logits are float32 as always. The LM head is left alone: with tied
embeddings (SmolLM2, most small models) quantizing it would need a second, untied copy of
the embedding matrix, and it is the layer whose rounding moves the logits most directly
(measured in docs/performance.md, "Weight-only quantization").

- ``int8``: torchao ``Int8WeightOnlyConfig`` (symmetric, per output channel), CPU and CUDA.
- ``int4``: torchao's CPU int4 tensor, ``torchao.prototype.quantization.int4``
  (``PrototypeInt4WeightOnlyConfig``: asymmetric, groupwise, packed for
  ``aten._weight_int4pack_mm_for_cpu``) in groups of 32 input features (the finest group the
  kernels take: on SmolLM2, perplexity 9.00 against fp32's 9.00, where groups of 64 gave 20.9).
  CPU only.

On an x86-64 CPU with AVX2 and FMA and a C compiler, the layers then run kvfleet's own kernels
(:mod:`kvfleet.kernels.cpu_woq`, through :mod:`kvfleet.runtime.worker.woq_linear`): torch's
CPU int8/int4 kernels are vectorised for AVX-512 only and ran slower than fp32 on AVX2. There the
LM head is quantized too (int8, an untied copy: the embedding lookups keep the model dtype), since
at one stream it is a fifth of the bytes read per token. ``KVFLEET_CPU_WOQ=0`` keeps torchao's
kernels (and the LM head unquantized) for comparison. int4 on that path takes torchao's
tinygemm parameters (the same as its CPU int4 tensor) and packs them for the kernel.

Every refusal is a ``ValueError`` whose message starts with ``--quantization`` (an engine
start-up error: ``kvfleet serve`` logs it on one line and exits 1).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvfleet.runtime import env

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("int8", "int4")
"""Values of ``--quantization`` (``EngineConfig.quantization``); None: the model dtype."""
CPU_WOQ_ENV = env.CPU_WOQ.name
"""``0`` turns kvfleet's AVX2 kernels off (torchao's kernels, LM head unquantized)."""
INT4_GROUP_SIZES = (32,)
"""int4 group sizes, in order of preference. torchao's CPU int4 kernel also takes 64 and 128
(fewer scale bytes: 0.625 or 0.56 bytes per weight instead of 0.75), but measured on the default
model (docs/performance.md, "Weight-only quantization") groups of 64 raised the perplexity of
the fixed text from 9.00 (fp32) to 20.9 and groups of 32 kept it at 9.00."""


@dataclass(frozen=True)
class QuantizationInfo:
    """What :func:`quantize_model` did.

    Attributes:
        method: ``int8`` or ``int4``.
        num_layers: linear layers quantized.
        group_size: int4 group size (None for int8, which is per output channel).
        weight_bytes_before / weight_bytes_after: bytes of every parameter and buffer of the
            model, before and after (see :func:`weight_bytes`).
        kernel: ``kvfleet-avx2`` (:mod:`kvfleet.kernels.cpu_woq`) or ``torchao``.
        lm_head: whether the LM head was quantized (int8; only with ``kvfleet-avx2``).
    """

    method: str
    num_layers: int
    group_size: int | None
    weight_bytes_before: int
    weight_bytes_after: int
    kernel: str = "torchao"
    lm_head: bool = False


def _tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds; a tensor subclass (torchao's qdata/scales, a tensor-parallel DTensor's
    local shard) counts its inner tensors. Non-tensor attributes (a DTensor's device mesh) count 0."""
    if not isinstance(t, torch.Tensor):
        return 0
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None and type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        names, _ = flatten()
        return sum(_tensor_bytes(getattr(t, n, None)) for n in names)
    return t.numel() * t.element_size()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers, tied tensors counted once, quantized weights
    as what they store (int8 / packed int4 data plus scales and zero points)."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += _tensor_bytes(t)
    return total


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Weight bytes one decode token reads: :func:`weight_bytes` less the input embedding table
    when the LM head does not read it (an untied or quantized head: a token's lookup reads one
    row). The bound of one stream is memory bandwidth / this (:mod:`kvfleet.runtime.bench.peers.report`)."""
    total = weight_bytes(model)
    inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    table = getattr(inp, "weight", None)
    if isinstance(table, torch.Tensor) and getattr(out, "weight", None) is not table:
        total -= _tensor_bytes(table) - table.shape[-1] * table.element_size()
    return total


def decoder_linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The ``nn.Linear`` layers :func:`quantize_model` quantizes: every one but the output
    embedding (the LM head)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {name: mod for name, mod in model.named_modules()
            if isinstance(mod, torch.nn.Linear) and mod is not head}


def int4_group_size(model: torch.nn.Module) -> int:
    """The first of :data:`INT4_GROUP_SIZES` that divides every decoder linear's ``in_features``.

    Raises:
        ValueError: (``--quantization int4: ...``) none does.
    """
    widths = {m.in_features for m in decoder_linears(model).values()}
    for g in INT4_GROUP_SIZES:
        if all(w % g == 0 for w in widths):
            return g
    raise ValueError(
        f"--quantization int4: the model's linear input sizes {sorted(widths)} are not all "
        f"multiples of one of the int4 group sizes {INT4_GROUP_SIZES}; use --quantization int8"
    )


def check_quantization(
    method: str | None, device: torch.device, dtype: torch.dtype, tensor_parallel_size: int = 1
) -> None:
    """Refuse what :func:`quantize_model` cannot do, before any weight is read.

    Raises:
        ValueError: starting with ``--quantization``: an unknown method, torchao missing,
            tensor parallelism, int4 on a device other than the CPU, or a dtype the kernel lacks.
    """
    if method is None:
        return
    if method not in QUANTIZATIONS:
        raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATIONS)} (or unset); got {method!r}")
    try:
        import torchao  # noqa: F401
    except ImportError as exc:  # pragma: no cover - a dependency of kvfleet
        raise ValueError(f"--quantization {method}: needs torchao (pip install 'torchao==0.18.*'): {exc}") from None
    if tensor_parallel_size > 1:
        raise ValueError(
            f"--quantization {method}: not supported with tensor_parallel_size > 1 "
            "(the tensor-parallel plan shards plain weights)"
        )
    if method == "int4" and device.type != "cpu":
        raise ValueError(
            f"--quantization int4: only on the CPU (torchao's int4 CPU kernel); device is "
            f"{device.type}; use --quantization int8 there"
        )
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"--quantization {method}: unsupported dtype {dtype}")


def torchao_config(method: str, group_size: int | None = None):
    """The torchao config for ``method`` (inductor settings left alone: torchao's
    ``set_inductor_config`` would change process-wide compile settings)."""
    if method == "int8":
        from torchao.quantization import Int8WeightOnlyConfig

        return Int8WeightOnlyConfig(set_inductor_config=False)
    from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

    return PrototypeInt4WeightOnlyConfig(group_size=group_size or 128, set_inductor_config=False)


def linear_filter(model: torch.nn.Module) -> Callable[[torch.nn.Module, str], bool]:
    """``quantize_``'s ``filter_fn``: the layers of :func:`decoder_linears`."""
    chosen = {id(m) for m in decoder_linears(model).values()}
    return lambda mod, _fqn: id(mod) in chosen


def quantize_model(model: torch.nn.Module, method: str) -> QuantizationInfo:
    """Quantize ``model``'s decoder linears in place with torchao (see the module docstring).

    Raises:
        ValueError: starting with ``--quantization``: no linear layer to quantize, or (int4)
            no group size fits the model.
    """
    from torchao.quantization import quantize_

    if use_cpu_kernels(model):  # fused 3-D experts as one linear per expert, quantized like the dense layers
        from kvfleet.runtime.worker.moe_experts import split_experts

        split_experts(model)
    layers = decoder_linears(model)
    if not layers:
        raise ValueError(
            f"--quantization {method}: the model has no nn.Linear layers to quantize ({type(model).__name__})"
        )
    group = int4_group_size(model) if method == "int4" else None
    before = weight_bytes(model)
    kernel = "kvfleet-avx2" if use_cpu_kernels(model) else "torchao"
    if method == "int8" or kernel == "torchao":
        quantize_(model, torchao_config(method, group), filter_fn=linear_filter(model))
    lm_head = False
    if kernel == "kvfleet-avx2":
        from kvfleet.runtime.worker.woq_linear import convert_model

        lm_head = model.get_output_embeddings() is not None
        convert_model(model, layers, method, group, lm_head)
    after = weight_bytes(model)
    info = QuantizationInfo(method, len(layers), group, before, after, kernel, lm_head)
    logger.info(
        "quantized %d linear layers to %s%s%s with %s kernels (weights %.1f MiB -> %.1f MiB)",
        info.num_layers,
        method,
        f" (group size {group})" if group else "",
        " and the LM head to int8" if lm_head else "",
        kernel,
        before / 2**20,
        after / 2**20,
    )
    return info


def use_cpu_kernels(model: torch.nn.Module) -> bool:
    """Whether :func:`quantize_model` uses kvfleet's AVX2 kernels: the model is on the CPU, the
    kernels build here (:func:`kvfleet.kernels.cpu_woq.available`) and ``KVFLEET_CPU_WOQ`` is not 0."""
    if not env.CPU_WOQ.get():
        return False
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu":
        return False
    from kvfleet.kernels import cpu_woq

    return cpu_woq.available()  # built under $KVFLEET_CACHE_DIR/kernels
