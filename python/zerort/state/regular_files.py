"""Opening a checkpoint's files: only regular files (links followed), and a FIFO never, so
a load never hangs on one; a symlink loop or a dangling link is named as such. Used by
zerort.state.metadata and zerort.state.loop_state (which metadata's validation calls)."""
import errno
import os
import reprlib
import stat

from zerort.errors import CheckpointError
from zerort.file_types import file_kind

_short = reprlib.Repr()
_short.maxstring, _short.maxother, _short.maxlist, _short.maxdict, _short.maxlong = 60, 60, 6, 4, 40


def stat_or_none(path):
    """os.stat(path) (links followed); None when nothing is there; a CheckpointError for a
    symlink loop or a dangling link, which are not 'missing'."""
    try:
        return os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError(f"{path} is a symlink loop: following its links never reaches a file") from None
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            if os.path.islink(path):
                raise CheckpointError(f"{path} is a symlink to {_short.repr(os.readlink(path))}, which does not "
                                      "exist") from None
            return None
        raise CheckpointError(f"{path}: {e.strerror}") from None


def open_regular(path, missing):
    """path opened for reading as an unbuffered file object, if it is a regular file (links
    followed); else a CheckpointError: `missing` when nothing is there, otherwise what is
    there. A FIFO is never opened: its type is checked first, and the open itself does not
    block (O_NONBLOCK) should one be swapped in between; the opened file is checked again."""
    st = stat_or_none(path)
    if st is None:
        raise CheckpointError(missing)
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path} is {file_kind(st.st_mode)}, not a regular file: a checkpoint holds only "
                              "regular files here")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be opened ({e.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CheckpointError(f"{path} is {file_kind(st.st_mode)}, not a regular file")
    return os.fdopen(fd, "rb", buffering=0)


def check_directory(path, missing):
    """A CheckpointError unless path is a directory (links followed)."""
    st = stat_or_none(path)
    if st is None:
        raise CheckpointError(missing)
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"{path} is {file_kind(st.st_mode)}, not a directory")
