"""Paths the user gives and the project writes, on local disk or in a bucket (``gs://...``).

:func:`path` is the one constructor: a local path stays a :class:`pathlib.Path` (so local runs
behave exactly as they always did), a URL becomes an :class:`etils.epath.Path` (the path type
of TFDS and orbax; ``gs://`` goes through gcsfs). Both answer the same calls (``/``,
``exists``, ``is_dir``, ``iterdir``, ``glob``, ``read_text``, ``write_bytes``, ``mkdir``,
``unlink``...). What an object store cannot do the way a disk does is here:

* replacing a file atomically: a bucket object appears whole when its upload ends, so
  :func:`write_atomic` uploads once; on disk it writes aside and renames;
* appending (:func:`append_text`): a bucket has no append, the object is rewritten;
* creating a file only if it is absent (:func:`create_exclusive`, the workdir lock): on disk a
  hard link, in a bucket an upload with the precondition "no live generation" (GCS's
  ``ifGenerationMatch=0``);
* modification times (:func:`mtime`, :func:`touch`).

A bucket's objects are read by many libraries that want local files (TFDS and grain's
random access into ArrayRecord files, say): :func:`mirror` copies a folder to this host's
:func:`local_cache_root` and :func:`upload` copies one back.
"""

from __future__ import annotations

import importlib.util
import io
import os
import pathlib
import re
import tempfile
from collections.abc import Callable, Iterable
from typing import IO, Any, Union

from etils import epath

from changecap_jax import console
from changecap_jax.errors import UserError

# A URL path: "<scheme>://..." (gs, s3...); everything else is a local path.
_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")

AnyPath = Union[pathlib.Path, epath.Path]  # noqa: UP007 (a runtime alias)
PathLike = Union[str, os.PathLike]  # noqa: UP007


def is_remote(p: PathLike) -> bool:
    """Whether ``p`` names an object store (``gs://bucket/...``) rather than local disk."""
    return bool(_URL.match(os.fspath(p)))


def path(p: PathLike) -> AnyPath:
    """``p`` as a path object: :class:`pathlib.Path` on local disk, :class:`epath.Path` for a
    URL (``pathlib`` would squash ``gs://b`` into ``gs:/b``)."""
    if isinstance(p, pathlib.Path):
        return p
    text = os.fspath(p)
    if is_remote(text):
        if text.startswith(("gs://", "gcs://")) and importlib.util.find_spec("gcsfs") is None:
            raise UserError(f"{text}: gs:// paths need gcsfs (pip install gcsfs)")
        _configure_gcs()
        return epath.Path(text)
    return pathlib.Path(text)


def join(p: PathLike, *parts: str) -> str:
    """``p/part/...`` as a string, keeping a URL's ``//``."""
    return os.fspath(path(p).joinpath(*parts))


def _configure_gcs() -> None:
    """gcsfs caches folder listings forever by default; another host (or TensorStore, which
    writes orbax's arrays past gcsfs) changes a bucket behind that cache, so it is off. A
    local emulator (``STORAGE_EMULATOR_HOST``) takes no credentials: none are looked for."""
    import fsspec.config

    for protocol in ("gcs", "gs"):
        conf = fsspec.config.conf.setdefault(protocol, {})
        conf.setdefault("use_listings_cache", False)
        if os.environ.get("STORAGE_EMULATOR_HOST"):
            conf.setdefault("token", "anon")


def _fs(p: AnyPath) -> Any:
    """The fsspec filesystem of a URL path (the one epath uses: gcsfs for gs://)."""
    import fsspec

    _configure_gcs()
    return fsspec.filesystem(os.fspath(p).split("://", 1)[0])


def _fs_path(p: AnyPath) -> str:
    return re.sub(r"^[^:]+://", "", os.fspath(p))


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def current_umask() -> int:
    """The process's umask (read by setting it and restoring it at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomic(p: PathLike, write: Callable[[IO], None], binary: bool = False) -> None:
    """Calls ``write(file)`` so that ``p`` is never seen half-written: on disk into a temp file
    of the same folder (given the mode a plain ``open`` would give) then ``os.replace``; in a
    bucket into memory, then one upload (an object appears whole)."""
    p = path(p)
    if is_remote(p):
        buffer = io.BytesIO() if binary else io.StringIO()
        write(buffer)
        data = buffer.getvalue()
        p.write_bytes(data if binary else data.encode("utf-8"))
        return
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        mode = {"mode": "wb"} if binary else {"mode": "w", "encoding": "utf-8"}
        with os.fdopen(fd, **mode) as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp_name, p)
    except BaseException:
        try:
            os.remove(tmp_name)
        except FileNotFoundError:
            pass
        raise


def append_text(p: PathLike, text: str) -> None:
    """Appends ``text`` to ``p`` (created if absent). A bucket object cannot grow: it is read
    and uploaded again whole (fine for the small files appended to, e.g. scalars.jsonl)."""
    p = path(p)
    if not is_remote(p):
        with p.open("a", encoding="utf-8") as fh:
            fh.write(text)
        return
    old = p.read_text(encoding="utf-8") if p.exists() else ""
    p.write_text(old + text, encoding="utf-8")


def create_exclusive(p: PathLike, data: bytes) -> bool:
    """Creates ``p`` holding ``data`` if no file of that name exists, atomically; False if
    one does. On disk: written aside, then hard-linked into place (the link fails if the name
    exists). In a bucket, where there are no links: one upload with GCS's precondition
    ``ifGenerationMatch=0`` (the server refuses it when the object exists)."""
    p = path(p)
    if is_remote(p):
        try:
            _fs(p).pipe_file(_fs_path(p), data, mode="create")
        except FileExistsError:
            return False
        return True
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    try:
        os.link(tmp, p)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def mtime(p: PathLike) -> float:
    """``p``'s modification time (seconds since the epoch); FileNotFoundError if absent."""
    p = path(p)
    if is_remote(p):
        # gcsfs's own answer keeps the sub-second part that epath's stat() drops.
        when = _fs(p).info(_fs_path(p)).get("mtime")
        return when.timestamp() if when is not None else float(p.stat().mtime)
    return p.stat().st_mtime


def touch(p: PathLike) -> None:
    """Sets ``p``'s modification time to now. A bucket object's time is its upload's, so it is
    uploaded again with the same bytes."""
    p = path(p)
    if is_remote(p):
        p.write_bytes(p.read_bytes())
    else:
        os.utime(p)


# ---------------------------------------------------------------------------------------------
# Local copies of bucket folders
# ---------------------------------------------------------------------------------------------


def local_cache_root() -> pathlib.Path:
    """This host's folder for local copies of bucket data: ``$CHANGECAP_LOCAL_CACHE``, else
    ``$XDG_CACHE_HOME/changecap_jax``, else ``~/.cache/changecap_jax``."""
    if os.environ.get("CHANGECAP_LOCAL_CACHE"):
        return pathlib.Path(os.environ["CHANGECAP_LOCAL_CACHE"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(cache) / "changecap_jax"


def local_mirror_dir(p: PathLike) -> pathlib.Path:
    """Where this host keeps its copy of the bucket folder ``p``:
    ``<local_cache_root>/mirror/<scheme>/<bucket>/<path>``."""
    text = os.fspath(p)
    scheme, rest = text.split("://", 1)
    return local_cache_root() / "mirror" / scheme / rest.strip("/")


def _remote_files(src: AnyPath) -> dict[str, int]:
    """relative name -> size of every file under the bucket folder ``src`` (one listing)."""
    fs = _fs(src)
    base = _fs_path(src).rstrip("/")
    found = fs.find(base, detail=True)
    return {name[len(base) + 1:]: int(info.get("size") or 0) for name, info in found.items()
            if info.get("type") != "directory" and name.startswith(base + "/")}


def mirror(src: PathLike, dst: PathLike, what: str, last: Iterable[str] = ()) -> int:
    """Copies the bucket folder ``src`` into the local folder ``dst``: each file whose local
    copy is missing or has another size (a file is written aside, then renamed, so a killed
    copy leaves no half file under its name). ``last``: names copied after the others (the
    marker a reader checks to see a complete folder). Returns the bytes copied."""
    src, dst = path(src), pathlib.Path(dst)
    files, last = _remote_files(src), set(last)
    todo = [name for name in sorted(files, key=lambda n: (n in last, n))
            if not ((dst / name).is_file() and (dst / name).stat().st_size == files[name])]
    total = sum(files[name] for name in todo)
    if not todo:
        return 0
    with console.Progress(total=total, unit="B", unit_scale=True,
                          desc=f"copying {what} from {src}") as bar:
        for name in todo:
            target = dst / name
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.{os.getpid()}.part")
            with (src / name).open("rb") as fin, tmp.open("wb") as fout:
                while chunk := fin.read(1 << 22):
                    fout.write(chunk)
                    bar.update(len(chunk))
            os.replace(tmp, target)
    return total


def upload(src: PathLike, dst: PathLike, what: str, last: Iterable[str] = ()) -> int:
    """Copies the local folder ``src`` into the bucket folder ``dst``, every file, the names in
    ``last`` after all others (so a reader that checks them sees a complete folder). Returns
    the bytes copied."""
    src, dst = pathlib.Path(src), path(dst)
    last = set(last)
    files = sorted((p for p in src.rglob("*") if p.is_file()),
                   key=lambda p: (p.relative_to(src).as_posix() in last, p.as_posix()))
    total = sum(p.stat().st_size for p in files)
    with console.Progress(total=total, unit="B", unit_scale=True,
                          desc=f"copying {what} to {dst}") as bar:
        for p in files:
            with p.open("rb") as fin, (dst / p.relative_to(src).as_posix()).open("wb") as fout:
                while chunk := fin.read(1 << 22):
                    fout.write(chunk)
                    bar.update(len(chunk))
    return total
