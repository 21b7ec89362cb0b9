"""Every shell command in README.md and docs/*.md runs as shown.

A fenced block tagged ```bash or ```sh holds commands, one a line (a line ending in a
backslash continues); a ```console block holds commands after "$ " and their output on the
other lines. Blocks without such a tag (output, tables, pseudo-code for the user's own
scripts) are not commands. Each command is checked: what it runs exists (a path in the
repository, a program on PATH with the venv's bin/ first, a `make` target of the Makefile,
a `python -m` module that imports), and so do the repository paths it names. The quick ones
are then run from the repository root, as the README tells the user to (the venv's python
on PATH), and must exit with 0. A block preceded by an HTML comment `<!-- slow -->` (or
`<!-- slow: why -->`) is only checked, never run: training runs, benchmarks, builds, and
commands that need something the docs made first.
"""
import functools
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
SHELL_TAGS = {"bash", "sh", "shell"}
# Top-level names of the repository: a word starting with one of these is a path that must exist.
REPO_DIRS = ("bench/", "docs/", "examples/", "python/", "scripts/", "tests/", ".venv/", "cmake/", "runtime/",
             "comm/", "core/", "optim/", "partition/")
OUTPUT_WORDS = {"runs", "ckpt"}  # what commands write (checked by the commands that read them, not here)


def venv_bin():
    own = os.path.join(ROOT, ".venv", "bin")
    return own if os.path.isdir(own) else os.path.dirname(sys.executable)


def env():
    e = dict(os.environ)
    e["PATH"] = venv_bin() + os.pathsep + e.get("PATH", "")
    e.setdefault("OMP_NUM_THREADS", "1")
    return e


def blocks(path):
    """(line, tag, slow, lines) of every fenced block in the file."""
    lines = open(os.path.join(ROOT, path), encoding="utf-8").read().split("\n")
    i, out = 0, []
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        slow = k >= 0 and lines[k].strip().startswith("<!-- slow")
        out.append((i + 1, m.group(1).lower(), slow, lines[i + 1:j]))
        i = j + 1
    return out


def commands(tag, body):
    """The commands of one block, continuation lines joined."""
    out, cur = [], None
    for line in body:
        if tag == "console":
            if cur is None:
                if not line.startswith("$ "):
                    continue  # output
                line = line[2:]
        elif cur is None and (not line.strip() or line.lstrip().startswith("#")):
            continue
        cur = line if cur is None else cur + " " + line.strip()
        if cur.endswith("\\"):
            cur = cur[:-1].rstrip()
            continue
        out.append(cur.strip())
        cur = None
    assert cur is None, f"a command ends in a line continuation: {cur!r}"
    return out


def all_commands():
    out = []
    for path in DOCS:
        for line, tag, slow, body in blocks(path):
            if tag in SHELL_TAGS or tag == "console":
                out += [(path, line, slow, c) for c in commands(tag, body)]
    return out


COMMANDS = all_commands()


def words_of(command):
    """The words of a command line, comments dropped, split at pipes and redirections."""
    words = shlex.split(command, comments=True)
    simple, cur = [], []
    for w in words:
        if w in ("|", "&&", ";", "||"):
            simple.append(cur)
            cur = []
        else:
            cur.append(w)
    simple.append(cur)
    return [s for s in simple if s]


def makefile_targets():
    text = open(os.path.join(ROOT, "Makefile"), encoding="utf-8").read()
    return set(re.findall(r"^([A-Za-z][\w.-]*)\s*:(?!=)", text, re.M))


def check_exists(words, where):
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        words = words[1:]  # VAR=value before the program
    assert words, f"{where}: no program"
    prog = words[0]
    if "/" in prog:
        if not os.path.isabs(prog):
            assert os.path.exists(os.path.join(ROOT, prog)), f"{where}: {prog} does not exist"
    else:
        path = env()["PATH"]
        assert shutil.which(prog, path=path), f"{where}: {prog} is not on PATH"
    if prog == "make":
        targets = makefile_targets()
        for t in words[1:]:
            if not t.startswith("-") and "=" not in t:
                assert t in targets, f"{where}: the Makefile has no target {t!r}"
    modules = [words[i + 1] for i in range(len(words) - 1) if words[i] == "-m"]
    for w in words[1:]:
        if w.startswith(REPO_DIRS) and w.split("/")[0] not in OUTPUT_WORDS:
            assert os.path.exists(os.path.join(ROOT, w)), f"{where}: {w} does not exist"
        elif w.endswith((".py", ".json", ".sh")) and not os.path.isabs(w) and not w.startswith("-"):
            assert os.path.exists(os.path.join(ROOT, w)), f"{where}: {w} does not exist"
    return [m for m in modules if not m.startswith(("pytest", "pip", "venv"))]


def test_the_docs_hold_commands():
    assert len(COMMANDS) >= 20, COMMANDS
    assert any(not slow for _, _, slow, _ in COMMANDS), "no quick command to run"


@functools.lru_cache(maxsize=None)
def import_error(module):
    """'' when the module imports in a fresh interpreter, else its stderr."""
    p = subprocess.run([sys.executable, "-c", f"import importlib; importlib.import_module({module!r})"],
                       cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    return "" if p.returncode == 0 else p.stderr[-2000:] or f"exit status {p.returncode}"


@pytest.mark.parametrize("path,line,slow,command", COMMANDS,
                         ids=[f"{p}:{ln}:{c[:40]}" for p, ln, _, c in COMMANDS])
def test_what_a_command_names_exists(path, line, slow, command):
    for words in words_of(command):
        for module in check_exists(words, f"{path}:{line}: {command!r}"):
            assert not import_error(module), f"{path}:{line}: python -m {module} does not import:\n" \
                                             f"{import_error(module)}"


QUICK = [c for c in COMMANDS if not c[2]]


@pytest.mark.parametrize("path,line,slow,command", QUICK, ids=[f"{p}:{ln}:{c[:40]}" for p, ln, _, c in QUICK])
def test_a_quick_command_runs_as_shown(path, line, slow, command):
    p = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"{path}:{line}: {command!r} exited with {p.returncode}:\n{p.stdout[-2000:]}\n" \
                              f"{p.stderr[-2000:]}"


def anchors(path):
    """GitHub's anchors for the headings of a markdown file."""
    out = set()
    for line in open(path, encoding="utf-8"):
        m = re.match(r"^#+ (.*)", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


@pytest.mark.parametrize("path", DOCS)
def test_every_relative_link_leads_somewhere(path):
    text = open(os.path.join(ROOT, path), encoding="utf-8").read()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(ROOT, os.path.dirname(path), file)) if file else os.path.join(ROOT, path)
        assert os.path.exists(dest), f"{path}: the link {target!r} leads nowhere"
        if anchor and dest.endswith(".md"):
            assert anchor in anchors(dest), f"{path}: {os.path.relpath(dest, ROOT)} has no heading #{anchor}"
