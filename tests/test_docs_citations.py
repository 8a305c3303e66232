"""Citations in code and docs resolve inside the repository (pure Python, no JAX).

Comments and docstrings cite the notes on the official PyTorch code in docs/official/ by
section (a section sign followed by "3.7", a range such as "3.1-3.4", optionally "step K" /
"item K"), by quirk id (S-Q, D-Q, I-Q followed by a number) and by appendix letter, and the
dataset notes as "datasets.md" plus a section. Checked here:

(a) every cited section exists as a numbered heading (and every cited step / item as an entry
    of a numbered list under it): in docs/official/*.md, or in docs/datasets.md for citations
    written right after "datasets.md". Numbers that directly follow "paper", "paper's",
    "supplement" or a paper's year ("AAAI 2022,") are the paper's own sections and are skipped;
(b) every cited quirk id and appendix is defined in docs/official/;
(c) nothing in changecap_jax/, data_prep/, configs/, docs/ or README.md points at the
    ``shared/`` folder outside the repository, and tests/ only reads annotation data there;
(d) every file citing docs/official says so (a header naming docs/official).
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OFFICIAL = ROOT / "docs" / "official"
DATASETS = ROOT / "docs" / "datasets.md"
CODE_DIRS = ("changecap_jax", "data_prep", "configs", "tests")
SELF = Path(__file__).resolve()

NUM = r"\d+(?:\.\d+)*"
# One cited section or range: "§3.7", "§ 3.7", "§3.1-§3.4", "§5.4-5.6", "§2–3".
REF = rf"§\s?({NUM})(?:\s?[-–]\s?§?({NUM}))?"
# A list of citations sharing the prefix of the first: "datasets.md §3, §7.2".
CHAIN = re.compile(rf"{REF}(?:\s*(?:,|/|;|and)\s*{REF})*")
ONE = re.compile(REF)
ENTRY = re.compile(r",?\s+(?:step|item)s?\s+(\d+)(?:\s?[-–]\s?(\d+))?")
DATASETS_PREFIX = re.compile(r"datasets\.md[`'\")\s]*$")
PAPER_PREFIX = re.compile(r"(?:\bpaper(?:'s)?(?: text)?|\bsupplement|\b(?:19|20)\d\d,)\W*$")
QUIRK = re.compile(r"\b([SDI]-Q\d+)\b")
APPENDIX = re.compile(r"\bAppendix ([A-Z])\b(?![.\d])")
HEADING = re.compile(rf"^(#{{1,6}})\s+({NUM})\.?(?:[-–]\d+\.?)?\s", re.M)


def _files(*roots: str) -> list[Path]:
    out: list[Path] = []
    for root in roots:
        path = ROOT / root
        if path.is_file():
            out.append(path)
        else:
            out.extend(p for p in sorted(path.rglob("*")) if p.suffix in (".py", ".md"))
    return [p for p in out if p.resolve() != SELF and "__pycache__" not in p.parts]


@cache
def _sections(pages: tuple[Path, ...]) -> dict[str, str]:
    """Numbered heading -> the text up to the next heading (a page title "# 7-8." and the
    section heading "## 7." both count as §7: their texts are joined)."""
    found: dict[str, str] = {}
    for page in pages:
        text = page.read_text(encoding="utf-8")
        heads = list(re.finditer(r"^#{1,6}\s.*$", text, re.M))
        for i, head in enumerate(heads):
            number = HEADING.match(head.group(0) + " ")
            if number:
                end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
                key = number.group(2)
                found[key] = found.get(key, "") + text[head.end() : end]
    return found


def _official_pages() -> tuple[Path, ...]:
    return tuple(sorted(OFFICIAL.glob("*.md")))


def _citations(path: Path):
    """(line number, namespace, section, list entries or None) for every cited section."""
    default = "datasets" if path == DATASETS else "official"
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for chain in CHAIN.finditer(line):
            before = line[: chain.start()]
            if PAPER_PREFIX.search(before):
                continue
            space = "datasets" if DATASETS_PREFIX.search(before) else default
            for ref in ONE.finditer(chain.group(0)):
                entries = None
                if ref.group(2) is None:
                    entry = ENTRY.match(line, chain.start() + ref.end())
                    if entry:
                        entries = [e for e in entry.groups() if e]
                for number in filter(None, ref.groups()):
                    yield lineno, space, number, entries


def _cited_files() -> list[Path]:
    return _files(*CODE_DIRS, "README.md", "docs")


def test_docs_official_exists():
    names = {p.name for p in _official_pages()}
    assert {"README.md", "common.md", "scorer.md", "dirl.md", "idc_pcl.md",
            "parity_checklist.md"} <= names
    assert DATASETS.exists()


def test_every_cited_section_is_a_heading():
    official = _sections(_official_pages())
    datasets = _sections((DATASETS,))
    missing = []
    count = 0
    for path in _cited_files():
        for lineno, space, number, entries in _citations(path):
            count += 1
            sections = datasets if space == "datasets" else official
            where = f"{path.relative_to(ROOT)}:{lineno}"
            if number not in sections:
                missing.append(f"{where}: {space} §{number}")
                continue
            listed = set(re.findall(r"^\s*(\d+)\.\s", sections[number], re.M))
            missing += [f"{where}: {space} §{number} step/item {e}" for e in entries or ()
                        if e not in listed]
    assert count > 300, f"only {count} section citations found: is the pattern still right?"
    assert not missing, "citations without a heading in docs/:\n" + "\n".join(missing)


def test_every_quirk_and_appendix_is_defined():
    text = "\n".join(p.read_text(encoding="utf-8") for p in _official_pages())
    quirks = set(re.findall(r"^\|\s*([SDI]-Q\d+)\s*\|", text, re.M))
    appendices = set(re.findall(r"^#{1,6}\s+Appendix ([A-Z])\b", text, re.M))
    assert {"S-Q19", "D-Q13", "I-Q16"} <= quirks and appendices == {"A", "B", "C"}
    missing = []
    for path in _cited_files():
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            where = f"{path.relative_to(ROOT)}:{lineno}"
            missing += [f"{where}: {q}" for q in QUIRK.findall(line) if q not in quirks]
            missing += [f"{where}: Appendix {a}" for a in APPENDIX.findall(line)
                        if a not in appendices]
    assert not missing, "undefined quirk ids / appendices:\n" + "\n".join(missing)


@pytest.mark.parametrize("root", ["changecap_jax", "data_prep", "configs", "docs", "README.md",
                                  "tests"])
def test_nothing_points_outside_the_repository(root):
    # tests/ may read the real annotation files kept beside the checkout (conftest SHARED_DATA).
    outside = re.compile(r"shared/(?!data\b)" if root == "tests" else r"shared/")
    bad = []
    for path in _files(root):
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if outside.search(line) or "official_pytorch" in line:
                bad.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert not bad, "references to documents outside the repository:\n" + "\n".join(bad)


def test_files_citing_the_official_notes_name_them():
    bad = []
    for path in _files(*CODE_DIRS):
        text = path.read_text(encoding="utf-8")
        cites = any(space == "official" for _, space, _, _ in _citations(path))
        if (cites or QUIRK.search(text) or APPENDIX.search(text)) and "docs/official" not in text:
            bad.append(str(path.relative_to(ROOT)))
    assert not bad, "files citing docs/official without saying so:\n" + "\n".join(bad)
