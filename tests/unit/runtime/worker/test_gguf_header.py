"""The GGUF file for kvfleet's reader (runtime/worker/gguf_header.py): the tensor table read with the
vocabulary stepped over (its count kept, transformers' parse of the other fields unchanged), and a
large tensor repacked in chunks equal to the whole tensor's repack."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kvfleet.runtime.worker import gguf_header
from kvfleet.runtime.worker.gguf_tensors import from_gguf

TOKENS = [f"tok{i}" for i in range(gguf_header.BIG_ARRAY + 7)]


@pytest.fixture(scope="module")
def small_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_token_list(TOKENS)
    w.add_token_scores([float(i) for i in range(len(TOKENS))])
    w.add_array("llama.small_list", [3, 1, 4])
    q8 = gguf.quants.quantize(rng.standard_normal((96, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.ffn_down.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", rng.standard_normal(64).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_vocabulary_is_stepped_over_and_the_rest_read_as_gguf_reads_it(small_file):
    from transformers.integrations.ggml import _gguf_parse_value

    ours, stock = gguf_header.open_reader(small_file), gguf.GGUFReader(str(small_file))
    assert gguf_header.architecture(ours) == "llama"
    tokens = ours.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == len(TOKENS)  # the count (the config's vocab_size), not the strings
    assert not isinstance(tokens.data, list)  # nor a list of their indices
    assert {_gguf_parse_value(tokens.parts[i], tokens.types) for i in tokens.data} == {""}
    assert {_gguf_parse_value(ours.fields["tokenizer.ggml.scores"].parts[i], ours.fields["tokenizer.ggml.scores"]
                              .types) for i in ours.fields["tokenizer.ggml.scores"].data} == {0.0}
    small = ours.fields["llama.small_list"]
    assert [_gguf_parse_value(small.parts[i], small.types) for i in small.data] == [3, 1, 4]
    assert [t.name for t in ours.tensors] == [t.name for t in stock.tensors]
    for a, b in zip(ours.tensors, stock.tensors):
        assert a.data_offset == b.data_offset and np.array_equal(a.data, b.data)


def test_a_large_tensor_is_repacked_in_chunks_as_a_whole(small_file, monkeypatch):
    reader = gguf_header.open_reader(small_file)
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    whole = from_gguf(t.tensor_type, t.data, (96, 64), t.name)
    monkeypatch.setattr(gguf_header, "CHUNK_BYTES", 5 * int(t.n_bytes) // 96)  # 5 rows a chunk: 20, the last 1
    chunked = gguf_header.stored(reader, t, [96, 64])
    assert (chunked.fmt, chunked.group) == (whole.fmt, whole.group)
    for f in ("w", "scale", "shift"):
        a, b = getattr(chunked, f), getattr(whole, f)
        assert (a is None and b is None) or torch.equal(a, b), f
    assert torch.equal(chunked.dequantize(), whole.dequantize())


def test_a_file_cut_inside_its_tensor_data_is_named_truncated(small_file, tmp_path):
    data = small_file.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) - 300])  # the header and tensor table whole, the last tensor short
    with pytest.raises(gguf_header.GgufError, match=r"cut\.gguf: truncated GGUF file: .*\(\d+ bytes"):
        gguf_header.open_reader(cut)


def _mapped_kb(path) -> int:
    """Resident kB of this process's maps of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        if "-" in line.split(" ", 1)[0]:
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def test_every_tensor_read_leaves_none_of_the_map_resident(tmp_path):
    """Each tensor's pages are released once repacked, the neighbours a read fault maps with them
    (the kernel's fault-around) too: after the last tensor none of the file's map is resident."""
    path = tmp_path / "many.gguf"
    rng = np.random.default_rng(1)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_token_list(TOKENS)
    for i in range(24):  # 69,632 bytes each: tensors straddle the 64 KiB fault-around windows
        q8 = gguf.quants.quantize(rng.standard_normal((64, 1024)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(f"blk.{i}.ffn_down.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf_header.open_reader(path)
    assert _mapped_kb(path) <= 4  # the header and the vocabulary's pages released after the parse
    kept = [gguf_header.stored(reader, t, [64, 1024]) for t in reader.tensors]
    assert len(kept) == 24 and _mapped_kb(path) <= 4
    ref = gguf.GGUFReader(str(path))
    t = ref.tensors[5]
    assert torch.equal(kept[5].dequantize(), torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)))
