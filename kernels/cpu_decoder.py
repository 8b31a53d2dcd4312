"""The fused CPU decoder: one engine step of a dense decoder in one C call
(``kernels/cpu_decoder.c``, built into the same library as :mod:`kvfleet.kernels.cpu_woq` by
:mod:`kvfleet.kernels.cpu_lib`, which also holds the ctypes mirrors of its structs).

A step is up to :data:`MAX_ROWS` rows, each one token run as a one-token decode at its position:
a decode step's sequences, a speculative step's last token and drafts, a prefill chunk's prompt
tokens (row ``j`` of a sequence attends up to its own position; every row's key and value is
written before any row's attention). Every row is summed in the one-row order whatever the other
rows (``cpu_gemv.h``; ``matmul="amx"``: bf16 on AMX tiles, ``cpu_amx.h``; ``"avx512_bf16"``: AVX512-BF16
dot products, ``cpu_dpbf16.h``; each row again independent of the others), so a row's result is
bitwise the same in any step (batch-invariant); the LM head runs on the rows asked for (``logits_indices``).

Why: at one stream, transformers' modules spent ~20 ms a step in per-op Python and ~10 ms waking
OpenMP threads for ~210 small matmuls, against a few ms of weight reading (docs/performance.md,
"Fused CPU decoder"). The C step runs every layer, the final norm and the LM head with its own
thread pool (helpers spin briefly between phases, sleep between steps); the layer variants
(:class:`Layer`, :class:`DecoderWeights`) are what the families of
:mod:`kvfleet.runtime.worker.recipes` need. Under tensor parallelism each rank runs its shard and
the step sums o's and down's partial outputs over the ranks (:mod:`kvfleet.kernels.cpu_tp`).

:class:`DecoderWeights` describes the model (built once; it keeps every tensor it points to
alive, and the tensors must not move or be resized while it is used); :meth:`FusedDecoder.step`
runs one step. Layouts (``H`` hidden size, ``QH`` / ``KVH`` query / KV heads, ``D`` head size,
``I`` MLP width, ``V`` vocabulary):

- :class:`Linear`: ``fmt`` ``fp32`` (``w [N, K]`` float32), ``bf16`` (``w [N, K]`` bfloat16, widened to
  float32 in registers), ``int8`` (``w [N, K]`` int8, ``scale [N]``), ``int4`` (``w [N, K/2]``
  uint8 packed as :func:`kvfleet.kernels.cpu_woq.pack_int4`, ``scale``/``shift [N, K/G]``) or
  ``int8g`` (``w [N, K]`` int8, ``scale [N, K/G]``, ``shift [N, K/G]`` or None, G a multiple of 16:
  grouped int8, ``q * scale (+ shift)``; GGUF Q8_0, Q6_K and Q5_K; ``high``: the 5-bit form, Q5_0's);
  int4's and int8g's ``scale`` and ``shift`` float32 or both float16 (cpu_gemv_m1.h's forms);
  ``bias [N]`` float32 or None; ``perm [K]`` int32 or None: an input permutation (act-order GPTQ,
  its int4 weights over the input features sorted by group): the step runs the layer on
  ``x[:, perm]`` (``kernels/cpu_perm.h``), a gather of each row before its matmul with every matmul
  kind; a permutation of ``0 .. K-1``, at most :data:`MAX_PERM` long, not on the LM head nor the
  experts, and q/k/v (gate/up) stacked into one matrix share one.
- per layer: ``qkv [(QH + 2 KVH) D, H]`` (q rows, then k, then v), ``o [H, QH D]``,
  ``gate_up [2 I, H]`` (gate rows, then up rows), ``down [H, I]``; norms ``[H]`` float32;
  caches ``[num_blocks, block_size, KVH, D]`` float32 or bfloat16 (every layer's alike: the
  decoder's :attr:`FusedDecoder.cache_dtype`). A bf16 cache holds each new key and value rounded to
  nearest even (bitwise what ``.to(torch.bfloat16)`` gives, so the torch attention path can share the
  cache), and attention widens them to float32 in registers; activations and sums stay float32.
- LoRA (:mod:`kvfleet.kernels.cpu_lora`, ``Layer.lora``): per adapted projection the adapters' slots ``a [S, R, K]``
  and ``b [S, R, n]`` float32 (``lora_layers.LoRALinear``'s ``lora_a`` / ``lora_b``: B transposed,
  scaling folded in); a step's ``lora_slots [M]`` picks each row's slot (-1: none), and the C step
  adds ``(x a[s]^T) b[s]`` to that projection's output columns (``kernels/cpu_lora.h``), float32
  whatever the matmul kind, each row's delta its own (batch-invariant).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

import kvfleet.runtime.env as env  # the settings registry: stdlib only, below every layer
from kvfleet.kernels import cpu_lib
from kvfleet.kernels.cpu_features import MATMUL_KERNELS
from kvfleet.kernels.cpu_lora import LoRATable, check_lora, lora_struct
from kvfleet.kernels.cpu_tp import AllReduce, TensorParallelStepError
from kvfleet.kernels.cpu_woq import matrix_fields

MAX_ROWS = 8192
"""Most rows (tokens) one step takes (``KV_MAX_ROWS``; the engine's default ``max_num_batched_tokens`` is 2048)."""
SPIN_ENV = env.CPU_SPIN_US.name
SPIN_US = env.CPU_SPIN_US.default
"""Microseconds a helper thread spins after its last task before it sleeps (``$KVFLEET_CPU_SPIN_US``
overrides). A step's phases come microseconds apart; between steps (scheduler, sampler: milliseconds)
the helpers sleep, so a CPU shared with other processes loses at most this much per step."""

PROFILE_PHASES = ("norm", "qkv", "attention", "o", "mlp", "down", "head", "tp", "steps")
"""The phases :meth:`FusedDecoder.profile` reports (``kv_decode_profile``; ``tp``: the all-reduces)."""
MAX_PERM = 1 << 18
"""Longest input permutation (the C gather copies a row of that many floats on its thread's stack)."""
_FORMATS = {"fp32": 0, "int8": 1, "int4": 2, "bf16": 3, "int8g": 4}
CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
"""KV cache dtypes the C step reads (``KV_CACHE_F32`` / ``KV_CACHE_BF16`` in cpu_decoder.h)."""


_Matrix, _Layer, _Decoder, _Moe = cpu_lib.Matrix, cpu_lib.Layer, cpu_lib.Decoder, cpu_lib.Moe


@dataclass
class Linear:
    """One linear layer's weights (see the module docstring for the layouts)."""

    fmt: str
    w: torch.Tensor
    scale: torch.Tensor | None = None
    shift: torch.Tensor | None = None
    group: int = 0
    bias: torch.Tensor | None = None
    perm: torch.Tensor | None = None
    matmul: str | None = None   # its kernels in every step (cpu_plan.matrix_matmul): None (the decoder's), float32
    high: torch.Tensor | None = None   # int8g's 5-bit form: the fifth bits [N, K/8] uint8 (w the nibbles)

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)``: output and input features."""
        n, k = self.w.shape
        return n, 2 * k if self.fmt == "int4" or self.high is not None else k

    @property
    def form(self) -> tuple:
        """What matrices stacked into one must share: format, group, scale dtype, the 5-bit form."""
        return self.fmt, self.group, None if self.scale is None else self.scale.dtype, self.high is not None

    def check(self, name: str, n: int, k: int) -> None:
        """ValueError unless this is a valid ``[n, k]`` layer in its format."""
        if self.fmt not in _FORMATS:
            raise ValueError(f"{name}: unknown format {self.fmt!r}")
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8, "int4": torch.uint8,
                 "int8g": torch.int8 if self.high is None else torch.uint8}[self.fmt]
        if self.w.dtype != dtype or not self.w.is_contiguous() or self.w.device.type != "cpu":
            raise ValueError(f"{name}: weight must be a contiguous CPU {dtype} tensor, got {self.w.dtype}")
        if self.shape != (n, k):
            raise ValueError(f"{name}: weight is {self.shape}, expected {(n, k)}")
        if k % (32 if self.fmt == "int4" else 8):
            raise ValueError(f"{name}: {k} input features is not a multiple of {32 if self.fmt == 'int4' else 8}")
        wanted, half = matrix_fields(name, self.fmt, self.group, self.scale, self.shift, self.high, n, k)
        for field, shape in {**wanted, **({"bias": (n,)} if self.bias is not None else {})}.items():
            t = getattr(self, field)
            dtype = torch.float16 if half and field in ("scale", "shift") else torch.float32
            if t is None or t.shape != shape or t.dtype != dtype or not t.is_contiguous():
                raise ValueError(f"{name}: {field} must be a contiguous {str(dtype)[6:]} {shape} tensor")
        if (p := self.perm) is not None:
            if p.shape != (k,) or p.dtype != torch.int32 or not p.is_contiguous() or k > MAX_PERM:
                raise ValueError(f"{name}: perm must be a contiguous int32 ({k},) tensor (at most {MAX_PERM})")
            if not torch.equal(torch.sort(p).values, torch.arange(k, dtype=torch.int32)):
                raise ValueError(f"{name}: perm is not a permutation of 0..{k - 1}")

    def struct(self) -> _Matrix:   # (the appended fields by name; kind 0: the decoder's kernels)
        n, k = self.shape
        return _Matrix(_FORMATS[self.fmt], n, k, self.w.data_ptr(), _data(self.scale), _data(self.shift),
                       self.group, _data(self.bias), perm=_data(self.perm), kind=1 + _MATMUL_CODES.get(self.matmul, -1),
                       scale_f16=int(self.scale is not None and self.scale.dtype == torch.float16),
                       hbits=_data(self.high))


def _data(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _mlp(m: Linear | None) -> _Matrix:
    """A dense MLP matrix, or an empty one where the layer has experts instead (unused by C)."""
    return m.struct() if m is not None else _Matrix()


MOE_SCORINGS = {"softmax": 0, "topk_softmax": 1}
"""How a router's logits become the weights of a token's ``top_k`` experts (``KV_MOE_*`` in
cpu_decoder.h; ``moe_route`` in cpu_moe.h, the one definition):

- ``softmax``: the softmax over all ``E`` logits, its ``top_k`` largest (ties: the lower expert id),
  divided by their sum if ``norm_topk_prob``. Qwen3-MoE (``norm_topk_prob`` as its config says) and
  Mixtral (always renormalised: the same numbers as the softmax over the top-k logits, and the order
  transformers computes them in).
- ``topk_softmax``: the ``top_k`` largest logits, then the softmax over those (GPT-OSS's order; its
  router bias is the router :class:`Linear`'s ``bias``).

A token's output is its experts' outputs times their weights, summed in ascending expert id."""
MAX_TOP_K = 16
"""Most experts per token (``KV_MOE_MAX_K``)."""


@dataclass
class MoeLayer:
    """A layer's mixture of experts, in place of its dense MLP (:class:`Layer` ``moe``).

    ``router``: ``[E, H]`` float32 :class:`Linear` (``fp32``, bias allowed; run on the float32
    kernels whatever the decoder's matmuls, so routing decisions never see bf16 rounding);
    ``gate_up``: ``E`` layers ``[2 I, H]`` (gate rows, then up rows), ``down``: ``E`` layers
    ``[H, I]``, in any :class:`Linear` format (all experts of a layer in one format; the C step
    groups a step's tokens by expert so each expert's weights are read once per step);
    ``top_k``, ``norm_topk_prob``, ``scoring``: see :data:`MOE_SCORINGS`."""

    router: Linear
    gate_up: list[Linear]
    down: list[Linear]
    top_k: int
    norm_topk_prob: bool = True
    scoring: str = "softmax"

    @property
    def intermediate(self) -> int:
        """``I``: each expert's MLP width."""
        return self.gate_up[0].shape[0] // 2 if self.gate_up else 0

    def check(self, name: str, hidden: int) -> None:
        """ValueError unless the experts fit a decoder of ``hidden`` features (see the class docstring)."""
        E, inter = len(self.gate_up), self.intermediate
        if E < 1 or len(self.down) != E:
            raise ValueError(f"{name}: {E} gate_up and {len(self.down)} down experts; need as many, at least one")
        if not 1 <= self.top_k <= min(E, MAX_TOP_K):
            raise ValueError(f"{name}: top_k {self.top_k} must be 1..{min(E, MAX_TOP_K)} ({E} experts)")
        if self.scoring not in MOE_SCORINGS:
            raise ValueError(f"{name}: scoring {self.scoring!r} is not one of {', '.join(MOE_SCORINGS)}")
        if self.router.fmt != "fp32":
            raise ValueError(f"{name}: the router must be fp32, got {self.router.fmt}")
        self.router.check(f"{name} router", E, hidden)
        if any(m.perm is not None for m in (self.router, *self.gate_up, *self.down)):
            raise ValueError(f"{name}: the experts' step takes no input permutation")
        if inter < 1 or len({(m.fmt, m.group) for m in (*self.gate_up, *self.down)}) != 1:
            raise ValueError(f"{name}: experts of width {inter} in formats "
                             f"{sorted({m.fmt for m in (*self.gate_up, *self.down)})}; need one format")
        for e, (gu, down) in enumerate(zip(self.gate_up, self.down)):
            gu.check(f"{name} expert {e} gate_up", 2 * inter, hidden)
            down.check(f"{name} expert {e} down", hidden, inter)

    def struct(self) -> tuple[_Moe, tuple]:
        """The ``kv_moe`` and the ctypes arrays it points to (keep both alive)."""
        E = len(self.gate_up)
        gate_up = (_Matrix * E)(*[m.struct() for m in self.gate_up])
        down = (_Matrix * E)(*[m.struct() for m in self.down])
        moe = _Moe(E, self.top_k, self.intermediate, int(self.norm_topk_prob), MOE_SCORINGS[self.scoring],
                   self.router.struct(), gate_up, down)
        return moe, (gate_up, down)


@dataclass
class Layer:
    """One decoder layer: its RMSNorms (``[H]`` float32 or None: no norm there), the four linear
    layers, its KV caches. ``attn_in_norm`` / ``mlp_in_norm`` normalize a sublayer's input (None:
    the residual itself), ``attn_out_norm`` / ``mlp_out_norm`` its output before the residual add
    (Gemma 3, GLM-4, OLMo 2). ``q_norm`` / ``k_norm``: with :attr:`DecoderWeights.qk_norm` ``head``
    ``[D]``, with ``proj`` ``[QH D]`` / ``[KVH D]``, else None. ``window``: the sliding window (a
    row attends to its last ``window`` positions; 0: all). ``rope``: which of the step's cos/sin
    tables rotates this layer (Gemma 3's local and global layers differ). ``moe``: a mixture of
    experts in place of the dense MLP (then ``gate_up`` and ``down`` are None; the norms around
    the MLP apply to it alike). ``lora``: the adapted projections' tables, or None (keys
    :data:`~kvfleet.kernels.cpu_lora.LORA_PARTS`; not ``gate`` / ``up`` / ``down`` with experts)."""

    attn_in_norm: torch.Tensor | None
    mlp_in_norm: torch.Tensor | None
    qkv: Linear
    o: Linear
    gate_up: Linear | None
    down: Linear | None
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    window: int = 0
    rope: int = 0
    moe: MoeLayer | None = None
    lora: dict[str, LoRATable] | None = None


@dataclass
class DecoderWeights:
    """The whole decoder. ``eps``: RMSNorm epsilon; ``scale``: the softmax scale (usually
    ``D ** -0.5``); ``head``: the LM head ``[V, H]`` or None (then :meth:`FusedDecoder.step`
    returns no logits). ``qk_norm`` (:data:`QK_NORMS`): RMSNorm of the new queries and keys
    before rotary, per head or over the projection; ``act`` (:data:`ACTS`): the gated MLP's
    activation; rotary over the first ``rotary_dim`` elements of each head (0: all ``D``), halves
    (``rotary_interleaved`` False) or pairs of neighbours (GLM-4); ``residual_scale``: each
    sublayer's output times this before it is added (Granite's ``residual_multiplier``)."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    eps: float
    scale: float
    layers: list[Layer]
    final_norm: torch.Tensor
    head: Linear | None
    qk_norm: str = "none"
    act: str = "silu"
    rotary_dim: int = 0
    rotary_interleaved: bool = False
    residual_scale: float = 1.0


QK_NORMS = {"none": 0, "head": 1, "proj": 2}
"""``DecoderWeights.qk_norm`` values (``KV_QK_*`` in cpu_decoder.h)."""
ACTS = {"silu": 0, "gelu_tanh": 1}
"""``DecoderWeights.act`` values (``KV_ACT_*`` in cpu_decoder.h)."""


MATMULS = tuple(MATMUL_KERNELS)
"""The fused decoder's matmul kernels (:data:`kvfleet.kernels.cpu_features.MATMUL_KERNELS`):
float32 (``cpu_gemv.h``), bf16 dot products (AVX512-BF16's ``vdpbf16ps``, ``cpu_dpbf16.h``), bf16
on AMX tiles (``cpu_amx.h``)."""
_MATMUL_CODES = {"float32": 0, "amx": 1, "avx512_bf16": 2}   # cpu_decoder.h's KV_MATMUL_*


def matmul_available(kind: str) -> bool:
    """Whether the loaded library has the ``kind`` kernels (:data:`MATMULS`; ``amx``: and this
    process may use the tiles)."""
    lib = cpu_lib.load()
    if lib is None or kind not in MATMULS:
        return False
    return kind == "float32" or bool(lib.kv_amx_available() if kind == "amx" else lib.kv_dpbf16_available())


def resolve_matmul(kind: str, matrices: list[Linear] | tuple = ()) -> str:
    """The kernels that run where ``kind`` (:data:`MATMULS`) is asked: ``kind`` where
    :func:`matmul_available` and every one of ``matrices`` suits it (a multiple of 32 columns, and
    for ``amx`` of 16 rows), else ``float32``. The one capability check (the C step only re-checks
    that its thread may use the AMX tiles)."""
    if kind == "float32" or not matmul_available(kind):
        return "float32"
    fits = all(m.shape[1] % 32 == 0 and (kind != "amx" or m.shape[0] % 16 == 0) for m in matrices)
    return kind if fits else "float32"


class FusedDecoder:
    """A checked :class:`DecoderWeights` bound to the C library.

    Raises:
        ValueError: a tensor of the wrong shape, dtype or layout, or a model the C step does not
            cover (head size not a multiple of 8, query heads not a multiple of the
            KV heads, KV caches not float32 or bfloat16 ``[blocks, block_size, KVH, D]``, all of
            one dtype).
        RuntimeError: the kernels are unavailable (:func:`kvfleet.kernels.cpu_lib.available`).

    ``matmul`` (:data:`MATMULS`): ``amx`` runs the matmuls on AMX tiles (``kernels/cpu_amx.h``),
    ``avx512_bf16`` as bf16 dot products (``kernels/cpu_dpbf16.h``): activations and dequantized
    weights rounded to bf16, float32 sums; every row's bits independent of the step's other rows as
    on the float32 kernels. It takes effect only where :func:`matmul_available` and every matrix has
    a multiple of 32 columns (and for ``amx`` of 16 rows); :attr:`matmul` says what runs.
    ``all_reduce``: tensor parallelism, ``weights`` being this rank's shard (:mod:`~kvfleet.kernels.cpu_tp`).
    """

    def __init__(self, weights: DecoderWeights, threads: int | None = None, matmul: str = "float32",
                 all_reduce: AllReduce | None = None) -> None:
        if matmul not in MATMULS:
            raise ValueError(f"matmul must be one of {', '.join(MATMULS)}; got {matmul!r}")
        lib = cpu_lib.load()
        if lib is None:
            raise RuntimeError(f"kvfleet CPU kernels unavailable: {cpu_lib.unavailable_reason()}")
        w = weights
        QH, KVH, D = w.num_heads, w.num_kv_heads, w.head_size
        if D % 8 or QH % KVH or not w.layers:
            raise ValueError(f"unsupported attention geometry: {QH} query heads, {KVH} KV heads, head size {D}")
        R = w.rotary_dim or D
        if R % 2 or not 0 < R <= D:
            raise ValueError(f"rotary_dim {R} must be even and within the head size {D}")
        if w.qk_norm not in QK_NORMS or w.act not in ACTS:
            raise ValueError(f"qk_norm must be one of {', '.join(QK_NORMS)} and act one of {', '.join(ACTS)}; "
                             f"got {w.qk_norm!r}, {w.act!r}")
        H = w.final_norm.shape[0]
        dense = [layer for layer in w.layers if layer.moe is None and layer.gate_up is not None]
        inter = dense[0].gate_up.shape[0] // 2 if dense else 0
        block_size = w.layers[0].k_cache.shape[1]
        cache_dtype = w.layers[0].k_cache.dtype
        if cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"KV caches must be float32 or bfloat16, got {cache_dtype}")
        for i, layer in enumerate(w.layers):
            layer.qkv.check(f"layer {i} qkv", (QH + 2 * KVH) * D, H)
            layer.o.check(f"layer {i} o", H, QH * D)
            if layer.moe is not None:
                layer.moe.check(f"layer {i} moe", H)
                if w.act != "silu":
                    raise ValueError(f"layer {i}: experts run SiLU, the decoder's activation is {w.act!r}")
            elif layer.gate_up is None or layer.down is None:
                raise ValueError(f"layer {i} has neither a dense MLP (gate_up, down) nor experts (moe)")
            else:
                layer.gate_up.check(f"layer {i} gate_up", 2 * inter, H)
                layer.down.check(f"layer {i} down", H, inter)
            qk = {"none": (None, None), "head": (D, D), "proj": (QH * D, KVH * D)}[w.qk_norm]
            for name, size in (("attn_in_norm", H), ("attn_out_norm", H), ("mlp_in_norm", H), ("mlp_out_norm", H),
                               ("q_norm", qk[0]), ("k_norm", qk[1])):
                t = getattr(layer, name)
                if t is None and name in ("q_norm", "k_norm") and size is not None:
                    raise ValueError(f"layer {i} {name} is missing (qk_norm {w.qk_norm!r})")
                if t is not None and (size is None or t.shape != (size,) or t.dtype != torch.float32
                                      or not t.is_contiguous()):
                    raise ValueError(f"layer {i} {name} must be None or a contiguous float32 [{size}] tensor"
                                     + (" (qk_norm 'none')" if size is None else ""))
            if layer.window < 0 or layer.rope < 0:
                raise ValueError(f"layer {i}: window {layer.window} and rope {layer.rope} must be >= 0")
            for name, t in (("k_cache", layer.k_cache), ("v_cache", layer.v_cache)):
                if (t.dim() != 4 or t.shape[1:] != (block_size, KVH, D) or t.dtype != cache_dtype
                        or not t.is_contiguous() or t.device.type != "cpu"):
                    raise ValueError(f"layer {i} {name} must be a contiguous CPU {cache_dtype} "
                                     f"[blocks, {block_size}, {KVH}, {D}] tensor (layer 0's dtype)")
        if w.final_norm.dtype != torch.float32 or not w.final_norm.is_contiguous():
            raise ValueError("final_norm must be a contiguous float32 tensor")
        if w.head is not None:
            w.head.check("head", w.head.shape[0], H)
            if w.head.perm is not None:
                raise ValueError("head: the LM head takes no input permutation")
        self.lora_slots, self.lora_rank = check_lora(w, H, inter)
        """LoRA: the adapter slots and their rank (0, 0 without adapter tables)."""
        self.weights = w
        self.cache_dtype = cache_dtype
        """The KV caches' dtype (``torch.float32`` or ``torch.bfloat16``)."""
        self.hidden, self.vocab_size = H, (w.head.shape[0] if w.head is not None else 0)
        self.rotary_dim = R
        self.num_ropes = 1 + max(layer.rope for layer in w.layers)
        """The cos/sin tables a step takes (:meth:`step`)."""
        self._moes = [layer.moe.struct() if layer.moe is not None else None for layer in w.layers]
        self._loras = [lora_struct(layer.lora) if layer.lora else None for layer in w.layers]
        self._layers = (_Layer * len(w.layers))(*[
            _Layer(_data(layer.attn_in_norm), _data(layer.attn_out_norm), _data(layer.mlp_in_norm),
                   _data(layer.mlp_out_norm), _data(layer.q_norm), _data(layer.k_norm), layer.qkv.struct(),
                   layer.o.struct(), _mlp(layer.gate_up), _mlp(layer.down), layer.k_cache.data_ptr(),
                   layer.v_cache.data_ptr(), layer.window, layer.rope, ctypes.pointer(moe[0]) if moe else None,
                   ctypes.pointer(lora) if lora is not None else None)
            for layer, moe, lora in zip(w.layers, self._moes, self._loras)])
        matrices = [m for layer in w.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down) if m is not None]
        matrices += [m for layer in w.layers if layer.moe is not None for m in (*layer.moe.gate_up, *layer.moe.down)]
        matrices += [w.head] if w.head is not None else []
        if {m.matmul for m in matrices} - {None, "float32", matmul}:   # (cpu_plan.matrix_matmul)
            raise ValueError(f"a matrix's own matmul must be None, 'float32' or the decoder's {matmul!r}")
        on = [m for m in matrices if m.matmul != "float32"]   # the matrices on the decoder's kernels
        self.matmul = resolve_matmul(matmul, on) if on else "float32"
        """The matmul kernels the steps run (:data:`MATMULS`)."""
        self.head_matmul = "float32" if w.head is None or self.matmul == "float32" else w.head.matmul or self.matmul
        """The LM head's kernels (:data:`MATMULS`)."""
        self._head = w.head.struct() if w.head is not None else None
        self._struct = _Decoder(len(w.layers), H, QH, KVH, D, inter, block_size, w.eps, w.scale, self._layers,
                                w.final_norm.data_ptr(),
                                ctypes.pointer(self._head) if self._head is not None else None,
                                CACHE_DTYPES[cache_dtype], _MATMUL_CODES[self.matmul], QK_NORMS[w.qk_norm],
                                ACTS[w.act], R, int(w.rotary_interleaved), w.residual_scale, self.lora_rank, None,
                                all_reduce.address if all_reduce is not None else None)
        self.all_reduce = all_reduce   # (tensor parallelism: see the class docstring)
        self._lib = lib
        spin = env.CPU_SPIN_US.get()
        lib.kv_pool_start(threads or torch.get_num_threads(), spin)

    def profile(self) -> dict[str, float]:
        """Milliseconds per step in each phase of the C step since the last call (the process's
        fused decoders together), and ``steps``; resets the counters."""
        raw = (ctypes.c_int64 * len(PROFILE_PHASES))()
        self._lib.kv_decode_profile(ctypes.addressof(raw))
        steps = raw[-1]
        return {name: raw[i] / 1e6 / max(steps, 1) for i, name in enumerate(PROFILE_PHASES[:-1])} | {"steps": steps}

    def step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
             block_tables: torch.Tensor, seq_lens: torch.Tensor, logits_indices: torch.Tensor | None = None,
             lora_slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One step: each of the ``M`` rows is one token, a one-token decode at its position.

        Args:
            x: ``[M, H]`` float32 token embeddings (overwritten: the residual stream).
            cos, sin: ``[R, M, rotary_dim]`` float32 rotary embeddings of each row's position, one
                table per :attr:`num_ropes` (``[M, rotary_dim]`` when there is one), as the model's
                rotary module returns them (``rotary_dim``: :attr:`rotary_dim`).
            slots: ``[M]`` int64 cache slot of each row's new key/value (-1: not written).
            block_tables: ``[M, W]`` int32 block ids of each row's sequence.
            seq_lens: ``[M]`` int32 positions each row attends over (its own included).
            logits_indices: ``[L]`` int64 rows whose logits the LM head computes, in order
                (None: every row).
            lora_slots: ``[M]`` int64 LoRA slot of each row (-1: the base model; None: every row),
                for a decoder with LoRA tables (:attr:`lora_slots` slots). Not thread-safe: one
                :class:`FusedDecoder` steps in one thread at a time.

        Returns:
            ``(hidden [M, H] float32, logits [L, V] float32 or None)``: the final norm's output
            and the LM head's on the rows ``logits_indices`` (None without a head).

        Raises:
            ValueError: ``M`` outside 1..:data:`MAX_ROWS`, a row index outside ``0..M - 1``, or an
                argument of the wrong shape or dtype.
            TensorParallelStepError: an all-reduce failed (the ranks are out of step).
        """
        M = x.shape[0]
        R, T = self.rotary_dim, self.num_ropes
        if not 1 <= M <= MAX_ROWS:
            raise ValueError(f"a fused step takes 1..{MAX_ROWS} rows, got {M}")
        if logits_indices is not None:
            if logits_indices.dim() != 1 or logits_indices.dtype != torch.int64 or not logits_indices.is_contiguous():
                raise ValueError("logits_indices must be a contiguous int64 [L] tensor")
            if logits_indices.numel() and not (0 <= int(logits_indices.min()) and int(logits_indices.max()) < M):
                raise ValueError(f"logits_indices must be rows 0..{M - 1}")
        table = (T, M, R) if cos.dim() == 3 or T > 1 else (M, R)
        for name, t, shape, dtype in (("x", x, (M, self.hidden), torch.float32), ("cos", cos, table, torch.float32),
                                      ("sin", sin, table, torch.float32), ("slots", slots, (M,), torch.int64),
                                      ("seq_lens", seq_lens, (M,), torch.int32)):
            if t.shape != shape or t.dtype != dtype or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous {dtype} {shape} tensor, got {t.dtype} {tuple(t.shape)}")
        if block_tables.dim() != 2 or block_tables.shape[0] != M or block_tables.dtype != torch.int32 or \
                block_tables.stride(1) != 1:
            raise ValueError(f"block_tables must be int32 [{M}, W] with contiguous rows")
        if lora_slots is not None:
            if lora_slots.shape != (M,) or lora_slots.dtype != torch.int64 or not lora_slots.is_contiguous():
                raise ValueError(f"lora_slots must be a contiguous int64 ({M},) tensor, got {tuple(lora_slots.shape)}")
            if not self.lora_slots:
                raise ValueError("lora_slots given, but this decoder has no LoRA tables")
            if M and not (-1 <= int(lora_slots.min()) and int(lora_slots.max()) < self.lora_slots):
                raise ValueError(f"lora_slots must be -1 (none) or slots 0..{self.lora_slots - 1}")
        self._struct.lora_slots = lora_slots.data_ptr() if lora_slots is not None else None
        out = torch.empty((M, self.hidden), dtype=torch.float32)
        L = M if logits_indices is None else logits_indices.numel()
        logits = torch.empty((L, self.vocab_size), dtype=torch.float32) if self._head is not None else None
        rc = self._lib.kv_decode(ctypes.addressof(self._struct), M, x.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                 slots.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
                                 seq_lens.data_ptr(), out.data_ptr(), _data(logits) if L else None,
                                 _data(logits_indices), L)
        self._struct.lora_slots = None
        if rc == -2:
            raise TensorParallelStepError("the fused step's all-reduce failed") from self.all_reduce.error
        if rc != 0:
            raise MemoryError("kv_decode could not allocate its scratch memory")
        return out, logits
