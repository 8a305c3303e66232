"""Files written atomically, and JSON read with errors that name the file.

Temp files and folders are made private by ``tempfile`` (0600 / 0700); the writers here give
them the mode a plain ``open`` / ``mkdir`` would (0666 / 0777 less the umask) before they
become the final file, so results on a shared machine are readable as the user's umask says.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from changecap_jax.errors import UserError


class UnreadableJSONError(UserError, ValueError):
    """A JSON file the project reads (a run's config.json, metrics, captions) that does not
    parse: the message names the file and where the parse failed."""


def current_umask() -> int:
    """The process's umask (read by setting it and restoring it at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def staging_dir(parent: str | os.PathLike, name: str) -> Path:
    """A fresh hidden folder ``parent/.name.XXXX`` to fill and then ``os.replace`` onto
    ``parent/name``, with the mode ``mkdir`` would give it (not mkdtemp's 0700)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=parent))
    os.chmod(tmp, 0o777 & ~current_umask())
    return tmp


def atomic_write(
    path: str | os.PathLike, write: Callable[[IO], None], binary: bool = False
) -> None:
    """Calls ``write(file)`` on a temp file in the same directory, then ``os.replace``: a
    crash never leaves a half-written ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
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
        raise UnreadableJSONError(f"{what} {path} is not valid JSON: {e}") from e
