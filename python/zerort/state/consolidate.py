"""Offline consolidation of a sharded checkpoint into one full FP32 state_dict.

    python -m zerort.state.consolidate CKPT_DIR OUT.pt                  # torch.save format
    python -m zerort.state.consolidate CKPT_DIR OUT.safetensors --safetensors
    python -m zerort.state.consolidate CKPT_DIR OUT.pt --adam           # also exp_avg / exp_avg_sq

Needs no process group. Parameters are assembled one at a time from memory-mapped shards
and streamed to a .safetensors file, so peak memory stays near the largest parameter plus
the shard pages being read. A .pt output is written from that streamed file, memory-mapped.
The original model loads the result with model.load_state_dict(torch.load(OUT)).

OUT is written to a hidden temporary file next to it and renamed at the end, so it is
whole or absent. A missing, read-only or full output folder is a CheckpointError that
names OUT (and for a full disk the bytes needed); nothing is left behind.
"""
import argparse
import json
import os
import struct
import sys

import torch

from zerort.state.files import ShardReader, write_new_file
from zerort.state.metadata import CheckpointError, file_kind, read_meta, stat_or_none


def _progress(i, n, name):
    """A progress line on stderr for long runs: a terminal, or 200+ tensors."""
    if not (sys.stderr.isatty() or n >= 200):
        return
    if i % max(1, n // 20) == 0 or i == n:
        sys.stderr.write(f"\rconsolidating {i}/{n} tensors ({100 * i // n}%) {name[:40]:40s}")
        if i == n:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _shape(reader, pname, key):
    if key.startswith("extra::"):
        return list(reader.shard(0)[0][key].shape)
    return reader.meta["params"][pname]["shape"]


def _tensor(reader, pname, key):
    if key.startswith("extra::"):
        return reader.shard(0)[0][key]  # frozen params are FP32; buffers keep their dtype
    return reader.assemble(pname, key)


_ST_DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


def _dtype(reader, pname, key):
    return reader.shard(0)[0][key].dtype if key.startswith("extra::") else torch.float32


def stream_safetensors(reader, entries, path, shown=None):
    """entries: [(output name, param name, state key)]; writes them one tensor at a time
    into a new file at path (a CheckpointError naming `shown` if that fails)."""
    header, offset = {}, 0
    for out_name, pname, key in entries:
        shape, dtype = _shape(reader, pname, key), _dtype(reader, pname, key)
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        header[out_name] = {"dtype": _ST_DTYPES[dtype], "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)

    def write(f):
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for i, (out_name, pname, key) in enumerate(entries, 1):
            t = _tensor(reader, pname, key).contiguous()
            f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            del t
            _progress(i, len(entries), out_name)

    write_new_file(path, write, 8 + len(blob) + offset, shown=shown)
    return 8 + len(blob) + offset


def _output_folder(out):
    """The folder OUT goes into, checked before any work: it exists, is a folder, and OUT
    is not a directory."""
    folder = os.path.dirname(os.path.abspath(out))
    st = stat_or_none(folder)
    if st is None:
        raise CheckpointError(f"cannot write {out}: its folder {folder} does not exist; create it first")
    if not os.path.isdir(folder):
        raise CheckpointError(f"cannot write {out}: {folder} is {file_kind(st.st_mode)}, not a folder")
    if os.path.isdir(out):
        raise CheckpointError(f"cannot write {out}: it is a directory")
    return folder


def _entries(directory, tag, adam):
    """(reader, [(output name, param name, state key)]) of a checked checkpoint."""
    tag, meta = read_meta(directory, tag)
    reader = ShardReader(directory, tag, meta)
    reader.check_all()
    names = list(meta["params"])
    entries = [(n, n, "master") for n in names]
    entries += [(alias, first, "master") for alias, first in meta.get("aliases", {}).items()]
    entries += [(n, n, f"extra::{n}") for n in meta.get("extras", [])]  # frozen params, buffers
    if adam:
        entries += ([(f"{n}.exp_avg", n, "exp_avg") for n in names]
                    + [(f"{n}.exp_avg_sq", n, "exp_avg_sq") for n in names])
    return reader, entries


def state_dict(directory, tag=None, adam=False):
    """The consolidated state_dict in memory (every tensor whole, FP32 parameters), for
    checkpoints that fit in RAM; consolidate() streams a larger one to a file."""
    reader, entries = _entries(directory, tag, adam)
    return {out_name: _tensor(reader, pname, key).clone() for out_name, pname, key in entries}


def consolidate(directory, out, tag=None, safetensors=False, adam=False):
    folder = _output_folder(out)
    reader, entries = _entries(directory, tag, adam)
    base = os.path.join(folder, f".{os.path.basename(out)}.{os.getpid()}")
    st, pt = base + ".safetensors.tmp", base + ".pt.tmp"  # hidden, next to OUT
    try:
        size = stream_safetensors(reader, entries, st, shown=out)
        if not safetensors:
            from safetensors.torch import load_file

            tensors = load_file(st)  # memory-mapped from the streamed file
            write_new_file(pt, lambda f: torch.save(tensors, f), size + 64 * len(entries) + (1 << 16), shown=out)
            del tensors
        try:
            os.replace(st if safetensors else pt, out)
        except OSError as e:
            raise CheckpointError(f"cannot write {out}: {e.strerror}") from None
    finally:
        for path in (st, pt):
            try:
                os.unlink(path)
            except OSError:  # never made (a read-only folder), or renamed to OUT
                pass
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m zerort.state.consolidate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint_dir")
    ap.add_argument("out")
    ap.add_argument("--tag", help="default: the tag in CKPT_DIR/latest")
    ap.add_argument("--safetensors", action="store_true", help="write .safetensors instead of torch.save")
    ap.add_argument("--adam", action="store_true", help="also write <name>.exp_avg and <name>.exp_avg_sq")
    a = ap.parse_args(argv)
    try:
        consolidate(a.checkpoint_dir, a.out, a.tag, a.safetensors, a.adam)
    except CheckpointError as e:
        sys.stderr.write(f"zerort.state.consolidate: {e}\n")
        return 2
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
