"""The kind of a file, from its st_mode, for messages: 'a directory', 'a FIFO (named pipe)',
... Both readers of user files use it: the checkpoint's (zerort.state.metadata) and the
config's (zerort.config.read_config_file), each of which opens only regular files.

This module imports nothing of zerort's, so config and state can both import it.
"""
import stat

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISREG, "a regular file"))


def file_kind(mode):
    """'a directory', 'a FIFO (named pipe)', ... for an st_mode."""
    return next((name for test, name in _KINDS if test(mode)), "a special file")
