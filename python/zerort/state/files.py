"""The files of a checkpoint on disk (zerort.state.checkpoint saves and loads through these):

- write_new_file: a new file, never through an existing file or link, fsync'ed, removed on
  any error; a full disk is a CheckpointError naming the file, the bytes it needs and the
  bytes free. atomic_write: a file written whole or not at all (a temporary name, renamed).
- write_shard / read_shard: one rank's shard file with the SHA-256 of its tensors and
  metadata (shard_digest), read back memory-mapped and checked against meta.json
  (zerort.state.metadata).
- ShardReader: saved shards read one parameter's elements at a time, keeping one shard
  mapped.
"""
import ctypes
import errno
import hashlib
import json
import os

import torch

from zerort.state.metadata import FORMAT, CheckpointError, check_shard_contents, check_shard_payload, open_regular


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2  # linux/fs.h
_renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)  # glibc 2.28 on
if _renameat2 is not None:
    _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]


def exchange(a, b):
    """Swaps the names a and b in one atomic step (renameat2 with RENAME_EXCHANGE): each then
    names what the other did, links included (never their targets). False where the kernel
    or the file system cannot (no renameat2, NFS and other file systems without it)."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)


def _size(n):
    return f"{n} bytes ({n / 2 ** 20:.1f} MiB)"


class Sink:
    """The file object a writer writes into. It keeps the first OSError, since torch.save
    reports a failed write as a RuntimeError without errno, and counts the bytes."""

    def __init__(self, f):
        self.f, self.written, self.error = f, 0, None

    def write(self, data):
        try:
            n = self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise
        self.written += n
        return n

    def flush(self):
        try:
            self.f.flush()
        except OSError as e:
            self.error = self.error or e
            raise


def write_new_file(path, write, needed, shown=None):
    """Creates path (never through an existing file or link: O_EXCL | O_NOFOLLOW), lets
    write(f) fill it, fsyncs it. On any error the file is removed; a full disk or another
    OSError is a CheckpointError naming `shown` (the file the user asked for; default path)
    and, for a full disk, the bytes it needs (`needed`, an estimate) and the bytes free."""
    shown = shown or path
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as e:
        raise write_error(e, shown, path, needed) from None
    sink = Sink(os.fdopen(fd, "wb"))
    try:
        try:
            write(sink)
            sink.flush()
            os.fsync(fd)
        finally:
            sink.f.close()  # may raise too (a delayed write error)
    except BaseException as e:
        remove(path)
        error = sink.error or (e if isinstance(e, OSError) else None)
        if error is None or not isinstance(e, Exception):
            raise
        raise write_error(error, shown, path, needed) from None


def write_error(e, shown, path, needed):
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            st = os.statvfs(os.path.dirname(path) or ".")
            free = f"{_size(st.f_bavail * st.f_frsize)} are free there"
        except OSError:
            free = "the free space is unknown"
        what = "no space left on device" if e.errno == errno.ENOSPC else "disk quota exceeded"
        return CheckpointError(f"{what} while writing {shown}: it needs about {_size(needed)} and {free}; nothing "
                               "of this save is kept (its temporary files are removed) and an earlier checkpoint is "
                               "untouched: free some space or save elsewhere")
    return CheckpointError(f"cannot write {shown}: {e.strerror or e}")


def mapped_scratch(path, numel, windows):
    """A float32 tensor of numel elements backed by a new file at path (O_EXCL, no links
    followed), filled from `windows` (float32 tensors, in order) and mapped shared: its pages
    live in the page cache, which the kernel writes back and drops under pressure, so a
    reader of it (torch.save) never needs the whole array in the process's own memory. The
    file is unlinked before this returns (the mapping keeps its pages) and on any error; a
    full disk is a CheckpointError with the bytes needed and free."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as e:
        raise write_error(e, path, path, 4 * numel) from None
    try:
        with os.fdopen(fd, "wb") as f:
            for w in windows:
                f.write(memoryview(w.contiguous().numpy()).cast("B"))
        return torch.from_file(path, shared=True, size=numel, dtype=torch.float32) if numel else torch.empty(0)
    except OSError as e:
        raise write_error(e, path, path, 4 * numel) from None
    finally:
        remove(path)


def remove(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def atomic_write(path, write, needed=1 << 16, tmp_id="tmp"):
    """path written whole or not at all: a hidden temporary file next to it, renamed over it
    (a link at path is replaced, never followed)."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.{tmp_id}.{os.getpid()}")
    write_new_file(tmp, write, needed, shown=path)
    try:
        os.replace(tmp, path)
    except OSError as e:
        remove(tmp)
        raise CheckpointError(f"cannot write {path}: {e.strerror}") from None
    fsync_dir(folder or ".")


def shard_digest(tensors, meta):
    h = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    for k in sorted(tensors):
        t = tensors[k].contiguous()
        h.update(k.encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())  # hashes the (mapped) bytes in place
    return h.hexdigest()


def write_shard(path, tensors, meta):
    """Writes a shard file; returns its SHA-256 (the one meta.json records for it)."""
    digest = shard_digest(tensors, meta)
    payload = {"format": FORMAT, "meta": meta, "tensors": tensors, "sha256": digest}
    needed = sum(t.numel() * t.element_size() + 4096 for t in tensors.values()) + len(json.dumps(meta)) + (1 << 16)
    atomic_write(path, lambda f: torch.save(payload, f), needed, tmp_id=meta.get("save_id", "tmp"))
    return digest


def read_shard(path, rank, meta):
    """(tensors, meta) of rank's shard file, memory-mapped; checks its structure, checksum
    and agreement with the checkpoint's metadata (zerort.state.metadata)."""
    payload = load_payload(path, f"missing shard file {path}: the checkpoint is incomplete or was saved by more "
                                  "ranks than this directory holds")
    check_shard_payload(payload, path)
    try:
        digest = shard_digest(payload["tensors"], payload["meta"])
    except (TypeError, ValueError) as e:  # metadata that JSON cannot hold
        raise CheckpointError(f"shard file {path} is corrupt: its metadata cannot be hashed ({e})") from None
    if digest != payload["sha256"]:
        raise CheckpointError(f"checksum mismatch in {path}: the file was modified or damaged")
    check_shard_contents(payload, path, rank, meta)
    return payload["tensors"], payload["meta"]


def load_payload(path, missing):
    """torch.load of a regular file, memory-mapped. On Linux it maps the file opened and
    checked here (/proc/self/fd), so nothing swapped in after the check is read."""
    with open_regular(path, missing) as f:
        proc = f"/proc/self/fd/{f.fileno()}"
        try:
            return torch.load(proc if os.path.exists(proc) else path, mmap=True, weights_only=True)
        except Exception as e:  # a truncated zip, or not a torch file at all
            raise CheckpointError(f"shard file {path} is truncated or corrupt ({type(e).__name__}: "
                                  f"{str(e)[:300]})") from None


class ShardReader:
    """Reads saved shards memory-mapped, one parameter's elements at a time, keeping only
    the shard in use mapped (the page cache keeps the others cheap to map again)."""

    def __init__(self, directory, tag, meta):
        self.dir = os.path.join(directory, tag)
        self.meta = meta
        self._rank, self._data = None, None
        self._verified = set()

    def shard(self, rank):
        if self._rank != rank:
            self._rank, self._data = None, None  # unmap the previous shard first
            path = os.path.join(self.dir, self.meta["shards"][rank])
            if rank in self._verified:
                payload = load_payload(path, f"shard file {path} disappeared during the load")
                self._data = (payload["tensors"], payload["meta"])
            else:
                self._data = read_shard(path, rank, self.meta)
                self._verified.add(rank)
            self._rank = rank
        return self._data

    def check_all(self):
        """Every shard present, whole and matching its checksum, before anything changes."""
        for r in range(len(self.meta["shards"])):
            self.shard(r)

    def assemble(self, name, key):
        info = self.meta["params"][name]
        out = torch.empty(info["shape"]).reshape(-1)
        for rank, index, offset, length in info["segments"]:
            out[offset:offset + length] = self.shard(rank)[0][key][index:index + length]
        return out.reshape(info["shape"])
