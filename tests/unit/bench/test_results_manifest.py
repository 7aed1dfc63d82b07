"""bench/results holds only records listed in its MANIFEST.md, the manifest names only files that
exist, and the docs point only at records that exist (and at nothing outside the repository)."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "bench" / "results"
MANIFEST = RESULTS / "MANIFEST.md"
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]

# a path under bench/results as the docs write it: the name runs to the first character that
# cannot be part of a file name here (a backtick, space, comma, parenthesis, ...); `*` marks a glob
_DOC_PATH = re.compile(r"bench/results/([A-Za-z0-9_.*\-]+)")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def manifest_files(path: Path = MANIFEST) -> list[str]:
    """The `file` column of MANIFEST.md's table, backticks removed, in order."""
    rows = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.lstrip().startswith("|")]
    assert rows, "MANIFEST.md has no table"
    header = [c.lower() for c in _cells(rows[0])]
    assert "file" in header, f"MANIFEST.md's table has no `file` column: {header}"
    col = header.index("file")
    names = []
    for ln in rows[1:]:
        cells = _cells(ln)
        if all(set(c) <= set("-: ") for c in cells):  # the |---|---| separator
            continue
        assert len(cells) == len(header), f"row has {len(cells)} cells, header {len(header)}: {ln[:120]}"
        names.append(cells[col].strip("`").strip())
    return names


def result_files() -> set[str]:
    return {p.name for p in RESULTS.iterdir() if p.is_file() and p.name != MANIFEST.name}


def doc_paths() -> list[tuple[str, str]]:
    """(doc, name) for every bench/results/<name> a doc mentions; trailing sentence dots dropped."""
    out = []
    for doc in DOCS:
        for m in _DOC_PATH.finditer(doc.read_text(encoding="utf-8")):
            name = m.group(1).rstrip(".")
            if name:
                out.append((doc.relative_to(ROOT).as_posix(), name))
    return out


def test_manifest_parser_reads_a_table(tmp_path):
    # the checks below are only as good as the parser: it reads the file column and skips the rule
    fake = tmp_path / "MANIFEST.md"
    fake.write_text("text\n\n| figure | file | sha |\n| --- | --- | --- |\n| a | `x.jsonl` | 1 |\n| b | y.log | 2 |\n")
    assert manifest_files(fake) == ["x.jsonl", "y.log"]


def test_every_record_is_in_the_manifest():
    listed = set(manifest_files())
    assert sorted(result_files() - listed) == []


def test_every_manifest_row_names_an_existing_file_once():
    names = manifest_files()
    assert sorted(n for n in set(names) if names.count(n) > 1) == []
    assert sorted(n for n in names if not (RESULTS / n).is_file()) == []
    assert MANIFEST.name not in names


def test_docs_point_only_at_existing_records():
    files = result_files() | {MANIFEST.name}
    missing = []
    for doc, name in doc_paths():
        if "*" in name:
            if not fnmatch.filter(files, name):
                missing.append(f"{doc}: bench/results/{name} (matches nothing)")
        elif name not in files:
            missing.append(f"{doc}: bench/results/{name}")
    assert missing == []


def test_doc_path_pattern_finds_paths_as_the_docs_write_them():
    text = ("Raw: `bench/results/a-h100-1.jsonl`; see bench/results/b.png. "
            "(`bench/results/c-cpu-2.jsonl`, bench/results/d-*.jsonl)")
    assert [m.group(1).rstrip(".") for m in _DOC_PATH.finditer(text)] == [
        "a-h100-1.jsonl", "b.png", "c-cpu-2.jsonl", "d-*.jsonl"]


# a Markdown file a doc names (`docs/x.md`, `ops.md`, `../notes/y.md`): it must be one of the repository's
_MD_REF = re.compile(r"(?<![\w/.-])((?:\.\./|[\w-]+/)*[\w.-]+\.md)\b")


def outside_citations(doc: Path) -> list[str]:
    """Lines of `doc` that point outside the repository: a path climbing out of it (`../`) or a
    Markdown file that is neither beside the doc nor at the repository's root."""
    bad = []
    for i, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
        refs = [m.group(1) for m in _MD_REF.finditer(line)]
        if "../" in line or any(not ((doc.parent / r).exists() or (ROOT / r).exists()) for r in refs):
            bad.append(f"{doc.name}:{i}: {line.strip()[:100]}")
    return bad


def test_docs_cite_nothing_outside_the_repository():
    assert [b for doc in DOCS for b in outside_citations(doc)] == []


def test_an_outside_citation_is_found(tmp_path):
    doc = tmp_path / "a.md"
    doc.write_text("fine: docs/architecture.md and a.md\nsee ../notes/plan.md\nas NOTES.md says\n")
    assert [b.split(":")[1] for b in outside_citations(doc)] == ["2", "3"]
