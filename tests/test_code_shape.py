"""The shape of the library's code: no function longer than 60 lines (issue 23's rule that a
function fits on a screen), counted from its ``def`` line to its last line."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "changecap_jax"
MAX_FUNCTION_LINES = 60


def long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``name (n lines) at line k`` for every function or method of ``path`` over ``limit``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [f"{node.name} ({node.end_lineno - node.lineno + 1} lines) at line {node.lineno}"
            for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > limit]


def test_the_count_finds_a_method_one_line_too_long(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES - 1))
    path = tmp_path / "m.py"
    path.write_text("def short():\n    return 1\n\n\nclass C:\n"
                    f"    def fits(self):\n{body}\n\n"
                    f"    def too_long(self):\n{body}\n        return x0\n")
    assert long_functions(path) == [f"too_long ({MAX_FUNCTION_LINES + 1} lines) at line "
                                    f"{7 + MAX_FUNCTION_LINES}"]


def test_no_function_in_the_library_is_over_60_lines():
    found = [f"{path.relative_to(ROOT)}: {row}"
             for path in sorted(PACKAGE.rglob("*.py")) for row in long_functions(path)]
    assert not found, "functions over 60 lines:\n" + "\n".join(found)
