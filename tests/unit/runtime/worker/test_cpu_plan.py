"""The CPU execution plan (runtime/worker/cpu_plan.py) on the recorded /proc/cpuinfo flag sets of
an AVX2 Zen 3, an AVX512-BF16 Zen 4 and an AMX Sapphire Rapids (tests/data/cpuinfo/), for every
``--dtype`` x ``--quantization``; and the model loader's use of it (the dtype it loads, the log
line, the one call site of bf16 weight storage)."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
from support import paths

from kvfleet.kernels.cpu_features import CpuFeatures
from kvfleet.runtime.worker import cpu_plan as cp
from kvfleet.runtime.worker import model_loader as ml

DATA = paths.DATA / "cpuinfo"
MACHINES = {
    "zen3": "avx2_epyc_zen3.txt",
    "zen4": "avx512bf16_epyc_zen4.txt",
    "spr": "amx_xeon_sapphire_rapids.txt",
}
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTS = (None, "int8", "int4")
KERNELS = cp.CpuFacts(kernels=True)


def cpu(name: str) -> CpuFeatures:
    return CpuFeatures.from_cpuinfo((DATA / MACHINES[name]).read_text())


def expected(machine: str, dtype: str, quant: str | None, storage: bool) -> tuple[str, str, bool, bool, bool]:
    """(activation dtype, weights, bf16_weights, fused decoder, native bf16 prefill), written out
    from the rules of the plan's docstring with the C kernels available."""
    native = machine in ("zen4", "spr")
    if dtype in ("auto", "float32"):
        bf16 = storage and quant is None and dtype == "auto" and native
        # float32 prefill by default (--batch-invariant); see test_batch_invariant_keeps_prefill_in_float32
        return "float32", quant or ("bf16" if bf16 else "fp32"), bf16, True, False
    if dtype == "bfloat16" and quant is None and storage:
        return "float32", "bf16", True, True, False
    weights = quant or {"bfloat16": "bf16", "float16": "fp16"}[dtype]
    return dtype, weights, False, False, dtype == "bfloat16" and native


@pytest.mark.parametrize("storage", [False, True], ids=["bf16-storage-off", "bf16-storage-on"])
@pytest.mark.parametrize(("machine", "dtype", "quant"), list(itertools.product(MACHINES, DTYPES, QUANTS)))
def test_plan_on_recorded_cpus(machine, dtype, quant, storage):
    p = cp.plan(cpu(machine), dtype, quant, facts=KERNELS, bf16_weight_storage=storage)
    assert (p.dtype, p.weights, p.bf16_weights, p.fused_decoder, p.native_bf16_prefill) == \
        expected(machine, dtype, quant, storage)
    assert p.reason and p.describe().startswith(f"activations {p.dtype}, weights {p.weights}")
    if dtype != "auto":
        assert f"--dtype {dtype}" in p.reason
    # bf16 matmuls: AMX tiles on the AMX machine, AVX512-BF16 dot products on Zen 4, on the fused
    # path, unless float32 was asked or weights are fp32
    bf16 = p.fused_decoder and dtype != "float32" and p.weights != "fp32"
    assert p.matmul == ({"spr": "amx", "zen4": "avx512_bf16"}.get(machine, "float32") if bf16 else "float32")
    assert p.bf16_matmuls == (p.matmul != "float32")
    assert ("AMX tiles" in p.describe()) == (p.matmul == "amx")
    assert ("AVX512-BF16 dot products" in p.describe()) == (p.matmul == "avx512_bf16")


# Measured on an AMD EPYC Zen 4 (AVX-512, AVX512-BF16, VNNI; 2 cores), issue 25: output tok/s of
# one stream (C1) and of 48 requests at once (W48), by (dtype, quantization) -- the paths kvfleet
# had there, bf16 activations (what `auto` picked before) and float32.
ZEN4_MEASURED = {
    ("bfloat16", None): (10.9, 89.8), ("float32", None): (44.7, 89.8),
    ("bfloat16", "int8"): (15.1, 85.9), ("float32", "int8"): (102.0, 93.2),
    ("bfloat16", "int4"): (12.1, 79.1), ("float32", "int4"): (75.7, 91.5),
}


@pytest.mark.parametrize("quant", QUANTS)
def test_auto_is_never_slower_than_another_measured_path(quant):
    p = cp.plan(cpu("zen4"), "auto", quant, facts=KERNELS)
    chosen = ZEN4_MEASURED[(p.dtype, quant)]
    for (dtype, q), figures in ZEN4_MEASURED.items():
        if q == quant:
            assert all(c >= f for c, f in zip(chosen, figures)), (dtype, figures, chosen)
    assert p.fused_decoder and "fused C decoder" in p.reason


def test_the_gguf_default_runs_bf16_matmuls_where_the_cpu_has_them():
    for machine, matmul in (("zen3", "float32"), ("zen4", "avx512_bf16"), ("spr", "amx")):
        p = cp.plan(cpu(machine), "auto", facts=KERNELS, checkpoint_weights="gguf")
        assert p.gguf_stored and p.matmul == matmul, machine
    assert cp.plan(cpu("spr"), "auto", facts=cp.CpuFacts(kernels=True, fused_decoder=False),
                   checkpoint_weights="gguf").matmul == "float32"
    # the ISA level capped ($KVFLEET_CPU_ISA): the capped level's kernels
    assert cp.plan(cpu("spr").capped("avx512_bf16"), "auto", facts=KERNELS,
                   checkpoint_weights="gguf").matmul == "avx512_bf16"
    assert cp.plan(cpu("spr").capped("avx512"), "auto", facts=KERNELS, checkpoint_weights="gguf").matmul == "float32"


def test_a_packed_checkpoint_runs_the_int4_kernels_matmul_kind_and_a_bf16_head_where_the_cpu_has_them():
    """A packed 4-bit checkpoint runs the matmul kind --quantization int4 and a GGUF file's int4
    weights run (the same int4 kernels), and stores its unquantized LM head in bf16 on CPUs with
    native bf16 (docs/performance.md, "Packed 4-bit checkpoints": measured at 1 and 48 rows)."""
    for machine, matmul in (("zen3", "float32"), ("zen4", "avx512_bf16"), ("spr", "amx")):
        p = cp.plan(cpu(machine), "auto", facts=KERNELS, checkpoint_weights="packed")
        assert (p.dtype, p.weights, p.packed_int4, p.fused_decoder, p.matmul) == ("float32", "packed", True, True,
                                                                                   matmul), machine
        assert p.matmul == cp.plan(cpu(machine), "auto", "int4", facts=KERNELS).matmul
        assert p.matmul == cp.plan(cpu(machine), "auto", facts=KERNELS, checkpoint_weights="gguf").matmul
        assert p.bf16_weights == (machine != "zen3") == ("LM head stored in bf16" in p.reason), machine
        assert ("prefill fused in them" in p.reason) == p.bf16_matmuls and not p.native_bf16_prefill
        # --dtype float32: float32 everything (the int4 layers on the float32 kernels, a float32 head)
        f32 = cp.plan(cpu(machine), "float32", facts=KERNELS, checkpoint_weights="packed")
        assert (f32.packed_int4, f32.matmul, f32.bf16_weights) == (True, "float32", False)
        # bf16 weight storage switched off: the head stays float32
        assert not cp.plan(cpu(machine), "auto", facts=KERNELS, checkpoint_weights="packed",
                           bf16_weight_storage=False).bf16_weights
        # without the fused decoder: float32, no bf16 head (the torch path), the reason says why
        off = cp.plan(cpu(machine), "auto", facts=cp.CpuFacts(kernels=True, fused_decoder=False),
                      checkpoint_weights="packed")
        assert (off.fused_decoder, off.matmul, off.bf16_weights) == (False, "float32", False)
        assert "KVFLEET_CPU_DECODER=0" in off.reason
    # the ISA level capped ($KVFLEET_CPU_ISA): the capped level's kernels
    assert cp.plan(cpu("spr").capped("avx512_bf16"), "auto", facts=KERNELS,
                   checkpoint_weights="packed").matmul == "avx512_bf16"
    capped = cp.plan(cpu("spr").capped("avx512"), "auto", facts=KERNELS, checkpoint_weights="packed")
    assert capped.matmul == "float32"


# One-row step weights (N K of every matrix) of two real models: Gemma 3 270M (18 layers, hidden
# 640, q|k|v 1536, o from 1024, MLP 2048; head 262,144 x 640) and SmolLM2-135M (30 layers, hidden
# 576, q|k|v 960, o 576, MLP 1536; head 49,152 x 576).
GEMMA3_270M = (262144 * 640, 18 * (1536 * 640 + 640 * 1024 + 2 * 2048 * 640 + 640 * 2048))
SMOLLM2_135M = (49152 * 576, 30 * (960 * 576 + 576 * 576 + 2 * 1536 * 576 + 576 * 1536))


@pytest.mark.parametrize("checkpoint", ["gguf", "bf16"])
@pytest.mark.parametrize("machine", list(MACHINES))
def test_each_matrix_runs_the_plans_kernels_but_a_head_holding_most_weights(machine, checkpoint):
    """The per-matrix rule on each recorded CPU's plan: Gemma 3 270M's quantized head (62 % of a
    one-row step's weights) runs the float32 kernels wherever the plan chose bf16 ones; a bf16 head,
    its layers, and every matrix of SmolLM2 (head 21 %) keep the plan's kernels (None)."""
    p = cp.plan(cpu(machine), "auto", facts=KERNELS, checkpoint_weights=checkpoint)
    assert p.matmul == {"zen3": "float32", "zen4": "avx512_bf16", "spr": "amx"}[machine]
    for (head, layers), big in ((GEMMA3_270M, True), (SMOLLM2_135M, False)):
        step = head + layers
        for fmt in ("int8g", "int4", "int8", "fp32"):
            want = "float32" if big and p.bf16_matmuls else None
            assert cp.matrix_matmul(p.matmul, "head", fmt, head, step) == want, fmt
        # bf16 weights are tile-loaded as stored: a bf16 head keeps the plan's kernels however large
        assert cp.matrix_matmul(p.matmul, "head", "bf16", head, step) is None
        assert cp.matrix_matmul(p.matmul, "layer", "int8g", 2048 * 640, step) is None
    # the threshold: more than half, not half
    assert cp.matrix_matmul("amx", "head", "int8g", 50, 100) is None
    assert cp.matrix_matmul("amx", "head", "int8g", 51, 100) == "float32"


def test_matrix_matmul_refuses_bad_input():
    with pytest.raises(ValueError, match="matmul must be one of"):
        cp.matrix_matmul("bf16", "head", "int8g", 1, 2)
    with pytest.raises(ValueError, match="role must be one of"):
        cp.matrix_matmul("amx", "embedding", "int8g", 1, 2)
    with pytest.raises(ValueError, match="fmt must be one of"):
        cp.matrix_matmul("amx", "head", "q8_0", 1, 2)
    for weights, step in ((0, 2), (3, 2), (-1, 2)):
        with pytest.raises(ValueError, match="must be positive and at most"):
            cp.matrix_matmul("amx", "head", "int8g", weights, step)


@pytest.mark.parametrize("machine", list(MACHINES))
def test_without_the_fused_decoder_auto_stays_float32_and_says_why(machine):
    cases = {
        cp.CpuFacts(kernels=False): "C kernels are unavailable",
        cp.CpuFacts(kernels=True, fused_decoder=False): "$KVFLEET_CPU_DECODER=0",
    }
    for facts, why in cases.items():
        for storage in (False, True):
            p = cp.plan(cpu(machine), "auto", None, facts=facts, bf16_weight_storage=storage)
            assert (p.dtype, p.weights, p.bf16_weights, p.fused_decoder) == ("float32", "fp32", False, False)
            assert why in p.reason
            # bf16 storage needs the kernels: an explicit bfloat16 then runs through torch.
            b = cp.plan(cpu(machine), "bfloat16", None, facts=facts, bf16_weight_storage=storage)
            assert (b.dtype, b.bf16_weights, b.fused_decoder) == ("bfloat16", False, False)
    woq_off = cp.plan(cpu(machine), "auto", "int8", facts=cp.CpuFacts(kernels=True, woq_kernels=False))
    assert (woq_off.dtype, woq_off.fused_decoder) == ("float32", False) and "KVFLEET_CPU_WOQ" in woq_off.reason
    assert cp.plan(cpu(machine), "auto", None, facts=cp.CpuFacts(kernels=True, woq_kernels=False)).fused_decoder


@pytest.mark.parametrize("machine", list(MACHINES))
def test_tensor_parallelism_keeps_the_fused_decoder_on_float32_shards(machine):
    """Each rank runs the fused step on its shard (runtime/worker/cpu_decode_tp.py) as transformers'
    plan loads it: float32 weights and matmuls, no bf16 storage; an explicit bfloat16 runs torch."""
    facts = cp.CpuFacts(kernels=True, tensor_parallel_size=2)
    for storage in (False, True):
        p = cp.plan(cpu(machine), "auto", None, facts=facts, bf16_weight_storage=storage)
        assert (p.dtype, p.weights, p.bf16_weights, p.matmul) == ("float32", "fp32", False, "float32")
        assert p.fused_decoder == (cpu(machine).isa_level is not None)
        assert not p.fused_decoder or "tensor parallelism: each rank's float32 shard" in p.reason
        b = cp.plan(cpu(machine), "bfloat16", None, facts=facts, bf16_weight_storage=storage)
        assert (b.dtype, b.bf16_weights, b.fused_decoder) == ("bfloat16", False, False)


def test_below_avx2_or_off_x86_the_kernels_do_not_count():
    old = CpuFeatures.from_cpuinfo("flags\t: fpu sse2 avx\n")
    arm = CpuFeatures.from_cpuinfo((DATA / MACHINES["zen4"]).read_text(), x86_64=False)
    for features in (old, arm):
        p = cp.plan(features, "auto", None, facts=KERNELS, bf16_weight_storage=True)
        assert (p.dtype, p.fused_decoder, p.bf16_weights) == ("float32", False, False)
        assert "AVX2" in p.reason


def test_explicit_bf16_says_why_it_is_slower():
    stored = cp.plan(cpu("zen3"), "bfloat16", None, facts=KERNELS)  # the default: bf16 storage, fp32 compute
    assert (stored.dtype, stored.weights, stored.fused_decoder) == ("float32", "bf16", True)
    emulated = cp.plan(cpu("zen3"), "bfloat16", None, facts=KERNELS, bf16_weight_storage=False)
    assert "emulated" in emulated.reason and "use --dtype auto" in emulated.reason
    assert emulated.describe().endswith(emulated.reason) and "bf16 (emulated)" in emulated.describe()
    native = cp.plan(cpu("spr"), "bfloat16", "int8", facts=KERNELS)
    assert "float32 activations only" in native.reason and "drop --dtype" in native.reason
    assert "bf16 (native)" in native.describe()


@pytest.mark.parametrize("machine", list(MACHINES))
def test_batch_invariant_keeps_prefill_in_float32(machine):
    # --batch-invariant (the default): no native bf16 prefill on the float32-activation paths (the
    # default's Q4_1, --quantization alone, bf16 weight storage); --no-batch-invariant turns it on where
    # the CPU has native bf16. The weights and the fused decoder are the same either way.
    for dtype, quant, checkpoint in (("auto", None, "gguf"), ("auto", "int8", "fp32"), ("auto", "int4", "fp32"),
                                     ("auto", None, "fp32"), ("bfloat16", None, "fp32")):
        inv = cp.plan(cpu(machine), dtype, quant, facts=KERNELS, checkpoint_weights=checkpoint)
        fast = cp.plan(cpu(machine), dtype, quant, facts=KERNELS, checkpoint_weights=checkpoint, batch_invariant=False)
        assert (inv.dtype, inv.weights, inv.fused_decoder) == (fast.dtype, fast.weights, fast.fused_decoder)
        assert not inv.native_bf16_prefill
        # the reason names the flag where prefill would otherwise run oneDNN's bf16; where the fused
        # decoder's matmuls run in bf16 (Zen 4, AMX) prefill is fused in them either way
        assert ("--no-batch-invariant" in inv.reason) == (machine != "zen3" and not inv.bf16_matmuls)
        assert ("prefill fused in them" in inv.reason) == inv.bf16_matmuls
        assert fast.native_bf16_prefill == (machine != "zen3")


@pytest.mark.parametrize("machine", list(MACHINES))
def test_auto_keeps_a_checkpoints_own_smaller_weights(machine):
    # A GGUF file's tensors run as stored on the kernels; a bf16 checkpoint keeps bf16 weights
    # (lossless) on every CPU, AVX2 included; asked-for dtypes and quantizations are not overridden.
    q4 = cp.plan(cpu(machine), "auto", None, facts=KERNELS, checkpoint_weights="gguf")
    assert (q4.dtype, q4.weights, q4.gguf_stored, q4.bf16_weights, q4.fused_decoder) == ("float32", "gguf", True, False,
                                                                                      True)
    assert "as stored" in q4.reason and "Q4_K" in q4.reason
    # --no-batch-invariant: prefill in native bf16 where the CPU has it (below the quantization's error); decode float32
    fast = cp.plan(cpu(machine), "auto", None, facts=KERNELS, checkpoint_weights="gguf", batch_invariant=False)
    assert fast.native_bf16_prefill == (machine != "zen3")
    # where the fused decoder's matmuls run in bf16 (Zen 4, AMX) prefill is fused in them, else oneDNN's bf16
    assert ("prefill matmuls in bf16" in fast.reason) == (machine != "zen3" and not fast.bf16_matmuls)
    assert ("prefill fused in them" in fast.reason) == fast.bf16_matmuls == (machine != "zen3")
    for dtype, quant in (("float32", None), ("auto", "int8"), ("bfloat16", None)):
        assert not cp.plan(cpu(machine), dtype, quant, facts=KERNELS, checkpoint_weights="gguf").gguf_stored
    no_woq = cp.plan(cpu(machine), "auto", None, facts=cp.CpuFacts(kernels=True, woq_kernels=False),
                     checkpoint_weights="gguf")
    assert not no_woq.gguf_stored and no_woq.weights != "gguf"
    bf16 = cp.plan(cpu(machine), "auto", None, facts=KERNELS, checkpoint_weights="bf16")
    assert (bf16.dtype, bf16.weights, bf16.bf16_weights) == ("float32", "bf16", True) and "lossless" in bf16.reason
    assert cp.plan(cpu(machine), "float32", None, facts=KERNELS, checkpoint_weights="bf16").weights == "fp32"


def test_bad_names_are_refused():
    with pytest.raises(ValueError, match="checkpoint_weights must be one of"):
        cp.plan(cpu("zen3"), "auto", None, facts=KERNELS, checkpoint_weights="q8_0")
    with pytest.raises(ValueError, match="dtype must be one of"):
        cp.plan(cpu("zen3"), "float8", None, facts=KERNELS)
    with pytest.raises(ValueError, match=r"^--quantization must be one of"):
        cp.plan(cpu("zen3"), "auto", "int3", facts=KERNELS)


def test_resolve_dtype_on_this_machine():
    dev = torch.device("cpu")
    for quant in QUANTS:
        assert ml.resolve_dtype("auto", dev, quant) == torch.float32
    assert ml.resolve_dtype("float16", dev) == torch.float16
    assert ml.resolve_dtype(torch.bfloat16, dev) == torch.bfloat16


def test_the_loader_loads_by_the_plan_and_logs_it(smollm2_two_layers, caplog):
    with caplog.at_level(logging.INFO, logger="kvfleet.runtime.worker.model_loader"):
        loaded = ml.load_model(smollm2_two_layers.source, device="cpu")
    assert loaded.dtype == torch.float32 and next(loaded.model.parameters()).dtype == torch.float32
    assert loaded.cpu_plan == ml.resolve_cpu_plan("auto")
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU plan: "))
    assert loaded.cpu_plan.describe() in line and "CPU: " in line and "[level " in line


def test_bf16_weight_storage_has_one_call_site(smollm2_two_layers, monkeypatch):
    """With the switch on and the kernels here, ``--dtype bfloat16`` loads float32 and hands the
    model to ``woq_linear.to_bf16_weights`` once (cpu-kernels' function; a recorder here)."""
    from kvfleet.runtime.worker import woq_linear

    if not ml.cpu_facts().kernels or ml.cpu_features.detect().isa_level is None:
        pytest.skip("kvfleet's C kernels do not run on this machine")
    calls = []
    monkeypatch.setattr(cp, "BF16_WEIGHT_STORAGE", True)
    monkeypatch.setattr(woq_linear, "to_bf16_weights", lambda model: calls.append(model) or 0, raising=False)
    loaded = ml.load_model(smollm2_two_layers.source, dtype="bfloat16", device="cpu")
    assert calls == [loaded.model] and loaded.dtype == torch.float32
    assert loaded.cpu_plan.bf16_weights and loaded.cpu_plan.weights == "bf16"
    monkeypatch.setattr(cp, "BF16_WEIGHT_STORAGE", False)
    off = ml.load_model(smollm2_two_layers.source, dtype="bfloat16", device="cpu")
    assert len(calls) == 1 and off.dtype == torch.bfloat16 and not off.cpu_plan.bf16_weights


def test_the_onednn_primitive_cache_is_bounded_unless_set():
    """Importing the loader caps oneDNN's per-shape primitive cache (read lazily by oneDNN, at its
    first primitive); a value set by the operator wins."""
    import os
    import subprocess
    import sys

    code = "import os, kvfleet.runtime.worker.model_loader; print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'])"
    env = {k: v for k, v in os.environ.items() if k != ml.ONEDNN_CACHE_ENV}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == str(ml.ONEDNN_CACHE_CAPACITY) == "128"
    env[ml.ONEDNN_CACHE_ENV] = "512"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == "512"
