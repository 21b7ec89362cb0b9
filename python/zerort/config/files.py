"""Config files: read once with limits (a regular file of at most MAX_FILE_BYTES), as JSON
whose integer literals of any length are read (Note [bounded values] in zerort.config),
with a key given twice named.
"""
import json
import os
import stat

from zerort.errors import ConfigError
from zerort.file_types import file_kind

from zerort.config.reader import (MAX_DEPTH, MAX_FILE_BYTES, MAX_INT_DIGITS, LongInteger, _depth_problem, _key_name,
                                  _kind, at_most)


def read_config_file(path, what="config file"):
    """The bytes of a config file (what: how messages name it), read once with limits: a
    regular file (links followed) of at most MAX_FILE_BYTES. Anything else (a directory,
    FIFO, device such as a link to /dev/zero, or a bigger file) is a ConfigError naming
    the path; nothing is read from it, and opening never blocks (O_NONBLOCK)."""
    name = os.fspath(path)
    real = os.path.realpath(name)
    via = f" (a link to {real!r})" if os.path.islink(name) else ""
    limit = f"a regular file of at most {MAX_FILE_BYTES >> 20} MiB (a config is a few KB)"
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError([f"{what} {name!r}{via}: {e.strerror}"]) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ConfigError([f"{what} {name!r}{via}: {file_kind(st.st_mode)}, not a regular file; allowed: {limit}: "
                           "give the path of the JSON file itself"])
    with os.fdopen(fd, "rb") as f:
        raw = f.read(MAX_FILE_BYTES + 1) if st.st_size <= MAX_FILE_BYTES else b""
    if st.st_size > MAX_FILE_BYTES or len(raw) > MAX_FILE_BYTES:
        raise ConfigError([f"{what} {name!r}{via}: {max(st.st_size, len(raw))} bytes, more than "
                           f"{MAX_FILE_BYTES >> 20} MiB; allowed: {limit}: is it the right file?"])
    return raw


def _json_int(text):
    """An int, or a LongInteger for a literal past MAX_INT_DIGITS digits (Note [bounded values])."""
    return LongInteger(text) if len(text) > MAX_INT_DIGITS else int(text)


def read_json(path):
    """(the dict in a JSON file, its problems): a key given twice in one object is a
    problem (JSON would silently keep the last); a file read_config_file refuses, bad JSON
    or a non-object raises ConfigError naming the file."""
    name = os.fspath(path)
    twice = []

    def pairs(items):
        seen = {}
        for k, v in items:
            if k in seen:
                twice.append(k)
            seen[k] = v
        return seen

    raw = read_config_file(path)
    try:
        config = json.loads(raw.decode("utf-8"), object_pairs_hook=pairs, parse_int=_json_int)
    except UnicodeDecodeError as e:
        raise ConfigError([f"config file {name!r}: not UTF-8 text (byte {e.start}); save it as UTF-8 JSON"]) from None
    except json.JSONDecodeError as e:
        raise ConfigError([f"config file {name!r}: not valid JSON ({e})"]) from None
    except RecursionError:  # the JSON parser's own limit, near 1000 levels
        raise ConfigError([f"config file {name!r}: nested too deep for the JSON parser; allowed: at most {MAX_DEPTH} "
                           "levels of objects and lists (a zerort or DeepSpeed config needs 4)"]) from None
    deep = _depth_problem(config, f"config file {name!r}")
    if deep:
        raise ConfigError([deep])
    if not isinstance(config, dict):
        raise ConfigError([f"config file {name!r}: got {_kind(config)}; allowed: a JSON object of keys"])
    line = lambda k: f"{_key_name(k)}: given twice in one object of config file {name!r}; allowed: once (JSON keeps " \
                     "the last)"
    return config, at_most(twice, line, "keys given twice")


def read_config(path):
    """The dict in a JSON config file; a problem of the file itself (read_json's, a key
    given twice included) raises ConfigError."""
    config, problems = read_json(path)
    if problems:
        raise ConfigError(problems)
    return config
