"""One build of a dataset at a time, and no leftovers of interrupted ones.

While a process builds a dataset ``<data_dir>/<tfds name>/<config>/<version>/`` or writes
per-model files into it (``data_prep/first_use.py``), it holds (``fcntl.flock``) a lock file beside
it, ``<version>.lock``, which holds its pid. The kernel drops the lock when its holder exits,
however it exits, so a lock is never stale. A second process waits for it, logging "waiting
for the build of X by pid N", up to a timeout, then stops with a message that says who holds
it.

TFDS builds into ``incomplete.XXXXXX_<version>/`` beside the dataset and renames it at the
end. A killed build (SIGKILL, or an OOM kill) leaves that folder behind; the next build of the
same dataset and version, holding the lock (so no live build owns the folder), removes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

WAIT_S = 3600.0  # how long a build waits for another build of the same dataset
POLL_S = 0.25
INCOMPLETE_PREFIX = "incomplete."  # TFDS's temporary build folders


class LockTimeout(RuntimeError):
    """Another process held a dataset's lock for longer than the wait allowed."""


def name_of(directory: str | os.PathLike) -> str:
    """``<tfds name>/<config> <version>`` of a dataset directory, for logs and errors."""
    directory = Path(directory)
    return f"{directory.parent.parent.name}/{directory.parent.name} {directory.name}"


def lock_path(directory: str | os.PathLike) -> Path:
    """The lock file of a dataset directory: ``<version>.lock`` beside it."""
    directory = Path(directory)
    return directory.parent / f"{directory.name}.lock"


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _owner(fd: int) -> str:
    """The pid the holder wrote into the lock file ("?" before it has written it)."""
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return text or "?"


def holder(directory: str | os.PathLike) -> str | None:
    """The pid (as written) of the process holding the dataset's lock, or None when free."""
    path = lock_path(directory)
    if not path.exists():
        return None
    fd = os.open(path, os.O_RDWR)
    try:
        if _try_lock(fd):
            return None
        return _owner(fd)
    finally:
        os.close(fd)  # also releases a lock taken just to look


def _acquire(path: Path, what: str, directory: Path, wait_s: float) -> int:
    """An fd of ``path`` holding its lock; waits (logging who holds it) up to ``wait_s``."""
    deadline, logged = time.monotonic() + wait_s, False
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        while not _try_lock(fd):
            if not logged:
                logging.info("waiting for the build of %s by pid %s (lock %s, up to %.0f s)",
                             what, _owner(fd), path, wait_s)
                logged = True
            if time.monotonic() >= deadline:
                owner = _owner(fd)
                os.close(fd)
                raise LockTimeout(
                    f"{what} in {directory} is being built by pid {owner} (it holds {path}); "
                    f"waited {wait_s:.0f} s. Let that build finish (or stop it), then run "
                    "again")
            time.sleep(POLL_S)
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        # The holder removed the file on its way out: lock the one at the path now.
        os.close(fd)


@contextlib.contextmanager
def dataset_lock(directory: str | os.PathLike, what: str,
                 wait_s: float = WAIT_S) -> Iterator[None]:
    """Holds the lock of a dataset directory; waits up to ``wait_s`` for another holder.

    ``what`` names the dataset in the log line and the error (e.g. "synthetic_change/moderate
    1.2.0"). The lock file is removed on release (a waiter then locks a fresh one)."""
    path = lock_path(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = _acquire(path, what, Path(directory), wait_s)
    try:
        os.ftruncate(fd, 0)  # a killed holder's file keeps its pid
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        path.unlink(missing_ok=True)  # while still holding it, so no one holds a stale one
        os.close(fd)  # releases the lock


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def remove_leftovers(paths: Iterable[Path], what: str) -> list[Path]:
    """Removes folders and files of interrupted runs, with one log line; call it holding the
    dataset's lock (then no live process owns them)."""
    removed, total = [], 0
    for path in sorted(paths):
        if path.is_dir():
            total += _size(path)
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            total += path.stat().st_size
            path.unlink(missing_ok=True)
        else:
            continue
        removed.append(path)
    if removed:
        logging.info("removed %d leftover(s) of interrupted runs of %s (%.1f MB): %s",
                     len(removed), what, total / 1e6, ", ".join(str(p) for p in removed))
    return removed


def incomplete_dirs(directory: str | os.PathLike) -> list[Path]:
    """TFDS's temporary build folders of one dataset version (``incomplete.*_<version>``)."""
    directory = Path(directory)
    if not directory.parent.is_dir():
        return []
    return sorted(p for p in directory.parent.glob(f"{INCOMPLETE_PREFIX}*_{directory.name}")
                  if p.is_dir())


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM (``kill``, ``timeout``, a scheduler stopping a job) raises
    SystemExit(143) instead of ending the process on the spot, so the build's cleanup runs as
    for Ctrl-C. Only in the main thread (where signals arrive) and where SIGTERM has its
    default action: a handler the program installed is left alone."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
