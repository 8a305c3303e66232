"""Files written atomically, and JSON read with errors that name the file."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def atomic_write(
    path: str | os.PathLike, write: Callable[[IO], None], binary: bool = False
) -> None:
    """Calls ``write(file)`` on a temp file in the same directory, then ``os.replace``: a
    crash never leaves a half-written ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        mode = {"mode": "wb"} if binary else {"mode": "w", "encoding": "utf-8"}
        with os.fdopen(fd, **mode) as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        try:
            os.remove(tmp_name)
        except FileNotFoundError:
            pass
        raise


def write_json_atomic(path: str | os.PathLike, obj: Any, indent: int | None = None) -> None:
    """JSON through :func:`atomic_write`."""
    atomic_write(path, lambda fh: json.dump(obj, fh, indent=indent))


def read_json(path: str | os.PathLike, what: str) -> Any:
    """Reads a JSON file; a missing file or bad JSON raises naming ``what`` and the path."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what} {path} does not exist")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path} is not valid JSON: {e}") from e
