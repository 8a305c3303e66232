"""The package's layers (docs/design.md) as import-linter contracts (pyproject.toml): they hold
on the package, and a planted upward import or a planted import cycle breaks them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT_IMPORTS), "--config", str(root / "pyproject.toml"),
                           "--no-cache"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    for name in ("changecap_jax", "data_prep", "tools", "benchmarks"):
        shutil.copytree(REPO / name, root / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


def _plant(path: Path, line: str) -> None:
    path.write_text(path.read_text() + f"\n{line}\n")


def test_the_package_keeps_its_layers():
    done = _lint(REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "0 broken" in done.stdout


def test_an_upward_import_breaks_the_layers(tmp_path):
    root = _copy(tmp_path)
    _plant(root / "changecap_jax" / "data" / "vocab.py",
           "from changecap_jax.trainers import loop  # noqa: E402,F401")
    done = _lint(root)
    assert done.returncode != 0
    assert "layers, top to bottom: main > commands" in done.stdout and "BROKEN" in done.stdout
    assert "changecap_jax.data.vocab -> changecap_jax.trainers.loop" in done.stdout


def test_an_import_cycle_in_a_folder_breaks_its_contract(tmp_path):
    root = _copy(tmp_path)
    # models/dirl.py imports models/dropout.py; the reverse closes a cycle inside models/.
    _plant(root / "changecap_jax" / "models" / "dropout.py",
           "from changecap_jax.models import dirl  # noqa: E402,F401")
    done = _lint(root)
    assert done.returncode != 0
    assert "no import cycles between the modules of a folder" in done.stdout
    assert "layers, top to bottom: main > commands" in done.stdout  # the layers still hold
