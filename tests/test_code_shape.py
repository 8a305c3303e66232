"""The shape of the library's code: a function fits on a screen. ruff enforces it (pyproject.toml:
C901 at most 18 branches, PLR0915 at most 45 statements; CI runs ``ruff check .``); these tests
plant a function over each limit and check that ruff's configuration here reports it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _ruff(tmp_path: Path, source: str) -> str:
    """ruff's report on ``source`` under the project's configuration (its per-file rules for
    tests/ do not match a module outside the checkout)."""
    planted = tmp_path / "planted.py"
    planted.write_text(source)
    return subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
         "--config", str(ROOT / "pyproject.toml"), str(planted)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120).stdout


def test_a_function_with_too_many_statements_is_reported(tmp_path):
    lines = lambda n: "\n".join(f"    print({i})" for i in range(n))
    report = _ruff(tmp_path, f"def fits():\n{lines(40)}\n\n\ndef too_long():\n{lines(50)}\n")
    assert "PLR0915 Too many statements (50 > 45)" in report, report
    assert "fits" not in report and report.count("PLR0915") == 1, report


def test_a_function_with_too_many_branches_is_reported(tmp_path):
    branches = "\n".join(f"    if x == {i}:\n        return {i}" for i in range(18))
    report = _ruff(tmp_path, f"def branchy(x):\n{branches}\n    return -1\n")
    assert "C901 `branchy` is too complex (19 > 18)" in report, report
