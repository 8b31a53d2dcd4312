"""The GGUF file itself for kvfleet's reader (:mod:`kvfleet.runtime.worker.gguf_model`): its header,
its tensor table over a memory map, and each tensor as stored.

Contract: :func:`read_architecture` reads ``general.architecture`` from the head of a file without
parsing the rest; :func:`open_reader` gives the ``gguf`` package's ``GGUFReader`` over the file
without its vocabulary (metadata arrays of more than :data:`BIG_ARRAY` items stepped over, each item
read as an empty string or a zero: their count stays; the parsed header's pages of the map
released), and :func:`shared_reader` hands that reader to transformers' GGUF config loader for a
call; :func:`stored` repacks one tensor into its kernel format
(:func:`kvfleet.runtime.worker.gguf_tensors.from_gguf`) chunk by chunk, releasing the map's pages as
it goes (:func:`drop_pages`, with the neighbouring pages a read fault maps in too), and
:func:`stored_experts` a MoE layer's ``[E, N, K]`` experts tensor expert by expert, each handing the C
heap's free pages back as it goes (:func:`trim_heap`). Every bad file is
a :class:`GgufError`: one line naming the file and the reason.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from kvfleet.runtime.model_errors import INVALID_MODEL_FILE
from kvfleet.runtime.worker.gguf_tensors import FIELDS, Stored, from_gguf


class GgufError(ValueError):
    """A GGUF file kvfleet cannot load; ``str()`` is one line naming the file and the reason
    (``bad_input``: the server logs that line alone, no traceback); ``reason`` is one of
    :data:`kvfleet.runtime.model_errors.REASONS` (the termination log's, which the operator shows)."""

    bad_input = True

    def __init__(self, message: str, reason: str = INVALID_MODEL_FILE) -> None:
        super().__init__(message)
        self.reason = reason


BIG_ARRAY = 4096
"""Metadata arrays longer than this are the tokenizer's (vocabulary, scores, merges): not parsed."""


@contextlib.contextmanager
def shared_reader(path: Path, reader):
    """transformers' GGUF config loader builds a ``GGUFReader`` (its tokenizer loader too, to pick the
    class); for the call, hand them ours for this file (the others as usual)."""
    import gguf

    real = gguf.GGUFReader

    def reader_for(p, *args, **kwargs):
        return reader if Path(p).resolve() == path else real(p, *args, **kwargs)

    gguf.GGUFReader = reader_for
    try:
        yield
    finally:
        gguf.GGUFReader = real


_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
"""GGUF metadata value types of a fixed size (bytes); 8 is a string, 9 an array."""


def read_architecture(path: Path) -> str:
    """The file's ``general.architecture``, read from the head of the file without parsing the
    rest (a full parse of a large vocabulary takes tens of seconds).

    Raises:
        GgufError: not a GGUF file (magic), an unsupported version, or the header ends early.
    """
    import struct

    path = Path(path)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if m[:4] != b"GGUF":
                raise GgufError(f"{path}: not a GGUF file (magic {bytes(m[:4])!r}, expected b'GGUF')")
            version, _, kv_count = struct.unpack_from("<IQQ", m, 4)
            if version not in (2, 3):
                raise GgufError(f"{path}: GGUF version {version} is not supported (2 or 3)")
            pos = 24

            def string(at: int) -> tuple[str, int]:
                (n,) = struct.unpack_from("<Q", m, at)
                if at + 8 + n > len(m):
                    raise struct.error("string past the end")
                return bytes(m[at + 8:at + 8 + n]).decode("utf-8", "replace"), at + 8 + n

            def skip(kind: int, at: int) -> int:
                if kind in _SCALARS:
                    return at + _SCALARS[kind]
                if kind == 8:
                    return string(at)[1]
                if kind == 9:
                    item, count = struct.unpack_from("<IQ", m, at)
                    at += 12
                    if item in _SCALARS:
                        return at + count * _SCALARS[item]
                    for _ in range(count):
                        at = skip(item, at)
                    return at
                raise GgufError(f"{path}: unknown GGUF metadata value type {kind}")

            for _ in range(kv_count):
                key, pos = string(pos)
                (kind,) = struct.unpack_from("<I", m, pos)
                pos += 4
                if key == "general.architecture" and kind == 8:
                    return string(pos)[0]
                pos = skip(kind, pos)
    except (struct.error, ValueError, OSError) as exc:
        if isinstance(exc, GgufError):
            raise
        raise GgufError(f"{path}: truncated or unreadable GGUF header ({exc})") from None
    raise GgufError(f"{path}: no general.architecture in the GGUF metadata")


def _reader_class():
    import gguf

    class Reader(gguf.GGUFReader):
        """``gguf.GGUFReader`` without the vocabulary: metadata arrays of more than :data:`BIG_ARRAY`
        items (the tokens, their scores and types, merges) are stepped over, each item read as an
        empty string or a zero (their count stays: the config's ``vocab_size``) (the
        stock reader makes numpy views of every element: ~320 MB and seconds for the Gemma 3 file;
        the tokenizer's conversion reads them with transformers' own parser); the map is a plain
        ndarray view (``np.memmap``'s Python-level ``__getitem__`` costs seconds over many small
        reads)."""

        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, mm):
            self.memmap = mm
            self._plain = np.asarray(mm).view(np.ndarray)

        def _push_field(self, field, skip_sum: bool = False) -> int:
            if len(field.data) > BIG_ARRAY and len(set(field.data[:2])) == 1:  # a stepped-over array's
                field = field._replace(data=_Same(field.data[0], len(field.data)))  # indices, not a list
            return super()._push_field(field, skip_sum)

        def _get_field_parts(self, orig_offs, raw_type):
            if int(raw_type) != gguf.GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            count = self._get(orig_offs + 4, np.uint64)
            if int(count[0]) <= BIG_ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            item = int(raw_itype[0])
            end = _skip_array(self._plain, item, int(count[0]), orig_offs + 12)
            np_type = self.gguf_scalar_to_np.get(gguf.GGUFValueType(item)) if item in _SCALARS else None
            blank = np.zeros(1 if np_type else 0, dtype=np_type or np.uint8)  # every item reads as this
            return (end - orig_offs, [raw_itype, count, blank], _Same(2, int(count[0])),
                    [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType(item)])

    return Reader


class _Same(Sequence):
    """``count`` times ``value`` without a list of them (a stepped-over array's item indices: a list
    of 262,144 would be 2 MB per array)."""

    def __init__(self, value: int, count: int) -> None:
        self.value, self.count = value, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self.value] * len(range(*index.indices(self.count)))
        if not -self.count <= index < self.count:
            raise IndexError(index)
        return self.value


def _skip_array(buf, item: int, count: int, at: int) -> int:
    """Offset just past a metadata array of ``count`` items of type ``item`` starting at ``at``."""
    import struct

    if item in _SCALARS:
        return at + count * _SCALARS[item]
    for _ in range(count):
        if item == 8:
            at += 8 + struct.unpack_from("<Q", buf, at)[0]
        elif item == 9:
            inner, n = struct.unpack_from("<IQ", buf, at)
            at = _skip_array(buf, inner, n, at + 12)
        else:
            raise ValueError(f"unknown GGUF metadata value type {item}")
    return at


def open_reader(path: Path):
    """The file's ``GGUFReader`` (vocabulary stepped over), the map's pages of the metadata and tensor
    table it parsed released from the process (clean file pages: the Gemma 3 file's vocabulary is
    ~12 MB of them; read again if a later parse needs them)."""
    try:
        reader = _reader_class()(str(path))
        drop_pages(reader, 0, reader.data_offset)
        return reader
    except Exception as exc:  # wrong magic, a truncated file, an unknown tensor type: the reader's words
        size = path.stat().st_size if path.exists() else 0
        if isinstance(exc, ValueError) and "cannot reshape array" in str(exc):
            # the tensor table parsed, but a tensor's data is a shorter view than its shape: the
            # map ended early (numpy's reshape is where the gguf package notices)
            raise GgufError(f"{path}: truncated GGUF file: its tensor data runs past the end of the file "
                            f"({size} bytes; a partial download?)") from None
        if "requires a buffer of at least" in str(exc) or isinstance(exc, (EOFError, IndexError)):
            # the header or tensor table itself ends early (struct's / numpy's words for a short read)
            raise GgufError(f"{path}: truncated GGUF file: its header ends early ({size} bytes; a partial "
                            "download?)") from None
        raise GgufError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None


def architecture(reader) -> str:
    field = reader.fields.get("general.architecture")
    return bytes(field.parts[-1]).decode() if field is not None else ""


FAULT_AROUND = 256 << 10
"""A read fault on a file map also maps the neighbouring pages already in the page cache (Linux's
``fault_around_bytes``, 64 KiB by default): dropping a range drops this much on either side too, or
each tensor's read would map back pages of the tensors around it (~9 MB over SmolLM2's 272
tensors, measured)."""


def drop_pages(reader, start: int, length: int) -> None:
    """Release bytes ``start .. start + length`` of the file map from this process (whole pages
    inside or under them, and :data:`FAULT_AROUND` bytes either side; clean pages: read again if
    needed)."""
    mm = getattr(getattr(reader, "memmap", None), "_mmap", None)
    if mm is None or not hasattr(mm, "madvise"):
        return
    first = max(0, int(start) - FAULT_AROUND) // mmap.PAGESIZE * mmap.PAGESIZE
    end = min(len(mm), int(start) + int(length) + FAULT_AROUND)
    with contextlib.suppress(OSError, ValueError):
        if end > first:
            mm.madvise(mmap.MADV_DONTNEED, first, end - first)


_LIBC = None


def trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc ``malloc_trim(0)``; a no-op elsewhere).
    A repack's numpy temporaries of megabytes come from the heap once glibc's mmap threshold has
    risen past them; without this, their freed pages stay resident (~9 MB over Gemma 3's tensors)."""
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC(0)


CHUNK_BYTES = 256 << 10
"""A weight larger than this in the file is repacked this many bytes of rows at a time, each chunk's
pages of the map released before the next: the file's copy of it is never resident whole next to
the repacked one (the Gemma 3 embedding: 178 MB), and the repack's temporaries (a few times the
chunk) stay small beside the weights already read (16 MB chunks: Gemma 3's last tensor, 1 MB, had
its whole repack's ~3.5 MB of temporaries at the load's peak; the same CPU seconds)."""


def stored(reader, t, dims: list[int]) -> Stored:
    """GGUF tensor ``t`` (``dims`` rows first) in its kernel format, its pages of the map released."""
    n, k = dims
    row_bytes = int(t.n_bytes) // n
    step = max(1, CHUNK_BYTES // max(row_bytes, 1))
    if n <= step:
        stored = from_gguf(t.tensor_type, t.data, (n, k), t.name)
        drop_pages(reader, t.data_offset, t.n_bytes)
        return stored
    out: dict[str, torch.Tensor] = {}
    kind = None
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        part = from_gguf(t.tensor_type, t.data[r0:r1], (r1 - r0, k), t.name)
        if kind is None:
            kind = (part.fmt, part.group, part.source)
            out = {f: torch.empty((n, *x.shape[1:]), dtype=x.dtype) for f in FIELDS
                   if (x := getattr(part, f)) is not None}
        for f, x in out.items():
            x[r0:r1] = getattr(part, f)
        drop_pages(reader, t.data_offset + r0 * row_bytes, (r1 - r0) * row_bytes)
        del part
        trim_heap()
    fmt, group, source = kind
    return Stored(fmt, group=group, source=source, **{f: out.get(f) for f in FIELDS})


def stored_experts(reader, t) -> list[Stored]:
    """A MoE layer's GGUF tensor ``[E, N, K]`` (llama.cpp's ``ffn_{gate,up,down}_exps``) as one
    stored weight ``[N, K]`` per expert, each expert's pages of the map released once repacked. The
    experts keep the kernels' earlier forms (:meth:`Stored.plain`: int8 weights, float32 scales): the
    MoE stacking (:mod:`kvfleet.runtime.worker.gguf_experts`) does not take float16 scales or the
    5-bit form."""
    dims = [int(d) for d in reversed(t.shape)]
    if len(dims) != 3:
        raise ValueError(f"{t.name}: an experts tensor has 3 dimensions, not {len(dims)}")
    e, n, k = dims
    per = int(t.n_bytes) // e
    data = t.data.reshape(e, n, -1)
    out = []
    for i in range(e):
        out.append(from_gguf(t.tensor_type, data[i], (n, k), f"{t.name}[{i}]").plain())
        drop_pages(reader, t.data_offset + i * per, per)
        if per >= 1 << 20:
            trim_heap()
    return out
