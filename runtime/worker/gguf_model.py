"""kvfleet's own GGUF reader: a transformers model whose weights come straight from the file, as stored.

Contract: :func:`load` turns a ``.gguf`` file into ``(model, tokenizer)``:

- the config is transformers' own GGUF conversion (``AutoConfig`` with ``gguf_file=``, its own
  metadata parser), the tokenizer transformers' conversion stored and loaded lean
  (:mod:`kvfleet.runtime.worker.gguf_tokenizer`), built before any weight is read; the tensor table
  comes from the ``gguf`` package's memory-mapped ``GGUFReader``, its metadata arrays (the
  vocabulary) stepped over, not parsed;
- the model is built with its parameters on the ``meta`` device (``accelerate.init_empty_weights``,
  buffers such as rotary tables made as usual), then every tensor is filled from the file: a linear
  layer's weight becomes the layer that runs it in its stored format
  (:meth:`kvfleet.runtime.worker.gguf_tensors.Stored.module`: ``Int4Linear`` / ``Int8GroupLinear``
  / ``Bf16Linear`` / a float32 ``nn.Linear``), the token embedding a :class:`StoredEmbedding` over the
  stored table when it is quantized (rows dequantized as they are looked up; a tied LM head runs on
  the same tensors), every other tensor (norms, biases) float32 after transformers' own tensor
  processor for the architecture (Gemma's norms stored plus one, llama's q/k bias permutation);
  llama-architecture q / k weights get their rows un-permuted as transformers does (llama.cpp's
  converter permutes them for its rotary layout);
- never a float32 copy of the model: each tensor is repacked from the map, and its pages are
  dropped from the process (``madvise(MADV_DONTNEED)``) once repacked, so peak memory is about the
  repacked weights, not the file plus them;
- the derived config, tokenizer and repacked tensors are written to ``cache_folder`` (safetensors +
  ``layout.json``, atomically); a later :func:`load` reads only those (seconds, no GGUF parse).

Architectures: those whose transformers tensor processor is the plain one, llama's or Gemma's
(:data:`LINEAR_SAFE`), mixture-of-experts files among them (Mixtral as llama.cpp writes it, ``llama``
with experts; ``qwen3moe``): their experts as stored through
:mod:`kvfleet.runtime.worker.gguf_experts`; others raise :class:`GgufError` (the caller may fall
back to transformers' float32 conversion). Any bad file (wrong magic, truncated, an unknown tensor type, an architecture
transformers has no GGUF mapping for) raises :class:`GgufError` whose message names the file and
the reason in one line.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kvfleet.runtime import env
from kvfleet.runtime.model_errors import INVALID_MODEL_FILE, UNSUPPORTED_ARCHITECTURE, UNSUPPORTED_QUANTIZATION
from kvfleet.runtime.worker import gguf_experts, gguf_tokenizer
from kvfleet.runtime.worker.gguf_header import (
    GgufError,
    architecture,
    drop_pages,
    open_reader,
    shared_reader,
    stored_experts,
    trim_heap,
)
from kvfleet.runtime.worker.gguf_header import read_architecture as read_architecture  # this module's API too
from kvfleet.runtime.worker.gguf_header import stored as stored_tensor
from kvfleet.runtime.worker.gguf_tensors import Stored, to_float32, unify_siblings

logger = logging.getLogger(__name__)

LAYOUT = "layout.json"
TENSORS = "tensors.safetensors"
LAYOUT_VERSION = 5  # 2: compact merges; 3: added_tokens_decoder in tokenizer_config.json; "experts" optional;
# 4: float16 scales (Q8_0, Q5_0, Q5_1) and Q5_0's 5-bit form ("<prefix>.high"); 5: K-quants' scales factored
# ("<prefix>.scale_d" / ".shift_d"), Q5_0 siblings of a Q8_0 v kept 5-bit
TRIM_BYTES = 1 << 20
"""After each tensor of this many bytes in the file, the heap's free pages go back (:func:`trim_heap`)."""
LINEAR_SAFE = {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2", "granite", "glm4",
               "starcoder2", "stablelm", "nemotron", "deci", "mixtral", "qwen3moe"}
"""GGUF architectures whose transformers tensor processor leaves linear weights as stored (or, for
llama, only permutes q / k rows, which :func:`load` does on the stored rows)."""
_PERMUTED = {"llama"}  # transformers' LlamaTensorProcessor: attn_q / attn_k rows permuted by llama.cpp


class StoredEmbedding(torch.nn.Module):
    """A token embedding over a quantized table (:class:`~kvfleet.runtime.worker.gguf_tensors.Stored`):
    each looked-up row dequantized to float32 as it is read (the table stays as stored), times
    ``embed_scale`` when the model's embedding has one (Gemma's scaled embedding, as transformers
    multiplies it). ``weight`` is the stored table (for byte counts)."""

    def __init__(self, stored: Stored, embed_scale: torch.Tensor | None = None) -> None:
        super().__init__()
        self.stored = stored
        self.num_embeddings, self.embedding_dim = stored.shape
        self.register_buffer("weight", stored.w, persistent=False)
        self.register_buffer("qscale", stored.scale, persistent=False)
        self.register_buffer("qshift", stored.shift, persistent=False)
        self.register_buffer("qhigh", stored.high, persistent=False)
        self.register_buffer("qscale_d", stored.scale_d, persistent=False)
        self.register_buffer("qshift_d", stored.shift_d, persistent=False)
        self.register_buffer("embed_scale", embed_scale, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self.stored.rows(input_ids)
        return out if self.embed_scale is None else out * self.embed_scale.to(out.dtype)


def _tensor_reason(exc: ValueError) -> str:
    """A tensor's load error's reason: a ggml type kvfleet does not read (gguf_tensors' messages name
    the "tensor type"), else a file that is not what it says."""
    return UNSUPPORTED_QUANTIZATION if "tensor type" in str(exc) else INVALID_MODEL_FILE


def _empty_model(config, attn_implementation: str):
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    if callable(attn_implementation):
        attn_implementation = attn_implementation(config)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn_implementation)
    return model


def _unpermute(n_rows: int, n_head: int) -> torch.Tensor:
    """Row order undoing llama.cpp's q / k permutation (transformers' ``_reverse_permute_weights``)."""
    dim = n_rows // n_head // 2
    return torch.arange(n_rows).reshape(n_head, dim, 2).transpose(2, 1).reshape(n_rows)


def _name_map(model, arch: str, num_layers: int) -> dict[str, str]:
    """GGUF tensor name -> the model's parameter name, by the ``gguf`` package's name table for the
    architecture (what transformers' ``get_gguf_hf_weights_map`` does at the top level, once: its
    walk of every submodule built the table ~400 times, seconds)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    key = next((k for k, v in MODEL_ARCH_NAMES.items() if v == arch), None)
    if key is None:
        return {}
    table = get_tensor_name_map(key, num_layers)
    out = {}
    for hf_name in model.state_dict():
        name, dot, suffix = hf_name.rpartition(".")
        if suffix not in ("weight", "bias"):
            name, dot, suffix = hf_name, "", ""
        gguf_name = table.get_name(name)
        if gguf_name is not None:
            out[gguf_name + dot + suffix] = hf_name
    return out


def _set_param(model, name: str, value: torch.Tensor) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, attr)
    if tuple(old.shape) != tuple(value.shape):
        value = value.reshape(old.shape)
    if isinstance(old, torch.nn.Parameter) or old is None or old.is_meta:
        setattr(parent, attr, torch.nn.Parameter(value.float().contiguous(), requires_grad=False))
    else:
        old.copy_(value)


def _replace(model, name: str, module: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def _assemble(model, linears: dict[str, Stored], biases: dict[str, torch.Tensor], embedding: tuple[str, Stored] | None,
              head_tied: bool, experts: dict | None = None) -> None:
    """Put the stored weights into ``model`` (its parameters and the float tensors already set)."""
    gguf_experts.assemble(model, experts or {})
    emb_module = model.get_input_embeddings()
    emb_name = next(n for n, m in model.named_modules() if m is emb_module)
    head = model.get_output_embeddings()
    head_name = next((n for n, m in model.named_modules() if m is head), None) if head is not None else None
    for name, stored in unify_siblings(linears).items():
        _replace(model, name, stored.module(biases.get(name)))
    if embedding is not None:
        _, stored = embedding
        if stored.fmt in ("fp32", "bf16"):
            emb_module.weight = torch.nn.Parameter(stored.w.float().contiguous(), requires_grad=False)
        else:
            _replace(model, emb_name, StoredEmbedding(stored, getattr(emb_module, "embed_scale", None)))
    if head_tied and head_name is not None:
        if embedding is None:
            raise ValueError("the file has neither an output tensor nor a token embedding")
        stored = embedding[1]
        if stored.fmt in ("fp32", "bf16"):
            head.weight = model.get_input_embeddings().weight  # tied, as transformers ties it
        else:
            _replace(model, head_name, stored.module())  # the same tensors, run as a linear layer
            for cfg in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
                cfg.tie_word_embeddings = False


def _check_filled(model, path: Path) -> None:
    missing = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p is not None and p.is_meta]
    if missing:
        raise GgufError(f"{path}: no tensor in the file for {', '.join(missing[:4])}"
                        f"{' ...' if len(missing) > 4 else ''}")


def _from_file(path: Path, attn_implementation: str, tok_dir: Path, five_bit: bool = True):
    """(model, tokenizer, config, cache record) from the GGUF file itself; the tokenizer's files are
    written to ``tok_dir``."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    t0 = time.monotonic()
    reader = open_reader(path)
    arch = architecture(reader)
    logger.info("GGUF %s: header read in %.1f s (architecture %s, %d tensors)", path.name, time.monotonic() - t0,
                arch or "?", len(reader.tensors))
    if arch not in LINEAR_SAFE:
        raise GgufError(f"{path}: GGUF architecture {arch!r} is not one kvfleet's GGUF reader takes "
                        f"({', '.join(sorted(LINEAR_SAFE))})", UNSUPPORTED_ARCHITECTURE)
    try:
        with shared_reader(path.resolve(), reader):
            config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
            shared = gguf_tokenizer.build(path, tok_dir)  # before the weights: its transient is the load's largest
        if not shared:  # this transformers read the vocabulary through the reader: its own, in full
            gguf_tokenizer.build(path, tok_dir)
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise GgufError(f"{path}: transformers cannot map its config or tokenizer ({exc})") from None
    config = gguf_experts.moe_config(reader, arch, config)
    tokenizer = gguf_tokenizer.load(tok_dir)
    model = _empty_model(config, attn_implementation)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    name_map = _name_map(model, arch, config.get_text_config().num_hidden_layers)
    if any(t.name not in name_map and not gguf_experts.match(t.name) for t in reader.tensors):
        # transformers' full (slower) walk of the submodules
        name_map = get_gguf_hf_weights_map(model, processor)
    text = config.get_text_config()
    heads = {"attn_q": text.num_attention_heads,
             "attn_k": getattr(text, "num_key_value_heads", None) or text.num_attention_heads}
    emb_module = model.get_input_embeddings()
    linears: dict[str, Stored] = {}
    biases: dict[str, torch.Tensor] = {}
    floats: dict[str, torch.Tensor] = {}
    embedding = None
    expert_parts: dict[int, dict[str, list[Stored]]] = {}
    for t in reader.tensors:
        if (which := gguf_experts.match(t.name)) is not None:
            try:
                expert_parts.setdefault(which[0], {})[which[1]] = stored_experts(reader, t)
            except ValueError as exc:
                raise GgufError(f"{path}: {exc}", _tensor_reason(exc)) from None
            continue
        hf = name_map.get(t.name)
        if hf is None:
            logger.info("GGUF %s: tensor %s has no place in the model; skipped", path.name, t.name)
            continue
        parent_name, _, attr = hf.rpartition(".")
        parent = model.get_submodule(parent_name)
        dims = [int(d) for d in reversed(t.shape)]  # numpy order: rows first
        try:
            if attr == "weight" and len(dims) == 2 and (isinstance(parent, torch.nn.Linear) or parent is emb_module):
                stored = stored_tensor(reader, t, dims)
                if not five_bit:
                    stored = stored.unpacked()
                kind = t.name.split(".")[-2] if t.name.count(".") >= 2 else ""
                if arch in _PERMUTED and kind in heads:
                    stored = stored.take(_unpermute(dims[0], heads[kind]))
                if parent is emb_module:
                    embedding = (parent_name, stored)
                else:
                    linears[parent_name] = stored
            else:
                w = to_float32(t.tensor_type, t.data, t.name).reshape(dims).numpy()
                w = processor.process(weights=w, name=t.name, tensor_key_mapping=name_map,
                                      parsed_parameters={"config": config.to_dict()}).weights
                value = torch.from_numpy(np.array(w, dtype=np.float32))
                if attr == "bias" and isinstance(parent, torch.nn.Linear):
                    biases[parent_name] = value
                else:
                    floats[hf] = value
        except ValueError as exc:
            raise GgufError(f"{path}: {exc}", _tensor_reason(exc)) from None
        drop_pages(reader, t.data_offset, t.n_bytes)
        if t.n_bytes >= TRIM_BYTES:
            trim_heap()
    head_tied = not any(t.name == "output.weight" for t in reader.tensors)
    for name, value in floats.items():
        _set_param(model, name, value)
    for name, value in biases.items():  # a float32 layer's bias lives on it; quantized layers take theirs below
        if name not in linears:
            _set_param(model, f"{name}.bias", value)
    try:
        experts = gguf_experts.combine(model, expert_parts)
    except ValueError as exc:
        raise GgufError(f"{path}: {exc}") from None
    # siblings unified here, not only in _assemble: the record (the cache) then holds the one form the
    # model runs (Q5_0 siblings of a Q8_0 v stay 5-bit: the fused decoder's stacking takes them as int8)
    unify_siblings(linears, in_place=True, after_each=trim_heap)
    _assemble(model, linears, biases, embedding, head_tied, experts)
    _check_filled(model, path)
    record = {"linears": linears, "biases": {k: v for k, v in biases.items() if k in linears}, "floats": floats,
              "embedding": embedding, "head_tied": head_tied, "experts": experts}
    counts: dict[str, int] = {}
    for stored in [*linears.values(), *([embedding[1]] if embedding else [])]:
        counts[stored.source] = counts.get(stored.source, 0) + 1
    for gate_up, down in experts.values():
        for stored in [*gate_up, *down]:
            counts[f"{stored.source} expert"] = counts.get(f"{stored.source} expert", 0) + 1
    logger.info("GGUF %s: %s tensors kept as stored (%s) in %.1f s", path.name, len(linears) + bool(embedding),
                ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), time.monotonic() - t0)
    del reader
    return model, tokenizer, config, record


def _write_cache(folder: Path, config, tok_dir: Path, record: dict) -> None:
    """``folder``: config, tokenizer, ``tensors.safetensors`` and ``layout.json``, written to a
    temporary sibling and renamed (another process's finished copy wins)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    layout = {"version": LAYOUT_VERSION, "linears": {}, "embedding": None, "head_tied": record["head_tied"],
              "floats": sorted(record["floats"]), "biases": sorted(record["biases"])}
    for name, stored in record["linears"].items():
        tensors.update(stored.tensors(f"linear.{name}"))
        layout["linears"][name] = {"fmt": stored.fmt, "group": stored.group, "source": stored.source}
    if record["embedding"] is not None:
        name, stored = record["embedding"]
        tensors.update(stored.tensors("embedding"))
        layout["embedding"] = {"name": name, "fmt": stored.fmt, "group": stored.group, "source": stored.source}
    tensors.update({f"float.{k}": v.contiguous() for k, v in record["floats"].items()})
    tensors.update({f"bias.{k}": v.contiguous() for k, v in record["biases"].items()})
    if record.get("experts"):
        flat, layout["experts"] = gguf_experts.tensors(record["experts"])
        tensors.update(flat)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    except OSError as exc:  # a read-only cache only costs the parse again next time
        logger.info("GGUF: not cached (%s)", exc)
        return
    try:
        os.chmod(tmp, 0o755)
        config.save_pretrained(tmp)
        for f in Path(tok_dir).iterdir():  # the tokenizer's files as built (compact merges)
            shutil.copy(f, tmp / f.name)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / TENSORS))
        (tmp / LAYOUT).write_text(json.dumps(layout, indent=1))
        try:
            os.rename(tmp, folder)
        except OSError:
            if not (folder / LAYOUT).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        logger.info("GGUF: not cached (%s)", exc)


def _from_cache(folder: Path, attn_implementation: str, five_bit: bool = True):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    layout = json.loads((folder / LAYOUT).read_text())
    if layout.get("version") != LAYOUT_VERSION:
        return None
    config = AutoConfig.from_pretrained(str(folder))
    tokenizer = gguf_tokenizer.load(folder)
    tensors = load_file(str(folder / TENSORS))
    model = _empty_model(config, attn_implementation)
    for name in layout["floats"]:
        _set_param(model, name, tensors[f"float.{name}"])
    biases = {name: tensors[f"bias.{name}"] for name in layout["biases"]}
    linears = {name: Stored.from_tensors(tensors, f"linear.{name}", spec["fmt"], spec["group"])
               for name, spec in layout["linears"].items()}
    if not five_bit:
        linears = {name: stored.unpacked() for name, stored in linears.items()}
    embedding = None
    if layout["embedding"] is not None:
        spec = layout["embedding"]
        embedding = (spec["name"], Stored.from_tensors(tensors, "embedding", spec["fmt"], spec["group"]))
    experts = gguf_experts.from_tensors(tensors, layout.get("experts", {}))
    _assemble(model, linears, biases, embedding, layout["head_tied"], experts)
    _check_filled(model, folder)
    return model, tokenizer


def five_bit_for(plan) -> bool:
    """Whether :func:`load` should keep Q5_0 in the 5-bit form for a CPU plan
    (:class:`~kvfleet.runtime.worker.cpu_plan.CpuPlan`): where the fused decoder's matmuls are AMX tiles."""
    from kvfleet.kernels.cpu_decoder import resolve_matmul

    return plan.bf16_matmuls and resolve_matmul(env.CPU_MATMUL.get() or plan.matmul) == "amx"


def load(path: Path, cache_folder: Path | None = None, attn_implementation="sdpa", plan=None):
    """``(model, tokenizer)`` for the GGUF file ``path`` (the module docstring), in eval mode with no
    gradients; from ``cache_folder`` when a previous load wrote it there, else from the file (then
    written there). ``attn_implementation``: a name, or a function of the config giving one.
    ``plan``: the CPU plan the model will run under (None: as on AMX tiles): Q5_0 tensors are kept in
    grouped int8's 5-bit form (as stored: 0.69 bytes a weight) where its fused decoder's matmuls are
    AMX tiles (:func:`five_bit_for`: their widening reads it as fast as int8; the float32 kernels
    and the AVX512-BF16 dot products 1.3-1.45x slower at one row: docs/performance.md, "GGUF files
    as stored"), else one byte a weight. A cache entry holds the form of the start that wrote it;
    a 5-bit one is taken as int8 where not asked for.

    Raises:
        GgufError: the file cannot be loaded (one line: the file and the reason).
    """
    path = Path(path)
    five_bit = plan is None or five_bit_for(plan)
    t0 = time.monotonic()
    loaded = None
    if cache_folder is not None and (cache_folder / LAYOUT).is_file():
        try:
            loaded = _from_cache(cache_folder, attn_implementation, five_bit)
        except Exception as exc:  # a damaged entry costs a parse of the file, never the start
            logger.warning("GGUF %s: the cache %s is unreadable (%s: %s); reading the file", path.name,
                           cache_folder, type(exc).__name__, exc)
        if loaded is not None:
            logger.info("GGUF %s: loaded as stored from the cache %s in %.1f s", path.name, cache_folder,
                        time.monotonic() - t0)
        else:  # another layout version or damaged: replaced below
            shutil.rmtree(cache_folder, ignore_errors=True)
    if loaded is None:
        with tempfile.TemporaryDirectory(prefix="kvfleet-gguf-tokenizer-") as tok_dir:
            model, tokenizer, config, record = _from_file(path, attn_implementation, Path(tok_dir), five_bit)
            if cache_folder is not None:
                _write_cache(cache_folder, config, tok_dir, record)
        gguf_tokenizer.release_heap()
        loaded = (model, tokenizer)
    model, tokenizer = loaded
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer
