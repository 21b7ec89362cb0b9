"""A checkpoint directory's names, for zerort.state.checkpoint: the save lock, which names a
save may replace, how a save's complete hidden folder becomes the tag (a plain directory:
a rename, or an atomic exchange of two names), what the tag named before and may be
removed, and what a load without a tag finds there. The module docstring of
zerort.state.checkpoint gives the rules.
"""
import fcntl
import json
import os
import re
import shutil
import stat

from zerort.state import files
from zerort.state.metadata import FORMAT, SAVE_ID_DIGITS, CheckpointError, check_tag, file_kind

LOCK_NAME = ".zerort-save.lock"  # hidden: no tag can take the name


class SaveLock:
    """Rank 0's exclusive lock on a checkpoint directory for one save (flock on a hidden
    file inside it, which stays: removing a lock file races with its next user)."""

    def __init__(self, directory):
        self.fd = None
        path = os.path.join(directory, LOCK_NAME)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            raise CheckpointError(f"cannot take the save lock {path}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise CheckpointError(f"{directory}: another save is writing into this checkpoint directory right now (it "
                                  f"holds {path}); zerort saves one checkpoint at a time per directory: save after it "
                                  "has finished, or into another directory") from None
        self.fd = fd

    def release(self):
        if self.fd is not None:
            os.close(self.fd)  # releases the flock
            self.fd = None


def _published(path):
    """path is a checkpoint directory that a save published (its meta.json is zerort's)."""
    try:
        with open(os.path.join(path, "meta.json"), "rb") as f:
            return json.loads(f.read(1 << 26)).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def prepare(directory, tag, rank, holder):
    """Every rank: the tag. Rank 0: the directory, the lock, and that `tag` and `latest`
    are names a save may replace (absent, a link, for `tag` a checkpoint directory a save
    published, for `latest` a regular file)."""
    check_tag(tag, f"save_checkpoint into {directory}")
    if rank != 0:
        return
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create the checkpoint directory {directory}: {e.strerror}") from None
    holder.append(SaveLock(directory))
    for name, allowed in ((tag, "a checkpoint an earlier save published, or a link"), ("latest", "a regular file")):
        path = os.path.join(directory, name)
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(mode) or (name == "latest" and stat.S_ISREG(mode)):
            continue
        if name == tag and stat.S_ISDIR(mode) and _published(path):
            continue
        raise CheckpointError(f"{path} is {file_kind(mode)}, not {allowed}: a save replaces only what zerort wrote; "
                              + ("choose another tag" if name == tag else "move it away"))


def drop_previous(directory, tag, previous, mine):
    """After the tag names the new checkpoint: removes what it named before, now at the
    hidden path `previous`: a checkpoint directory an earlier save published, or a link
    (only the link, and the folder an older zerort's link `tag` named: _earlier_folder)."""
    if not os.path.lexists(previous):
        return
    if not os.path.islink(previous):
        shutil.rmtree(previous, ignore_errors=True)  # _prepare: a checkpoint a save published
        return
    named = os.readlink(previous)
    os.unlink(previous)  # first: it must not count as another link naming the folder
    earlier = _earlier_folder(directory, tag, named, mine)
    if earlier:
        shutil.rmtree(earlier, ignore_errors=True)


def _earlier_folder(directory, tag, target, mine):
    """The folder that the link `tag` named before this save, when an earlier save of this
    tag created it (a hidden `.{tag}.{save id}` folder right in the directory: zerort's
    checkpoints were links before they were plain directories) and no other link in the
    directory names it or a file in it; else None (it stays)."""
    if target == mine or not re.fullmatch(rf"\.{re.escape(tag)}\.[0-9a-f]{{{SAVE_ID_DIGITS}}}", target):
        return None
    path = os.path.join(directory, target)
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return None
    except OSError:
        return None
    real = os.path.realpath(path)
    for entry in os.scandir(directory):
        if entry.name != tag and entry.is_symlink():
            other = os.path.realpath(entry.path)
            if other == real or other.startswith(real + os.sep):
                return None
    return path


def switch(work, target):
    """Gives the complete folder `work` the name `target`; returns where what `target` named
    before is now (None when the tag is new). See the module docstring."""
    try:
        if not os.path.lexists(target):
            os.rename(work, target)
            return None
        if files.exchange(work, target):
            return work
        aside = work + ".previous"  # no atomic exchange on this file system: two renames
        os.rename(target, aside)
        try:
            os.rename(work, target)
        except OSError:
            os.rename(aside, target)  # the tag names the previous checkpoint again
            raise
        return aside
    except OSError as e:
        raise CheckpointError(f"cannot give the new checkpoint the name {target}: {e.strerror}") from None


# What a load without a tag finds at the directory, worst last: `latest`; nothing saved there
# yet (no such path, an empty directory, or checkpoint folders without `latest`: DeepSpeed
# loads nothing and returns (None, None), the resume-if-saved pattern); or something that is
# not a checkpoint directory, an error rather than training from scratch.
HAS_LATEST, NOTHING_SAVED, NOT_A_DIRECTORY, NOT_CHECKPOINTS, UNLISTED = range(5)
NOT_A_CHECKPOINT = {NOT_A_DIRECTORY: "this path is not a directory",
                     UNLISTED: "this directory cannot be listed (check its permissions)",
                     NOT_CHECKPOINTS: "this directory holds neither a 'latest' file nor a checkpoint folder (one "
                                       "with a meta.json)"}


def without_latest(directory):
    """What a load without a tag finds at directory: one of the codes above."""
    if os.path.lexists(os.path.join(directory, "latest")):
        return HAS_LATEST
    if not os.path.lexists(directory):
        return NOTHING_SAVED
    if not os.path.isdir(directory):
        return NOT_A_DIRECTORY
    try:
        names = os.listdir(directory)
    except OSError:
        return UNLISTED
    saved = any(os.path.isfile(os.path.join(directory, n, "meta.json")) for n in names)
    return NOTHING_SAVED if saved or not names else NOT_CHECKPOINTS
