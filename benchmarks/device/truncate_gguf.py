"""Write a copy of a Llama-architecture GGUF file that keeps only its first N transformer layers.

Used by ``benchmarks/device/prepare.sh``: the default model's wheel (89 MiB) is larger than
one device call may carry (64 MiB), so the GPU check's engine section runs on its first N
of 30 layers. Tensors are copied byte for byte (same quantization), the metadata unchanged
except ``<arch>.block_count`` (the copy follows ``gguf``'s ``gguf_new_metadata.py``)::

    python benchmarks/device/truncate_gguf.py IN.gguf OUT.gguf --layers 8

Needs the ``gguf`` package. Raises SystemExit with a message when the file has no
``<arch>.block_count`` or ``--layers`` is not in ``1..block_count``.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path


def truncate(src: Path, dst: Path, layers: int) -> tuple[int, int]:
    """Copy ``src`` to ``dst`` keeping tensors ``blk.0`` .. ``blk.{layers-1}`` and every
    non-layer tensor. Returns ``(original block count, bytes written)``."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch_field = reader.fields.get(gguf.Keys.General.ARCHITECTURE)
    if arch_field is None:
        raise SystemExit(f"{src}: no general.architecture field")
    arch = arch_field.contents()
    count_key = f"{arch}.block_count"
    if count_key not in reader.fields:
        raise SystemExit(f"{src}: no {count_key} field")
    total = int(reader.fields[count_key].contents())
    if not 1 <= layers <= total:
        raise SystemExit(f"--layers {layers}: the model has {total} layers")

    writer = gguf.GGUFWriter(str(dst), arch=arch, endianess=reader.endianess)
    alignment = reader.fields.get(gguf.Keys.General.ALIGNMENT)
    if alignment is not None:
        writer.data_alignment = int(alignment.contents())
    for field in reader.fields.values():
        # general.architecture and the virtual GGUF.* fields are written by GGUFWriter itself.
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        value = layers if field.name == count_key else field.contents()
        writer.add_key_value(field.name, value, val_type, sub_type=sub_type)

    layer_re = re.compile(r"^blk\.(\d+)\.")
    kept = [t for t in reader.tensors if not (m := layer_re.match(t.name)) or int(m.group(1)) < layers]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return total, dst.stat().st_size


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--layers", type=int, required=True, help="layers to keep (the first N)")
    args = ap.parse_args(argv)
    total, size = truncate(args.src, args.dst, args.layers)
    print(f"{args.dst}: first {args.layers} of {total} layers, {size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
