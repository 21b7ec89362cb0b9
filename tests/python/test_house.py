"""The house rules a newcomer can check (issue 28, "Measured"), each failure naming what breaks it:

- no import circle among zerort's modules: every import of python/zerort (at the top of a
  module or inside a function, absolute or relative) is an edge, and the graph has no cycle;
- no file over 400 lines: Python under python/, tests/ and bench/, C++ (.h, .cpp, .cu)
  anywhere in the repository;
- no private field of an Engine read outside python/zerort/engine/: an attribute `_x` (not a
  dunder) of a variable named engine, eng or e, or of self.engine, in python/zerort.
"""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "python", "zerort")
MAX_LINES = 400
SKIP_DIRS = {".git", ".venv", "build", "third_party", "node_modules", "__pycache__"}
ENGINE_NAMES = {"engine", "eng", "e"}


def _files(top, exts):
    for here, dirs, files in os.walk(top):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith(("build", ".venv")))  # .venv-ds too
        for f in sorted(files):
            if f.endswith(exts):
                yield os.path.join(here, f)


def _module_name(path):
    rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-len(".py")].split(os.sep)
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


def _modules():
    """{module name: (path, parsed tree)} of every module in python/zerort."""
    out = {}
    for path in _files(PACKAGE, (".py",)):
        with open(path, encoding="utf-8") as f:
            out[_module_name(path)] = (path, ast.parse(f.read(), path))
    return out


def _known(modules):
    """The module names an import may name: the Python modules and the compiled zerort._C."""
    return set(modules) | {"zerort._C"}


def _imports(name, path, tree, known):
    """The zerort modules `name` imports, anywhere in it."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                # `import zerort.a.b` runs zerort.a.b (its packages are only parents)
                if a.name in known:
                    found.add(a.name)
                elif parts[0] == "zerort":
                    found.update(".".join(parts[:k]) for k in range(len(parts), 0, -1)
                                 if ".".join(parts[:k]) in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not source.startswith("zerort"):
                continue
            for a in node.names:  # `from pkg import sub`: the submodule when there is one
                sub = f"{source}.{a.name}"
                if sub in known:
                    found.add(sub)
                elif source in known:
                    found.add(source)
    found.discard(name)
    return found


def _cycles(graph):
    """Every strongly connected component of more than one module (Tarjan), each as a
    cycle through it, found by a walk from its first module."""
    index, low, stack, on, comps = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    graph = {v: {w for w in ws if w in graph} for v, ws in graph.items()}  # zerort._C imports nothing here
    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for comp in comps:
        members, start = set(comp), comp[0]
        path, seen, v = [start], {start}, start
        while True:  # follow edges inside the component until a module repeats
            v = next(w for w in sorted(graph[v]) if w in members)
            if v in seen:
                cycles.append(path[path.index(v):] + [v])
                break
            path.append(v)
            seen.add(v)
    return cycles


def test_no_import_cycle():
    modules = _modules()
    known = _known(modules)
    graph = {name: _imports(name, path, tree, known) for name, (path, tree) in modules.items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_import_walk_sees_imports_inside_functions():
    tree = ast.parse("def f():\n    from zerort.engine.engine import alive\n")
    known = {"zerort.engine.engine", "zerort.engine.stage3"}
    assert _imports("zerort.engine.stage3", "x/stage3.py", tree, known) == {"zerort.engine.engine"}
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_file_over_400_lines():
    over = []
    tops = [(os.path.join(ROOT, d), (".py",)) for d in ("python", "tests", "bench")] + [(ROOT, (".h", ".cpp", ".cu"))]
    for top, exts in tops:
        for path in _files(top, exts):
            with open(path, "rb") as f:
                n = f.read().count(b"\n")
            if n > MAX_LINES:
                over.append(f"{os.path.relpath(path, ROOT)} ({n} lines)")
    assert not over, f"files over {MAX_LINES} lines: " + ", ".join(sorted(set(over)))


def _engine_private_reads(tree):
    """(line, text) of every `engine._x` (engine, eng, e or self.engine) in the tree."""
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        v = node.value
        if isinstance(v, ast.Name) and v.id in ENGINE_NAMES:
            out.append((node.lineno, f"{v.id}.{node.attr}"))
        elif isinstance(v, ast.Attribute) and v.attr == "engine" and isinstance(v.value, ast.Name) \
                and v.value.id == "self":
            out.append((node.lineno, f"self.engine.{node.attr}"))
    return out


def test_no_private_engine_field_read_outside_the_engine():
    inside = os.path.join(PACKAGE, "engine") + os.sep
    found = []
    for name, (path, tree) in _modules().items():
        if path.startswith(inside):
            continue
        found += [f"{os.path.relpath(path, ROOT)}:{line}: {text}" for line, text in _engine_private_reads(tree)]
    assert not found, "private Engine fields read outside python/zerort/engine/: " + ", ".join(found)


def test_the_private_read_check_finds_them():
    tree = ast.parse("x = engine._impl\ny = self.engine._names\nz = engine.comm._c\nw = e.__class__\n")
    assert [t for _, t in _engine_private_reads(tree)] == ["engine._impl", "self.engine._names"]
