"""Files written atomically, and JSON read with errors that name the file.

Paths may be local or in a bucket (``io/paths.py``). Temp files and folders are made private
by ``tempfile`` (0600 / 0700); the writers here give them the mode a plain ``open`` /
``mkdir`` would (0666 / 0777 less the umask) before they become the final file, so results on
a shared machine are readable as the user's umask says.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from changecap_jax.errors import UserError
from changecap_jax.io import paths
from changecap_jax.io.paths import current_umask


class UnreadableJSONError(UserError, ValueError):
    """A JSON file the project reads (a run's config.json, metrics, captions) that does not
    parse: the message names the file and where the parse failed."""


def staging_dir(parent: str | os.PathLike, name: str) -> Path:
    """A fresh hidden folder ``parent/.name.XXXX`` to fill and then ``os.replace`` onto
    ``parent/name``, with the mode ``mkdir`` would give it (not mkdtemp's 0700). Local disk
    only: a bucket has no folder rename (``exported_model.write_export`` handles a bucket)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=parent))
    os.chmod(tmp, 0o777 & ~current_umask())
    return tmp


@contextlib.contextmanager
def replaced_folder(parent: str | os.PathLike, name: str) -> Iterator[Path]:
    """Yields a :func:`staging_dir` to fill; when the block ends without an error it
    replaces ``parent/name`` (an older one and all its files removed), otherwise it is
    removed and ``parent/name`` stays as it was. Local disk only."""
    tmp = staging_dir(parent, name)
    try:
        yield tmp
        out = Path(parent) / name
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write(
    path: str | os.PathLike, write: Callable[[IO], None], binary: bool = False
) -> None:
    """Calls ``write(file)`` so that a crash never leaves a half-written ``path``: a temp file
    of the same folder then ``os.replace`` on disk, one upload in a bucket
    (``paths.write_atomic``)."""
    paths.write_atomic(path, write, binary=binary)


def write_json_atomic(path: str | os.PathLike, obj: Any, indent: int | None = None) -> None:
    """JSON through :func:`atomic_write`."""
    atomic_write(path, lambda fh: json.dump(obj, fh, indent=indent))


def read_json(path: str | os.PathLike, what: str) -> Any:
    """Reads a JSON file; a missing file or bad JSON raises naming ``what`` and the path."""
    path = paths.path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what} {path} does not exist")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UnreadableJSONError(f"{what} {path} is not valid JSON: {e}") from e
