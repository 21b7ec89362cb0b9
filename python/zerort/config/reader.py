"""How a config's values are read, checked and shown (zerort.config parses with these): the
bounds (Note [bounded values] in zerort.config), show() for messages, the collected
problems and the closest known key, the FP32 rule, and _Reader, which pops keys with
their type and range checks.
"""
import difflib
import math
import reprlib
import struct



MAX_INT = 2 ** 31 - 1  # an integer's bound unless its key says otherwise: Note [bounded values]
MAX_NUMEL = 2 ** 40  # elements of a bucket or threshold: 2 TiB in bf16, more than any device holds
MAX_PREFETCH = 65536  # stage-3 units gathered ahead; a model has fewer units
MAX_WORLD = 2 ** 20  # ranks: shard_size, and a checkpoint's world_size (zerort.state.metadata)
MAX_IO_DEPTH = 32768  # aio.queue_depth: io_uring's most entries in one ring
MAX_PERIOD = 2 ** 62  # steps_per_print: DeepSpeed configs write 1e12 for "never"
MAX_INT_DIGITS = 100  # a longer integer literal in a config file stays a LongInteger
FP32_MAX = 3.4028234663852886e38  # FP32's largest finite number
FP32_TINY = 1.1754943508222875e-38  # FP32's smallest normal number
BOUND_NAMES = {MAX_INT: "2**31 - 1", MAX_NUMEL: "2**40", MAX_PERIOD: "2**62",  # a bound in a message
               FP32_MAX: "3.4028234e+38 (FP32's largest finite number)"}
MAX_FILE_BYTES = 16 << 20  # a config file; a real one is a few KB
MAX_LISTED = 10  # unknown keys (and keys given twice) named in a message; the rest are counted
MAX_AUTOS_LISTED = 64  # "auto" values named: more than the keys HuggingFace fills
MAX_DEPTH = 64  # levels of nested objects and lists; a real config has 4
SHOWN_CHARS = 200  # of a value in a message


class LongInteger:
    """An integer literal of a config file longer than MAX_INT_DIGITS digits (int() takes
    at most 4300): past every bound, so its key's check names it (Note [bounded values])."""

    def __init__(self, text):
        self.text = text

    def __repr__(self):
        return f"{self.text[:20]}...(an integer of {len(self.text.lstrip('-'))} digits)"


def _int_digits(v):
    """The number of decimal digits of the int v (str(v) stops at 4300)."""
    v = abs(v)
    n = int(math.log10(v)) + 1 if v else 1
    return n - 1 if v < 10 ** (n - 1) else n + 1 if v >= 10 ** n else n


class _Repr(reprlib.Repr):
    def repr_int(self, x, level):
        """A long integer as its number of digits (repr() refuses past 4300)."""
        if x.bit_length() <= 3 * SHOWN_CHARS:
            return super().repr_int(x, level)
        return f"{'-' if x < 0 else ''}(an integer of {_int_digits(x)} digits)"


_repr = _Repr()  # walks at most a few levels and items of a value
_repr.maxlevel, _repr.maxstring, _repr.maxother, _repr.maxlong = 4, 80, SHOWN_CHARS, SHOWN_CHARS
_repr.maxlist = _repr.maxtuple = _repr.maxdict = _repr.maxset = _repr.maxfrozenset = 8


def show(v):
    """repr(v) for a message, cut short: a long string to its first 200 characters and
    '...(N chars)', a long list or object to its first items and '(... of N items)', a long
    integer to its number of digits."""
    if isinstance(v, (str, bytes)) and len(v) > SHOWN_CHARS:
        return f"{v[:SHOWN_CHARS]!r}...({len(v)} {'chars' if isinstance(v, str) else 'bytes'})"
    r = _repr.repr(v)
    if isinstance(v, (list, tuple, dict, set, frozenset)) and len(v) > 8:
        r += f" ({_kind(v)} of {len(v)} items)"
    return r if len(r) <= 2 * SHOWN_CHARS else r[:SHOWN_CHARS] + f"...({len(r)} chars shown in part)"


def _key_name(k):
    """A key for a key path, cut short ('…', not '...': a '.' separates sections)."""
    k = k if isinstance(k, str) else _repr.repr(k) if isinstance(k, int) else str(k)
    return k if len(k) <= SHOWN_CHARS else f"{k[:SHOWN_CHARS]}…({len(k)} chars)"


def _depth_problem(config, where):
    """A problem line when config nests deeper than MAX_DEPTH, naming the key it is under
    (its first 4 parts), else None. Walked without recursion; a shared or cyclic part is
    walked once."""
    stack, seen = [(config, 1, ())], {id(config)}
    while stack:
        v, depth, keys = stack.pop()
        if depth > MAX_DEPTH:
            under = f" under key {'.'.join(keys[:4]) + ('…' if len(keys) > 4 else '')!r}" if keys else ""
            return (f"{where}: nested more than {MAX_DEPTH} levels deep{under}; allowed: at most {MAX_DEPTH} levels of "
                    "objects and lists (a zerort or DeepSpeed config needs 4)")
        for k, child in (v.items() if isinstance(v, dict) else enumerate(v)):
            if isinstance(child, (dict, list, tuple)) and id(child) not in seen:
                seen.add(id(child))
                named = keys + (_key_name(k),) if isinstance(v, dict) and len(keys) < 5 else keys
                stack.append((child, depth + 1, named))
    return None


def _kind(v):
    """'a bool', 'an int', 'a str', 'null' ...: the type of a bad value, for messages."""
    if v is None:
        return "null"
    if isinstance(v, LongInteger):
        return "an integer"
    name = type(v).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


class _Problems:
    """The problems found in one config, every key path the parser knows (for the
    closest-key suggestion of an unknown key), and the keys accepted and ignored as DeepSpeed
    ignores them (zerort.config.lenient: Config.ignored)."""

    def __init__(self):
        self.lines, self.known, self.unknown, self.ignored = [], [], [], []

    def finish(self):
        """The list of all problems: the first MAX_LISTED unknown keys last, each with the
        closest known key, and the known keys of its section once (with the section's first
        unknown key)."""
        listed = set()  # sections whose known keys a line names

        def line(item):
            path, value, what = item
            text = f"{path}: {what} (got {show(value)})"
            hint = _closest(path, self.known)
            if hint:
                text += f"; did you mean {hint!r}?"
            section = path.rsplit(".", 1)[0] + "." if "." in path else ""
            if section not in listed:
                listed.add(section)
                here = [k[len(section):] for k in self.known if k.startswith(section) and "." not in k[len(section):]]
                text += f"; known keys{' in ' + section[:-1] if section else ''}: {', '.join(here)}"
            return text

        self.lines += at_most(self.unknown, line, "unknown keys")
        return self.lines


def at_most(items, line, more, limit=MAX_LISTED):
    """line(item) of the first `limit` items, and a last line counting the rest ('and 5
    more unknown keys'): a message stays short however many items there are."""
    lines = [line(x) for x in items[:limit]]
    rest = len(items) - len(lines)
    return lines + ([f"and {rest} more {more} (not listed)"] if rest > 0 else [])


def _closest(path, known):
    """The known key path nearest to an unknown one: by whole path, else by its last part
    (a key put in the wrong section, like a top-level 'lr' for 'optimizer.lr')."""
    match = difflib.get_close_matches(path, known, n=1, cutoff=0.75)
    if match:
        return match[0]
    leaf = path.rsplit(".", 1)[-1]
    leaves = {k.rsplit(".", 1)[-1]: k for k in reversed(known)}
    match = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.75)
    return leaves[match[0]] if match else None


def fp32_problem(v, zero_ok=True):
    """(what FP32 makes of the number v, what is allowed) when v is past FP32's range (inf
    there), or nonzero and below its smallest normal number (0 or subnormal there); None
    when FP32 holds v as a normal number or 0 (Note [bounded values]). zero_ok: whether
    the message offers 0."""
    try:
        v32 = struct.unpack("f", struct.pack("f", float(v)))[0]
    except OverflowError:  # past float64 (a long int), or past FP32
        v32 = math.inf
    sign = "-" if v < 0 else ""
    if math.isinf(v32):
        return "inf", f"{'>=' if v < 0 else '<='} {sign}{BOUND_NAMES[FP32_MAX]}"
    if v != 0 and abs(v32) < FP32_TINY:
        return ("0" if v32 == 0 else "subnormal",
                f"{'0, or ' if zero_ok else ''}{'<=' if v < 0 else '>='} {sign}{FP32_TINY:.8g} (FP32's smallest normal "
                "number)")
    return None


class _Reader:
    """Pops keys from a dict with type/range checks, collecting problems instead of raising."""

    def __init__(self, problems, prefix=""):
        self.problems = problems
        self.prefix = prefix

    def key(self, name):
        return f"{self.prefix}{name}"

    def bad(self, name, value, allowed, wrong_type=False, becomes=""):
        kind = f" ({_kind(value)})" if wrong_type else ""
        self.problems.lines.append(f"{self.key(name)}: got {show(value)}{kind}{becomes}; allowed: {allowed}")

    def _take(self, d, name):
        """(present, value) of d[name]; records name as a known key."""
        self.problems.known.append(self.key(name))
        return (True, d.pop(name)) if name in d else (False, None)

    def fp32(self, name, given, zero_ok=True, example=None):
        """Whether the number given, or each number of the list given, is one the engine
        can compute with in FP32; if not, a problem says what FP32 makes of it (Note
        [bounded values])."""
        items = given if isinstance(given, (list, tuple)) else [given]
        for v in items:
            problem = fp32_problem(v, zero_ok)
            if problem:
                becomes, allowed = problem
                where, each = (f"whose {show(v)}", "each ") if items is given else ("which", "")
                self.bad(name, given, f"{each}{allowed}" + (f", e.g. {example}" if example else ""),
                         becomes=f", {where} is {becomes} in FP32, the dtype the engine computes with")
                return False
        return True

    def number(self, d, name, default, *, integer=False, low=None, high=None, low_open=False, integral_float=False,
               fp32=False, example=None):
        """d[name]: an int (integer) or a finite number, >= low (> low: low_open) and <= high.
        high defaults to MAX_INT for an int, to FP32's largest number for fp32: a value the
        engine computes with in FP32 (Note [bounded values]). integral_float: 5e8 is an int."""
        present, v = self._take(d, name)
        if not present:
            return default
        if high is None:
            high = MAX_INT if integer else FP32_MAX if fp32 else None
        e_g = f" (e.g. {example})" if example else ""
        lo = "" if low is None else (f"> {low}" if low_open else f">= {low}") + e_g
        hi = "" if high is None else f"<= {BOUND_NAMES.get(high) or format(high, 'g')}"
        limits = " and ".join(x for x in (lo, hi) if x)
        given = v
        if integral_float and isinstance(v, float) and math.isfinite(v) and v.is_integer():
            v = int(v)
        if isinstance(v, LongInteger):  # past every bound
            self.bad(name, given, limits)
            return default
        kind = int if integer else (int, float)
        wrong_type = isinstance(v, bool) or not isinstance(v, kind)
        if wrong_type or (isinstance(v, float) and not math.isfinite(v)):
            what = "an integer" if integer else "a finite number"
            self.bad(name, given, f"{what} {limits}".strip(), wrong_type)
            return default
        too_low = low is not None and (v <= low if low_open else v < low)
        if too_low or (high is not None and v > high):
            self.bad(name, given, limits)
            return default
        zero_ok = low is None or low < 0 or low == 0 and not low_open
        if fp32 and not self.fp32(name, v, zero_ok, example):
            return default
        return v

    def choice(self, d, name, default, options):
        present, v = self._take(d, name)
        if not present:
            return default
        if not isinstance(v, str) or v not in options:
            self.bad(name, v, " | ".join(repr(o) for o in options), not isinstance(v, str))
            return default
        return v

    def typed(self, d, name, default, kind, allowed):
        """d[name] if it is a `kind` (default when absent or not)."""
        present, v = self._take(d, name)
        if not present:
            return default
        if not isinstance(v, kind):
            self.bad(name, v, allowed, True)
            return default
        return v

    def boolean(self, d, name, default):
        return self.typed(d, name, default, bool, "true or false (a JSON bool)")

    def text(self, d, name, default):
        return self.typed(d, name, default, str, "a string")

    def names(self, d, name, default):
        """A list of module class names."""
        present, v = self._take(d, name)
        if not present:
            return default
        if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) and x for x in v):
            self.bad(name, v, "a list of module class names, such as [\"LayerNorm\"]", not isinstance(v, (list, tuple)))
            return default
        return tuple(v)

    def section(self, d, name):
        present, v = self._take(d, name)
        if not present:
            return {}
        if not isinstance(v, dict):
            self.bad(name, v,
                     "an object of keys" + (" such as {\"enabled\": true}" if name in ("fp16", "bf16") else ""),
                     True)
            return {}
        return dict(v)

    def child(self, d, name):
        """(section dict, its reader) for a nested section."""
        return self.section(d, name), _Reader(self.problems, f"{self.key(name)}.")

    def leftover(self, d, what="unknown or unsupported key"):
        for k in sorted(d, key=_key_name):
            self.problems.unknown.append((self.key(_key_name(k)), d[k], what))


def _real(v):
    """Whether v is an int or a finite float (not a bool)."""
    return isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and math.isfinite(v)
