"""The project cites its own design: every "DESIGN.md" in code and docs is docs/DESIGN.md, at a section that exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ["layers", "models", "recipes", "data", "benchmarks", "tests", "README.md", "BENCHMARKS.md", "Makefile"]


def cited_files():
    for name in SOURCES:
        path = ROOT / name
        files = [path] if path.is_file() else sorted(path.rglob("*.py"))
        for file in files:
            if file.resolve() != Path(__file__).resolve():
                yield file, " ".join(file.read_text().split())   # citations may wrap across lines


def test_design_doc_exists_with_numbered_sections():
    headings = re.findall(r"^## (\d+)\. ", (ROOT / "docs" / "DESIGN.md").read_text(), flags=re.M)
    assert headings == [str(i) for i in range(1, len(headings) + 1)] and len(headings) >= 10


def test_every_citation_names_docs_design_and_an_existing_section():
    sections = set(re.findall(r"^## (\d+)\. ", (ROOT / "docs" / "DESIGN.md").read_text(), flags=re.M))
    citations = 0
    for file, text in cited_files():
        for match in re.finditer(r"(\S*)DESIGN\.md(?: \(?section (\d+))?", text):
            prefix, section = match.groups()
            assert prefix.endswith("docs/"), f"{file.relative_to(ROOT)} cites {match.group(0)!r}, not docs/DESIGN.md"
            if section is not None:
                citations += 1
                assert section in sections, f"{file.relative_to(ROOT)} cites a missing section: {match.group(0)!r}"
    assert citations >= 15
