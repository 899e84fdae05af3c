"""The repository documents its own methods: no file in it cites a file or folder outside it
(a user's clone has only the repository). The methods live in ``docs/``."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = {".py", ".md", ".toml", ".txt", ".cfg", ".yml", ".yaml", ".json", ".html", ""}
# design notes that live outside the repository
OUTSIDE = re.compile(
    r"\b(?:STATISTICS|THEORY|PAPER|COMPRESSION|TOOLKIT)\.md\b|shared/(?:design|reference)\b"
)
CLIMB = re.compile(r"(?<![\w.])((?:\.\./)+[\w.\-/]*)")  # a relative path that goes up


DOCS = (
    "designs",
    "tasks",
    "statistics",
    "interventions",
    "theory",
    "pretrained",
    "experiments",
    "figures",
    "layout",
)


def _tracked_text_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    files = [ROOT / f for f in out if Path(f).suffix in TEXT or f in ("Makefile",)]
    return [f for f in files if f.is_file() and f.stat().st_size < 2_000_000]


def _outside(path: Path, line: str) -> bool:
    if OUTSIDE.search(line):
        return True
    for target in CLIMB.findall(line):  # ../ is fine while it stays inside the repository
        if not (path.parent / target).resolve().is_relative_to(ROOT):
            return True
    return False


def test_nothing_cites_outside_the_repository():
    hits = []
    for path in _tracked_text_files():
        if path == Path(__file__).resolve():
            continue
        for n, line in enumerate(path.read_text(errors="ignore").splitlines(), 1):
            if _outside(path, line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not hits, "citations outside the repository:\n" + "\n".join(hits)


def test_the_check_catches_what_it_must():
    readme, doc = ROOT / "README.md", ROOT / "docs" / "designs.md"
    climbing = "/".join(("..", "shared", "design", "PAPER.md"))  # spelt out, not cited
    for bad in ("see STATISTICS.md", climbing, "[x](../notes.md)"):
        assert _outside(readme, bad), bad
    assert _outside(doc, "[x](../../elsewhere/y.md)")
    for ok in ("docs/statistics.md", "theory_md", "a shared test set", "wait...", "1../2"):
        assert not _outside(readme, ok), ok
    assert not _outside(doc, "[grid](../phasemech/grid.py)")


def test_docs_exist_and_link_only_inside():
    index = (ROOT / "README.md").read_text()
    for name in DOCS:
        doc = ROOT / "docs" / f"{name}.md"
        assert doc.is_file(), doc
        assert f"docs/{name}.md" in index, f"README does not map docs/{name}.md"
        for target in re.findall(r"\]\(([^)#\s]+)", doc.read_text()):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.name} links to missing {target}"
