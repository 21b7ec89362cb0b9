"""The README as a newcomer reads it (issue 48): short lines, short table cells, a short
"where it stands" table, reference links that lead somewhere, a quick start that compiles.

- no line over 300 characters, and no table cell over 200 (outside fenced blocks);
- the "Where it stands" table has at most 12 rows;
- every reference link (`[text][ref]`) has a definition, and every definition's file and
  heading exist (test_doc_commands.py checks the inline links);
- the quick start's Python block compiles.
"""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")
MAX_LINE = 300
MAX_CELL = 200
MAX_STATUS_ROWS = 12


def _text():
    with open(README, encoding="utf-8") as f:
        return f.read()


def _prose_lines():
    """(number, line) of every line outside fenced blocks."""
    fenced = False
    for n, line in enumerate(_text().split("\n"), 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield n, line


def _cells(row):
    """The cells of a table row, split at pipes that are not escaped."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]


def _anchors(path):
    """GitHub's anchors for the headings of a markdown file (as test_doc_commands.py)."""
    out = set()
    with open(path, encoding="utf-8") as f:
        for line in f:
            m = re.match(r"^#+ (.*)", line)
            if m:
                out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def test_no_line_over_300_characters():
    over = [f"line {n}: {len(line)} characters" for n, line in enumerate(_text().split("\n"), 1)
            if len(line) > MAX_LINE]
    assert not over, f"README.md lines over {MAX_LINE} characters: " + "; ".join(over)


def test_no_table_cell_over_200_characters():
    over = []
    for n, line in _prose_lines():
        if line.lstrip().startswith("|"):
            over += [f"line {n}: {len(c)} characters: {c[:60]}..." for c in _cells(line) if len(c) > MAX_CELL]
    assert not over, f"README.md table cells over {MAX_CELL} characters: " + "; ".join(over)


def test_the_status_table_is_short():
    lines = _text().split("## Where it stands", 1)[1].split("\n## ", 1)[0].split("\n")
    rows = [line for line in lines if line.startswith("|")][2:]  # less the header and its rule
    assert rows, "README.md: no table under 'Where it stands'"
    assert len(rows) <= MAX_STATUS_ROWS, f"README.md: 'Where it stands' has {len(rows)} rows"


def test_reference_links_lead_somewhere():
    text = _text()
    defined = dict(re.findall(r"^\[([^\]]+)\]: (\S+)\s*$", text, re.M))
    used = set(re.findall(r"\]\[([^\]]+)\]", text))
    assert not used - set(defined), f"README.md: reference links without a definition: {sorted(used - set(defined))}"
    for ref, target in defined.items():
        file, _, anchor = target.partition("#")
        dest = os.path.join(ROOT, file)
        assert os.path.exists(dest), f"README.md: [{ref}] leads to {file}, which does not exist"
        if anchor:
            assert anchor in _anchors(dest), f"README.md: [{ref}]: {file} has no heading #{anchor}"


def test_the_quick_start_compiles():
    section = _text().split("## Quick start", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    compile(code, "README.md quick start", "exec")
