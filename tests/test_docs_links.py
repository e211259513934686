"""The README and the pages under docs/ stay navigable: every relative markdown link resolves to a file or folder
of the repository, and the README stays short."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250
# [text](target) — the target up to a closing parenthesis or a space (a title may follow it).
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")


def _pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _links(page: Path) -> list[tuple[int, str]]:
    """(line number, target) of each markdown link outside fenced code blocks and inline code."""
    found, fenced = [], False
    for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if fenced:
            continue
        found.extend((n, m.group(1)) for m in LINK.finditer(re.sub(r"`[^`]*`", "", line)))
    return found


def _is_relative(target: str) -> bool:
    return not (re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith(("#", "/")))


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    if not page.exists():
        pytest.skip(f"{page.relative_to(ROOT)} is not written yet")
    broken = []
    for n, target in _links(page):
        if not _is_relative(target):
            continue
        path = target.split("#", 1)[0]
        resolved = (page.parent / path).resolve()
        if path and not resolved.exists():
            broken.append(f"{page.relative_to(ROOT)}:{n}: {target}")
    assert not broken, "links to missing files:\n" + "\n".join(broken)


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


def test_link_pattern_finds_links():
    sample = "see [a](docs/x.md#y), [b](https://e.org) and `[c](not/a/link.md)`"
    assert [t for _, t in [(0, m.group(1)) for m in LINK.finditer(re.sub(r"`[^`]*`", "", sample))]] == [
        "docs/x.md#y", "https://e.org"]
