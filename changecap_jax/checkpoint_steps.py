"""The checkpoint steps a folder holds, read from its listing alone (no JAX, no orbax).

orbax names each finished step's folder by its number and a step still being written (or one
``checkpoints.py`` moved aside as damaged) otherwise, so the all-digit names are the steps.
Light enough for the command line to check a workdir before the heavy imports.
"""

from __future__ import annotations

import os
from pathlib import Path


def steps(directory: str | os.PathLike) -> list[int]:
    """The step numbers in ``directory`` (e.g. ``<workdir>/checkpoints``), ascending; [] when
    it does not exist."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())


def has_steps(directory: str | os.PathLike) -> bool:
    return bool(steps(directory))


def latest_step(directory: str | os.PathLike) -> int | None:
    found = steps(directory)
    return found[-1] if found else None
