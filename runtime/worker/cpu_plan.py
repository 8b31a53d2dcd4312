"""The CPU execution plan: the activation dtype, the weight storage and the decode path an engine
runs on this CPU, chosen from what the CPU has and what was asked for.

:func:`plan` is pure (no torch, no I/O): it maps the CPU's features
(:class:`kvfleet.kernels.cpu_features.CpuFeatures`), ``--dtype``, ``--quantization`` and the
process's facts (:class:`CpuFacts`: do kvfleet's C kernels build here, are they switched on) to
a :class:`CpuPlan`. :mod:`kvfleet.runtime.worker.model_loader` calls it for every load on the
CPU, loads the model in :attr:`CpuPlan.dtype` and logs :meth:`CpuPlan.describe` at INFO with the
CPU's summary. CUDA devices do not use it (``auto`` stays bf16 there, fp16 on older GPUs).

The rules (docs/performance.md, "Which path runs on which CPU"):

- ``--dtype auto`` (also with ``--quantization``): **float32 activations and KV cache on every
  CPU**. The fused C decoder (:mod:`kvfleet.runtime.worker.cpu_decode`) runs float32 activations
  only, and it is kvfleet's fastest decode on every CPU measured: on a Zen 4 with AVX512-BF16 one
  stream ran 44.7 tok/s in fp32 against 10.9 in bf16 (int8 weights: 102 against 15.1), and 48
  requests at once ran 89.8 tok/s in both. In float32 a seeded request also kept its text beside
  other requests where bf16 on that CPU did not (tests/test_determinism.py). Weights: the quantization
  if given; else the checkpoint's own when they are smaller and the kernels run them (a GGUF file's
  tensors as stored, :mod:`kvfleet.runtime.worker.gguf_model`; a bf16 checkpoint's
  bf16 weights, on every CPU: lossless); else bf16 on a CPU with native bf16 where
  :data:`BF16_WEIGHT_STORAGE` is on and the fused decoder is expected (half the bytes per decode
  token; prefill in oneDNN's native bf16); else float32. With quantized weights (a GGUF file's
  tensors, or ``--quantization``) on a CPU with native bf16, prefill (steps over 32 rows) runs
  oneDNN's bf16 matmul on the weights dequantized to bf16 (``native_bf16_prefill``; the rounding
  is far below the quantization's error); decode keeps the float32 C kernels.
- **bf16 matmuls** (``matmul``): wherever the fused decoder is expected with quantized or bf16
  weights and ``--dtype float32`` was not asked, its matmuls round each activation row and each
  dequantized weight to bf16 and sum in float32, every row's bits independent of the step's other
  rows: on AMX tiles (``amx``, ``kernels/cpu_amx.h``) on a CPU with AMX-BF16 (Sapphire Rapids and
  later), as AVX512-BF16 dot products (``avx512_bf16``, ``kernels/cpu_dpbf16.h``) on a CPU with
  AVX512-BF16 and no AMX (AMD Zen 4, Intel Cooper Lake); prefill then runs fused and the KV cache
  is bf16 (:mod:`kvfleet.runtime.worker.cpu_decode`). On AMX, decode steps of 48 rows ran their
  matmuls ~4x faster than on the float32 kernels (23 against 92 ms a step); one stream is slower
  there (widening the weights to bf16 costs more than reading them), and ``--dtype float32`` (or
  ``$KVFLEET_CPU_MATMUL=float32``) keeps the float32 kernels (docs/performance.md, "AMX tiles" and
  "AVX512-BF16 dot products").
- A **packed 4-bit checkpoint** (AWQ / GPTQ / compressed-tensors, ``--dtype auto``): its weights
  repacked onto the int4 kernels (int8 for W8A8), float32 activations, the matmul kind those kernels
  run for ``--quantization int4`` and GGUF files (AMX tiles / AVX512-BF16 dot products where the CPU
  has them), and its unquantized LM head stored in bf16 on CPUs with native bf16 where
  :data:`BF16_WEIGHT_STORAGE` is on and the fused decoder is expected (half the head's bytes; bf16
  weights are tile-loaded as stored). Measured at 1 and 48 rows (docs/performance.md, "Packed 4-bit
  checkpoints"). ``--dtype float32``: the float32 kernels and a float32 head.
- ``--dtype float32``: float32 everything; weights the quantization if given.
- ``--dtype bfloat16`` without ``--quantization``: with :data:`BF16_WEIGHT_STORAGE` on and the
  kernels here, bf16 weight storage with float32 compute (the fused decoder keeps running);
  otherwise bf16 weights, activations and KV cache through torch (the fused decoder is off).
- ``--dtype bfloat16`` or ``float16`` with ``--quantization``, and ``--dtype float16``: as asked,
  through torch (the fused decoder is off; the reason says so).

**Per matrix** (:func:`matrix_matmul`, the one place that chooses it): every matrix runs the
plan's ``matmul`` except **a quantized LM head that holds more than half the weights a one-row
step reads** (:data:`HEAD_FLOAT32_SHARE`; a large vocabulary on a small model: Gemma 3 270M's
262,144 x 640 Q8_0 head is 62 %), which runs the float32 kernels. At one row the bf16 kinds lose to
the float32 kernels ~2x on quantized weights (widening each weight to bf16 costs more than the
float32 multiply-add), at 48 rows they win ~4x; a head that dominates the weights decides one
stream, so it takes the float32 kernels, and the layers keep the bf16 kind's batch speed. bf16
weights are tile-loaded as stored (no widening): there the tiles cost ~1.1x at one row and win ~10x
at 48, so a bf16 head keeps them. The choice is made once
per matrix, never per row count (batch invariance: docs/performance.md, "Which kernels each matrix
runs").

No start-up measurement refines the choice: with float32 activations the flags decide nothing
but the weight storage, and a timing on a shared CPU (steps measured 10-20x slower under
contention) would make the numerics of a restart depend on the load at that moment.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.kernels.cpu_features import MATMUL_KERNELS, CpuFeatures

BF16_WEIGHT_STORAGE = True
"""The one switch of bf16 weight storage (``Bf16Linear``, ``woq_linear.to_bf16_weights``: bf16
weights, float32 activations, the fused decoder reading half the bytes). True: ``--dtype
bfloat16`` stores bf16 weights and computes in float32, and ``auto`` stores bf16 weights on CPUs
with native bf16 (AVX512-BF16 / AMX: prefill matmuls run oneDNN's bf16 there) wherever the fused
decoder is expected. On AVX2 ``auto`` keeps float32 weights: steps of more than 32 rows that the
fused decoder does not take widen bf16 weights before torch's fp32 matmul, which is not measured
to pay there. False: ``--dtype bfloat16`` runs bf16 activations through torch, as before."""

HEAD_FLOAT32_SHARE = 0.5
"""The share of a one-row step's weights above which a quantized LM head runs the float32 kernels
(:func:`matrix_matmul`). Measured on a Xeon with AMX, one thread, ms per call (float32 / AMX
tiles / AVX512-BF16 dot products): Gemma 3's int8g head [262144, 640] 16.5 / 37.0 / 28.0 at one
row, 203 / 51 / 173 at 48; SmolLM2's bf16 head [49152, 576] 2.1 / 2.4 / 2.8 at one row, 39 / 4.0 /
30 at 48 (docs/performance.md, "Which kernels each matrix runs")."""

DTYPES = ("auto", "float32", "float16", "bfloat16")
QUANTIZATIONS = ("int8", "int4")


@dataclass(frozen=True)
class CpuFacts:
    """What the process can run, besides the CPU's flags (gathered by the model loader).

    Attributes:
        kernels: kvfleet's C kernels build and load here (:func:`kvfleet.kernels.cpu_woq.available`).
        woq_kernels: ``$KVFLEET_CPU_WOQ`` is not ``0`` (int8/int4 layers run kvfleet's kernels,
            which the fused decoder reads; torchao's it does not).
        fused_decoder: ``$KVFLEET_CPU_DECODER`` is not ``0``.
        tensor_parallel_size: ranks the model is split over (each runs the fused path on its
            shard, float32 weights as transformers' plan loads them: no bf16 storage, no bf16 matmuls).
    """

    kernels: bool
    woq_kernels: bool = True
    fused_decoder: bool = True
    tensor_parallel_size: int = 1


@dataclass(frozen=True)
class CpuPlan:
    """How one engine runs on the CPU.

    Attributes:
        dtype: the activations' and KV cache's dtype (the cache's unless ``kv_cache_dtype`` sets
            another, :mod:`kvfleet.runtime.worker.model_runner`), and the dtype the checkpoint is
            loaded in (``float32``, ``bfloat16`` or ``float16``).
        weights: how the decoder's linear layers store their weights: ``fp32``, ``bf16``,
            ``fp16``, ``int8`` or ``int4``.
        bf16_weights: the loader converts the float32 weights to bf16 storage after loading
            (``woq_linear.to_bf16_weights``; a packed checkpoint's only float32 linear, its LM head:
            ``packed_checkpoints.bf16_head``); only with :data:`BF16_WEIGHT_STORAGE`.
        fused_decoder: decode steps are expected to run the fused C decoder (the model's
            architecture still decides, :func:`kvfleet.runtime.worker.cpu_decode.build`).
        native_bf16_prefill: prefill matmuls run in bf16 on native bf16 hardware (AVX512-BF16 or
            AMX): bf16 weights or activations on a CPU with :attr:`CpuFeatures.native_bf16`.
        reason: why, in one sentence.
        gguf_stored: the loader reads the GGUF file's tensors as stored into the kernels' formats
            (:mod:`kvfleet.runtime.worker.gguf_model`; ``weights`` is ``gguf``).
        packed_int4: the checkpoint's AWQ / GPTQ / compressed-tensors weights are repacked at load onto
            the int4 (int8 for W8A8) kernels (:mod:`kvfleet.runtime.worker.packed_checkpoints`;
            ``weights`` is ``packed``).
        matmul: the fused decoder's matmul kernels (``kernels.cpu_decoder.MATMULS``): ``amx``
            (AMX tiles, ``kernels/cpu_amx.h``) on CPUs with AMX-BF16, ``avx512_bf16`` (``vdpbf16ps``
            dot products, ``kernels/cpu_dpbf16.h``) on CPUs with AVX512-BF16 and no AMX, with
            quantized or bf16 weights unless ``--dtype float32``: each activation row and
            dequantized weight rounded to bf16, float32 sums, still bitwise batch-invariant. Else
            ``float32``.
    """

    dtype: str
    weights: str
    bf16_weights: bool
    fused_decoder: bool
    native_bf16_prefill: bool
    reason: str
    gguf_stored: bool = False
    packed_int4: bool = False
    matmul: str = "float32"

    @property
    def bf16_matmuls(self) -> bool:
        """The fused decoder's matmuls round activations and weights to bf16 (:attr:`matmul`)."""
        return self.matmul != "float32"

    def describe(self) -> str:
        """One line for the start-up log."""
        return (f"activations {self.dtype}, weights {self.weights}, fused decoder "
                f"{'expected' if self.fused_decoder else 'off'}{self._on()}, prefill "
                f"{self._prefill()}: {self.reason}")

    def _on(self) -> str:
        return f" on {MATMUL_NAMES[self.matmul]}" if self.bf16_matmuls else ""

    def _prefill(self) -> str:
        if self.bf16_matmuls:
            return "fused (bf16 matmuls)"
        if self.native_bf16_prefill:
            return "matmuls bf16 (native)"
        return "matmuls " + {"float32": "fp32", "bfloat16": "bf16 (emulated)", "float16": "fp16"}[self.dtype]


CHECKPOINT_WEIGHTS = ("fp32", "bf16", "gguf", "packed")

MATMUL_NAMES = MATMUL_KERNELS
"""Each matmul kernel of the fused decoder (:attr:`CpuPlan.matmul`) as the start-up lines name it
(:data:`kvfleet.kernels.cpu_features.MATMUL_KERNELS`)."""
BF16_LEVELS = tuple(k for k in MATMUL_KERNELS if k != "float32")
"""The ISA levels whose own bf16 kernels the fused decoder runs (the level's name is the kernel's:
``cpu_dpbf16.h``'s dot products, ``cpu_amx.h``'s tiles)."""
_BF16_MATMULS = ("; the fused decoder's matmuls on {} (activations and dequantized weights rounded to bf16, "
                 "float32 sums: every row summed alike in any batch), prefill fused in them")
_INVARIANT = "; prefill float32 (--batch-invariant; --no-batch-invariant: native bf16 prefill, faster)"
_BF16_PREFILL = ("; prefill matmuls in bf16 on this CPU's native bf16 (the quantized weights dequantized to "
                 "bf16: a rounding far below the quantization's own error; decode stays float32)")


def plan(features: CpuFeatures, dtype: str = "auto", quantization: str | None = None, *,
         facts: CpuFacts, bf16_weight_storage: bool | None = None, checkpoint_weights: str = "fp32",
         batch_invariant: bool = True) -> CpuPlan:
    """The fastest correct way to run on this CPU what was asked (the rules: module docstring).

    Args:
        features: the CPU's features (:func:`kvfleet.kernels.cpu_features.detect`).
        dtype: ``--dtype``: ``auto``, ``float32``, ``float16`` or ``bfloat16``.
        quantization: ``--quantization``: ``int8``, ``int4`` or None.
        facts: what the process can run (:class:`CpuFacts`).
        bf16_weight_storage: override of :data:`BF16_WEIGHT_STORAGE` (tests).
        checkpoint_weights: how the checkpoint stores its linear weights: ``fp32`` (or fp16),
            ``bf16`` (``torch_dtype`` bfloat16), ``gguf`` (a GGUF file kvfleet's reader takes),
            ``packed`` (an AWQ / GPTQ / compressed-tensors 4-bit checkpoint).
        batch_invariant: ``--batch-invariant`` (the default): no native bf16 prefill on the
            float32-activation paths (its matmuls round differently with the step's row count);
            False: native bf16 prefill of quantized and bf16 weights where the CPU has it.

    Raises:
        ValueError: an unknown dtype, quantization or checkpoint_weights.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATIONS)} (or unset); got {quantization!r}")
    if checkpoint_weights not in CHECKPOINT_WEIGHTS:
        raise ValueError(f"checkpoint_weights must be one of {', '.join(CHECKPOINT_WEIGHTS)}; "
                         f"got {checkpoint_weights!r}")
    bf16_storage = BF16_WEIGHT_STORAGE if bf16_weight_storage is None else bf16_weight_storage
    kernels = facts.kernels and features.isa_level is not None
    single = facts.tensor_parallel_size == 1
    # The fused decoder reads float32 activations and fp32 / kvfleet int8 / int4 (/ bf16) weights; under
    # tensor parallelism each rank's float32 shard (runtime/worker/cpu_decode_tp.py), stored as loaded.
    fused_possible = kernels and facts.fused_decoder and (quantization is None or facts.woq_kernels)
    why_not_fused = _why_not_fused(features, facts, kernels, quantization)
    native_gguf = checkpoint_weights == "gguf" and facts.woq_kernels and single
    # bf16 matmuls where the CPU has them natively (the best kernel of its ISA level); one rank only
    bf16_kernel = features.isa_level if features.isa_level in BF16_LEVELS and fused_possible and single \
        and dtype != "float32" else "float32"
    if dtype in ("auto", "float32") and quantization is None and checkpoint_weights == "packed":
        # the int4 kernels --quantization int4 and GGUF files run, with their matmul kind; the checkpoint's
        # unquantized LM head in bf16 where the CPU has native bf16 (half its bytes; docs/performance.md)
        bf16_head = dtype == "auto" and bf16_storage and features.native_bf16 and fused_possible
        return CpuPlan("float32", "packed", bf16_head, fused_possible, False,
                       f"dtype {dtype}: the checkpoint's quantized weights (AWQ / GPTQ / compressed-tensors) "
                       "repacked at load onto kvfleet's int4 / int8 kernels, float32 activations"
                       + ("; its unquantized LM head stored in bf16 (half the bytes)" if bf16_head else "")
                       + ("" if fused_possible else f" (the fused decoder is off: {why_not_fused})")
                       + _bf16_matmuls(bf16_kernel), packed_int4=True, matmul=bf16_kernel)
    if dtype == "auto" and quantization is None and fused_possible and native_gguf:
        bf16_prefill = features.native_bf16 and not batch_invariant
        return CpuPlan("float32", "gguf", False, True, bf16_prefill,
                       "dtype auto: the GGUF file's weights as stored on kvfleet's kernels (Q4_0/Q4_1/Q4_K as int4, "
                       "Q5_0/Q5_1/Q5_K/Q6_K/Q8_0 as grouped int8: not re-quantized, not widened), float32 activations"
                       + (_bf16_matmuls(bf16_kernel) if bf16_kernel != "float32" else
                          _BF16_PREFILL if bf16_prefill else _INVARIANT if features.native_bf16 else ""),
                       gguf_stored=True, matmul=bf16_kernel)

    if dtype in ("auto", "float32") or (dtype == "bfloat16" and quantization is None and bf16_storage
                                         and fused_possible and single):
        lossless = checkpoint_weights == "bf16"
        store_bf16 = (quantization is None and bf16_storage and fused_possible and single
                      and (dtype == "bfloat16" or (dtype == "auto" and (features.native_bf16 or lossless))))
        weights = quantization or ("bf16" if store_bf16 else "fp32")
        if dtype == "float32":
            reason = "--dtype float32"
        elif dtype == "bfloat16":
            reason = "--dtype bfloat16 on the CPU: bf16 weight storage, float32 compute (the fused decoder reads bf16)"
        elif not fused_possible:
            reason = f"dtype auto: float32 (the fused decoder is off: {why_not_fused})"
        else:
            reason = ("dtype auto: float32 activations, the fused C decoder's (kvfleet's fastest decode on "
                      "every CPU measured)") + ("" if single else "; tensor parallelism: each rank's float32 shard")
            if store_bf16:
                reason += ("; bf16 weight storage (the checkpoint's own bf16 weights, lossless)" if lossless
                           else "; bf16 weight storage") + ": half the bytes per decode token"
        quantized_auto = dtype == "auto" and quantization is not None
        native = features.native_bf16 and (weights == "bf16" or quantized_auto) and not batch_invariant
        matmul = bf16_kernel if weights != "fp32" else "float32"
        if matmul != "float32":
            reason += _bf16_matmuls(matmul)
        elif native and quantized_auto:
            reason += _BF16_PREFILL
        elif batch_invariant and features.native_bf16 and (weights == "bf16" or quantized_auto):
            reason += _INVARIANT
        return CpuPlan("float32", weights, store_bf16, fused_possible, native, reason, matmul=matmul)

    # An explicit float16 / bfloat16 run through torch, as asked.
    weights = quantization or {"bfloat16": "bf16", "float16": "fp16"}[dtype]
    native = dtype == "bfloat16" and features.native_bf16
    if dtype == "bfloat16" and not features.native_bf16:
        hint = "bf16 matmuls are emulated on this CPU (no AVX512-BF16 or AMX)"
    else:
        hint = "the fused C decoder runs float32 activations only"
    flag = f"--dtype {dtype}" + (f" --quantization {quantization}" if quantization else "")
    drop = "drop --dtype" if quantization else "use --dtype auto"
    return CpuPlan(dtype, weights, False, False, native,
                   f"{flag}: {dtype} activations through torch; slower than float32 here ({hint}; {drop})")


def _bf16_matmuls(matmul: str) -> str:
    return _BF16_MATMULS.format(MATMUL_NAMES[matmul]) if matmul in BF16_LEVELS else ""


def _why_not_fused(features: CpuFeatures, facts: CpuFacts, kernels: bool, quantization: str | None) -> str:
    if features.isa_level is None:
        return "the CPU lacks AVX2/FMA/F16C or is not x86-64"
    if not kernels:
        return "kvfleet's C kernels are unavailable"
    if not facts.fused_decoder:
        return "$KVFLEET_CPU_DECODER=0"
    if quantization is not None and not facts.woq_kernels:
        return "$KVFLEET_CPU_WOQ=0 (torchao's kernels)"
    return ""


MATRIX_ROLES = ("layer", "head")
MATRIX_FORMATS = ("bf16", "int8", "int8g", "int4", "fp32")


def matrix_matmul(matmul: str, role: str, fmt: str, weights: int, step_weights: int) -> str | None:
    """The fused decoder's kernels for one matrix, fixed for every step (the rule: module
    docstring): None (the decoder's ``matmul``) or ``float32``.

    Args:
        matmul: the decoder's kernels (:attr:`CpuPlan.matmul`, after ``$KVFLEET_CPU_MATMUL``).
        role: ``layer`` (a decoder layer's q|k|v, o, gate|up, down or expert) or ``head`` (the LM head).
        fmt: its weights' format (``kernels.cpu_decoder.Linear.fmt``: ``bf16``, ``int8``, ``int8g``,
            ``int4`` or ``fp32``).
        weights: the matrix's weights (N K).
        step_weights: the weights a one-row step reads (every dense matrix, the head, and
            ``top_k`` experts' worth of each mixture of experts).

    Raises:
        ValueError: an unknown ``matmul``, ``role`` or ``fmt``, or weights outside ``0 < weights <= step_weights``.
    """
    if matmul not in MATMUL_KERNELS:
        raise ValueError(f"matmul must be one of {', '.join(MATMUL_KERNELS)}; got {matmul!r}")
    if role not in MATRIX_ROLES:
        raise ValueError(f"role must be one of {', '.join(MATRIX_ROLES)}; got {role!r}")
    if fmt not in MATRIX_FORMATS:
        raise ValueError(f"fmt must be one of {', '.join(MATRIX_FORMATS)}; got {fmt!r}")
    if not 0 < weights <= step_weights:
        raise ValueError(f"weights {weights} must be positive and at most the step's {step_weights}")
    if matmul != "float32" and role == "head" and fmt != "bf16" and weights > HEAD_FLOAT32_SHARE * step_weights:
        return "float32"
    return None
