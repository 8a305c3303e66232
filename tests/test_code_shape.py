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


MAX_FUNCTION_LINES = 60


def _long_functions(root: Path, limit: int) -> list[str]:
    import ast

    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({length})")
    return found


def test_no_library_function_is_longer_than_a_screen(tmp_path):
    # Statements and branches leave room for a long function of long calls; this counts lines.
    planted = tmp_path / "pkg"
    planted.mkdir()
    (planted / "m.py").write_text("def long():\n" + "    x = 1\n" * 61 + "\n\ndef short():\n"
                                  "    pass\n")
    assert [f.split(" ")[1] for f in _long_functions(planted, MAX_FUNCTION_LINES)] == ["long"]
    for package in ("changecap_jax", "data_prep"):
        assert _long_functions(ROOT / package, MAX_FUNCTION_LINES) == [], package
