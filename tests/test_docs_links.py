"""Relative links in README.md and docs/**/*.md resolve inside the repository (pure Python).

Every Markdown link or image whose target is not a URL must name an existing file or folder,
relative to the page that holds it; a ``#anchor`` into a Markdown page (or into the page
itself) must match one of that page's headings, slugged as GitHub does. Links inside code
blocks and code spans are not links and are skipped.
"""

from __future__ import annotations

import re
from collections import Counter
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
# [text](target) or ![alt](target "title"); text may hold one level of brackets.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)
URL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _strip_code(text: str) -> str:
    """The page without fenced code blocks and code spans (their text is not Markdown)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text lower-cased, punctuation other than
    '-' and '_' removed, each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = re.sub(r"(\*{1,3})(\S.*?)\1", r"\2", text)  # emphasis marks are not text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    """Every heading anchor of a page; repeated headings get -1, -2, ... as on GitHub."""
    seen: Counter[str] = Counter()
    out = set()
    for match in HEADING.finditer(FENCE.sub("", page.read_text(encoding="utf-8"))):
        base = slug(match.group(1))
        out.add(f"{base}-{seen[base]}" if seen[base] else base)
        seen[base] += 1
    return frozenset(out)


def links(page: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(_strip_code(page.read_text(encoding="utf-8")))]


def broken(page: Path) -> list[str]:
    """The page's relative links whose file or anchor does not exist."""
    bad = []
    for target in links(page):
        if not target or URL.match(target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file or folder")
        elif not dest.is_relative_to(ROOT):
            bad.append(f"{target}: outside the repository")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    return bad


def test_slug_matches_github():
    assert slug("Quick start (fresh machine, Python 3.11)") == (
        "quick-start-fresh-machine-python-311")
    assert slug("2.2 Visual features (`scripts/extract_features.py`; SCORER's copy)") == (
        "22-visual-features-scriptsextract_featurespy-scorers-copy")
    assert slug("Workers, threads and prefetch (`config.data`)") == (
        "workers-threads-and-prefetch-configdata")
    assert slug("1–2. Shared conventions") == "12-shared-conventions"


def test_links_are_found_outside_code_only():
    text = "[a](x.md) `[b](no.md)` ![c](img.png \"t\")\n```\n[d](no.md)\n```\n[e [f]](y.md#z)"
    assert [m.group(1) for m in LINK.finditer(_strip_code(text))] == ["x.md", "img.png", "y.md#z"]


def test_readme_links_every_docs_page():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(ROOT / "README.md")
              if not URL.match(t)}
    missing = [p.relative_to(ROOT) for p in sorted((ROOT / "docs").glob("*.md"))
               if p.resolve() not in linked]
    assert not missing, f"docs pages the README's documentation list does not link: {missing}"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    assert links(page) or page.name != "README.md", "the README links to no page?"
    bad = broken(page)
    assert not bad, f"broken links in {page.relative_to(ROOT)}:\n" + "\n".join(bad)
