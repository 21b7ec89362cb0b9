"""Reading and validating checkpoint metadata (meta.json) and shard payloads.

Everything a loader reads from disk goes through one funnel, _Fields, before it is used:
a damaged, truncated, hand-edited or foreign file raises CheckpointError naming the file,
the field and what was expected, never a KeyError/TypeError/IndexError from deep inside
the loader, and never loads wrong values silently. Checked:

- the files themselves: only regular files are opened (a directory, FIFO, socket or device
  in a checkpoint's place is named, and a FIFO is never opened for reading, so a load never
  hangs on one); a symlink loop or a dangling link is named as such.
- a tag (check_tag, the same rule for save and load): a plain file name.
- meta.json: UTF-8 JSON object, format, SHA-256 (64 hex digits, matching), world_size,
  stage, precision, the save id and each shard's SHA-256 (which bind the shards to this
  meta.json), shard file names (plain, one per rank, distinct), every parameter's
  shape, dtypes and segments [rank, index, offset, length]: ranks in range, offsets and
  lengths non-negative, the segments cover the parameter's elements exactly once, and no
  two segments of one rank share shard elements; aliases point at saved parameters; extras
  are distinct names.
- a shard: its payload's structure (before the checksum is computed over it), its rank and
  world size against the metadata, its counters, tensors long enough for every segment
  the metadata places in it, and last that it is the very shard this meta.json was saved
  with: the same save id, and the SHA-256 that meta.json records for it.

Format 1 (before shards were bound to meta.json) is not read: it never left this
repository, so there is nothing to migrate; such a directory is named with its format.
"""
import hashlib
import json
import math
import os
import re
import reprlib
import unicodedata

import torch

from zerort.config.reader import MAX_WORLD
from zerort.errors import CheckpointError  # noqa: F401  (raised here; imported from here by state/)
from zerort.file_types import file_kind  # noqa: F401  (imported from here by state/)
from zerort.layout.shard_map import STATE_KEYS
from zerort.state.loop_state import validate
from zerort.state.regular_files import check_directory, open_regular, stat_or_none  # noqa: F401  (and by state/)

FORMAT = "zerort-checkpoint-2"
STATE_TENSORS = STATE_KEYS  # a shard file holds this rank's state arrays, by their names
MAX_NUMEL = 2 ** 48  # elements in one parameter or shard; more is a damaged number
COUNTERS = {"global_step": 0, "skipped_steps": 0, "micro_steps": 0, "adam_steps": 0, "iteration": 0,
            "last_overflow_iteration": -1, "overflows": 0, "hysteresis_left": 0}  # name: lowest value
COMPUTE_DTYPES = ("bfloat16", "float16", "float32")
MAX_TAG_BYTES = 200  # a tag's hidden save folder ".{tag}.{save id}.link" stays within NAME_MAX (255)
SAVE_ID_DIGITS = 16  # hex digits of a save id (64 random bits)

_short = reprlib.Repr()
_short.maxstring, _short.maxother, _short.maxlist, _short.maxdict, _short.maxlong = 60, 60, 6, 4, 40


def meta_digest(meta):
    """The SHA-256 that meta.json records of itself (without its own sha256 key)."""
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()


_MISSING = object()


class _Fields:
    """The one way a loader reads a field: typed, range-checked, or a CheckpointError that
    names the file, the field and what was expected."""

    def __init__(self, path):
        self.path = path

    def fail(self, field, got, expected):
        shown = "nothing (the field is missing)" if got is _MISSING else _short.repr(got)
        raise CheckpointError(f"{self.path}: field {field}: got {shown}; expected {expected}. The file "
                              "is damaged or was not written by this zerort version: load an earlier checkpoint "
                              "or save this one again")

    def get(self, d, key, field=None):
        field = field or key
        if key not in d:
            self.fail(field, _MISSING, "it to be present")
        return d[key]

    def dict(self, d, key, field=None):
        v = self.get(d, key, field)
        if not isinstance(v, dict):
            self.fail(field or key, v, "an object")
        return v

    def list(self, d, key, field=None):
        v = self.get(d, key, field)
        if not isinstance(v, list):
            self.fail(field or key, v, "a list")
        return v

    def integer(self, v, field, low=0, high=MAX_NUMEL):
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
            self.fail(field, v, f"an integer from {low} to {high}")
        return v

    def text(self, v, field, options=None):
        if not isinstance(v, str) or (options is not None and v not in options):
            self.fail(field, v, "one of " + ", ".join(map(repr, options)) if options else "a string")
        return v

    def hex(self, v, field, digits):
        if not (isinstance(v, str) and re.fullmatch(f"[0-9a-f]{{{digits}}}", v)):
            self.fail(field, v, f"{digits} lowercase hex digits")
        return v

    def name(self, v, field):
        """A plain file name inside the checkpoint directory (no path, not hidden)."""
        if not isinstance(v, str) or not v or "/" in v or "\\" in v or "\0" in v or v.startswith("."):
            self.fail(field, v, "a plain file name inside the checkpoint directory")
        return v


def _tag_problem(tag):
    """Why tag cannot name a checkpoint, or None."""
    if not isinstance(tag, str):
        return f"it is {type(tag).__name__}, not a string"
    if not tag:
        return "it is empty"
    if tag != tag.strip():
        return "it has leading or trailing whitespace"
    bad = next((c for c in tag if unicodedata.category(c) in ("Cc", "Cf", "Cs", "Zl", "Zp")), None)
    if bad is not None:
        return f"it holds the control or invisible character {bad!r}"
    if "/" in tag or "\\" in tag:
        return "it holds a path separator"
    if tag.startswith("."):
        return "it starts with '.' (hidden names are zerort's own temporary folders)"
    if tag == "latest":
        return "'latest' is the file that names the latest tag"
    if len(tag.encode()) > MAX_TAG_BYTES:
        return f"it is {len(tag.encode())} bytes long"
    return None


def check_tag(tag, where):
    """The one rule for a tag, at save and at load: a plain file name of at most 200 bytes,
    without path separators, control or invisible characters, leading or trailing
    whitespace or a leading '.', and not 'latest'."""
    problem = _tag_problem(tag)
    if problem:
        raise CheckpointError(f"{where}: checkpoint tag {_short.repr(tag)} is not a plain name: {problem}. A tag is a "
                              f"file name of at most {MAX_TAG_BYTES} bytes without '/', '\\', control characters, "
                              "leading or trailing whitespace or a leading '.', and not 'latest'")
    return tag


def _read_latest(directory):
    latest = os.path.join(directory, "latest")
    with open_regular(latest, f"{directory} is not a zerort checkpoint directory (no 'latest' file); "
                              "pass tag= to load a specific checkpoint") as f:
        raw = f.read(4096)
    try:
        tag = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise CheckpointError(f"{latest}: not UTF-8 text; it should hold the tag of the latest checkpoint") from None
    tag = tag[:-1] if tag.endswith("\n") else tag  # one line break, as `echo step4 > latest` writes; nothing else
    return check_tag(tag, latest)


def read_meta(directory, tag=None):
    """(tag, metadata) of a checkpoint directory, validated; tag defaults to the one in
    `latest`."""
    check_directory(directory, f"{directory} is missing: there is no checkpoint directory there")
    tag = _read_latest(directory) if tag is None else check_tag(tag, directory)
    folder = os.path.join(directory, tag)
    check_directory(folder, f"checkpoint {folder} is missing: {directory} has no tag {tag!r}")
    path = os.path.join(folder, "meta.json")
    with open_regular(path, f"{path} is missing: {folder} is not a complete checkpoint") as f:
        raw = f.read()
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, a number too long, nesting too deep
        raise CheckpointError(f"{path} is truncated or corrupt ({type(e).__name__}: {str(e)[:200]})") from None
    return tag, validate_meta(meta, path)


def validate_meta(meta, path):
    """meta (parsed meta.json) checked field by field; returns it without its sha256."""
    f = _Fields(path)
    if not isinstance(meta, dict):
        f.fail("(top level)", meta, "a JSON object")
    meta = dict(meta)
    digest = meta.pop("sha256", None)
    if meta.get("format") == "zerort-checkpoint-1":
        raise CheckpointError(f"{path} is in format 'zerort-checkpoint-1', which did not bind its shards to "
                              f"meta.json; this zerort reads only {FORMAT!r}: save the checkpoint again")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not zerort checkpoint metadata (format {_short.repr(meta.get('format'))}, "
                              f"expected {FORMAT!r})")
    f.hex(digest, "sha256", 64)
    try:
        actual = meta_digest(meta)
    except ValueError as e:  # numbers too large to print
        f.fail("(contents)", str(e)[:80], "JSON that can be hashed")
    if digest != actual:
        raise CheckpointError(f"checksum mismatch in {path}: the file was modified or damaged")
    world = f.integer(f.get(meta, "world_size"), "world_size", 1, MAX_WORLD)
    f.integer(f.get(meta, "stage"), "stage", 0, 3)
    f.text(f.get(meta, "precision"), "precision", ("bf16", "fp16", "fp32"))
    f.dict(meta, "config")
    shards = f.list(meta, "shards")
    if len(shards) != world:
        f.fail("shards", shards, f"{world} file names, one per rank of world_size {world}")
    for r, name in enumerate(shards):
        f.name(name, f"shards[{r}]")
    if len(set(shards)) != len(shards):
        f.fail("shards", shards, "distinct file names")
    f.hex(f.get(meta, "save_id"), "save_id", SAVE_ID_DIGITS)
    digests = f.list(meta, "shard_sha256")
    if len(digests) != world:
        f.fail("shard_sha256", digests, f"{world} SHA-256 digests, one per shard")
    for r, d in enumerate(digests):
        f.hex(d, f"shard_sha256[{r}]", 64)
    params = f.dict(meta, "params")
    used = [[] for _ in range(world)]  # per rank: (index, end, parameter)
    for name, info in params.items():
        _check_param(f, name, info, world, used)
    for r, runs in enumerate(used):
        runs.sort()
        for (a, a_end, a_name), (b, _, b_name) in zip(runs, runs[1:]):
            if b < a_end:
                f.fail(f"params[{b_name!r}].segments", f"rank {r} shard elements from {b}",
                       f"no overlap with {a_name!r}, which holds rank {r}'s elements {a} to {a_end - 1}")
    aliases = f.dict(meta, "aliases")
    for alias, target in aliases.items():
        if alias in params or target not in params:
            f.fail(f"aliases[{alias!r}]", target, "the name of a saved parameter, for a name that is not one itself")
    extras = f.list(meta, "extras")
    for i, name in enumerate(extras):
        f.text(name, f"extras[{i}]")
        if name in params or name in aliases:
            f.fail(f"extras[{i}]", name, "a name that is not also a parameter or an alias")
    if len(set(extras)) != len(extras):
        f.fail("extras", extras, "distinct names")
    validate(f, meta)  # the param groups and engine_state.pt (zerort.state.loop_state)
    return meta


def _check_param(f, name, info, world, used):
    field = f"params[{name!r}]"
    if not name:
        f.fail("params", name, "non-empty parameter names")
    if not isinstance(info, dict):
        f.fail(field, info, "an object with shape, dtype, compute_dtype and segments")
    shape = f.list(info, "shape", f"{field}.shape")
    numel = 1
    for i, d in enumerate(shape):
        numel *= f.integer(d, f"{field}.shape[{i}]")
    if numel > MAX_NUMEL or len(shape) > 16:
        f.fail(f"{field}.shape", shape, f"at most 16 dimensions and {MAX_NUMEL} elements")
    f.text(f.get(info, "dtype", f"{field}.dtype"), f"{field}.dtype", ("float32",))
    f.text(f.get(info, "compute_dtype", f"{field}.compute_dtype"), f"{field}.compute_dtype", COMPUTE_DTYPES)
    segments = f.list(info, "segments", f"{field}.segments")
    spans = []
    for i, seg in enumerate(segments):
        sf = f"{field}.segments[{i}]"
        if not isinstance(seg, list) or len(seg) != 4:
            f.fail(sf, seg, "[rank, shard index, parameter offset, length]")
        rank = f.integer(seg[0], f"{sf}[0] (rank)", 0, world - 1)
        index = f.integer(seg[1], f"{sf}[1] (shard index)")
        offset = f.integer(seg[2], f"{sf}[2] (parameter offset)")
        length = f.integer(seg[3], f"{sf}[3] (length)", 1)
        spans.append((offset, offset + length, i))
        used[rank].append((index, index + length, name))
    spans.sort()
    covered = 0
    for offset, end, i in spans:
        if offset != covered:
            what = ("overlaps the segment before it" if offset < covered
                    else f"leaves elements {covered} to {offset - 1} in no segment")
            f.fail(f"{field}.segments[{i}]", segments[i], f"segments that cover the {numel} elements of shape {shape} "
                   f"exactly once (this one starts at {offset} and {what})")
        covered = end
    if covered != numel:
        f.fail(f"{field}.segments", segments, f"segments covering exactly the {numel} elements of shape {shape} "
               f"(they cover {covered})")


def check_shard_payload(payload, path):
    """The structure of a loaded shard file, before its checksum is computed over it."""
    f = _Fields(path)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a zerort checkpoint shard")
    tensors = f.dict(payload, "tensors")
    for k, t in tensors.items():
        if not isinstance(k, str) or not isinstance(t, torch.Tensor):
            f.fail(f"tensors[{k!r}]", type(t).__name__, "a tensor under a string name")
    f.dict(payload, "meta")
    digest = f.get(payload, "sha256")
    if not isinstance(digest, str):
        f.fail("sha256", digest, "a hex string")


def check_shard_contents(payload, path, rank, meta):
    """A checksum-verified shard against the metadata: whose it is, its counters, and
    tensors long enough for every segment placed in it."""
    f = _Fields(path)
    smeta, tensors = payload["meta"], payload["tensors"]
    if f.integer(f.get(smeta, "rank", "meta.rank"), "meta.rank", 0, MAX_WORLD) != rank:
        f.fail("meta.rank", smeta["rank"], f"{rank}: this file is listed as rank {rank}'s shard in meta.json "
               "(shard files swapped or copied from another checkpoint?)")
    if f.integer(f.get(smeta, "world_size", "meta.world_size"), "meta.world_size", 1, MAX_WORLD) != meta["world_size"]:
        f.fail("meta.world_size", smeta["world_size"], f"{meta['world_size']}, the world size in meta.json "
               "(a shard from a checkpoint saved by another number of ranks?)")
    state = f.dict(smeta, "state", "meta.state")
    for key, low in COUNTERS.items():
        f.integer(f.get(state, key, f"meta.state.{key}"), f"meta.state.{key}", low, 2 ** 62)
    scale = f.get(state, "scale", "meta.state.scale")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale > 0):
        f.fail("meta.state.scale", scale, "a finite number > 0")
    need = max((seg[1] + seg[3] for info in meta["params"].values() for seg in info["segments"] if seg[0] == rank),
               default=0)
    lengths = set()
    for key in STATE_TENSORS:
        t = f.get(tensors, key, f"tensors[{key!r}]")
        if t.dtype != torch.float32 or t.dim() != 1 or t.numel() < need:
            f.fail(f"tensors[{key!r}]", f"{t.dtype} of shape {list(t.shape)}",
                   f"a 1-D float32 tensor of at least {need} elements (the segments in meta.json reach that far)")
        lengths.add(t.numel())
    if len(lengths) != 1:
        f.fail("tensors", sorted(lengths), "master, exp_avg and exp_avg_sq of one length")
    if rank == 0:  # frozen parameters and buffers: exactly those meta.json lists
        for name in meta["extras"]:
            f.get(tensors, f"extra::{name}", f"tensors['extra::{name}']")
        unlisted = sorted(k for k in tensors if k.startswith("extra::") and k[len("extra::"):] not in meta["extras"])
        if unlisted:
            f.fail(f"tensors[{unlisted[0]!r}]", "a saved tensor that meta.json's extras do not list",
                   "every saved frozen parameter and buffer listed in meta.json's extras")
    # Last: the very shard this meta.json was saved with (a valid shard of another save of
    # the same run passes every check above).
    save_id = f.text(f.get(smeta, "save_id", "meta.save_id"), "meta.save_id")
    if save_id != meta["save_id"]:
        raise CheckpointError(f"{path} belongs to another save: its save id is {_short.repr(save_id)} but meta.json's "
                              f"is {meta['save_id']!r} (a shard copied from another checkpoint, or left by a save "
                              "that did not finish?); put back this checkpoint's own shard or load another checkpoint")
    if payload["sha256"] != meta["shard_sha256"][rank]:
        raise CheckpointError(f"{path}: its SHA-256 {payload['sha256'][:16]}... is not the "
                              f"{meta['shard_sha256'][rank][:16]}... that meta.json records for rank {rank}'s shard: "
                              "the file was replaced or rewritten after the save")
