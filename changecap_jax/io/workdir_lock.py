"""One run per workdir: a lock file naming its holder, taken over when the holder is gone.

Two runs writing one workdir race on its checkpoints (orbax renames a step's temporary folder
while the other run deletes it) and interleave its metrics. ``python -m changecap_jax.main``
(train and eval) holds ``<workdir>/run.lock`` while it runs; a second run is refused at start
with one line naming the holder (host, pid, start time, command), and ``export`` refuses a
workdir whose run is still writing it.

The lock is a JSON file created atomically and only if absent (``paths.create_exclusive``: on
disk written aside, then hard-linked into place, which fails if the name exists; in a bucket
one upload with the precondition that no object has the name). A lock whose holder is gone
is *stale* and is taken over with a warning: on the holder's host, its process no longer
exists (or its pid now belongs to a process started at another time); from another host, the
holder has not refreshed the lock's modification time for ``STALE_AFTER_S`` (the holder
refreshes it every ``HEARTBEAT_S``). A workdir in a bucket is seen from many hosts: the same
rules hold, its object's upload time being the modification time.

Multi-host runs: process 0 holds the lock and tells the others whether it got it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from changecap_jax.errors import WorkdirBusyError
from changecap_jax.io import paths

LOCK_FILE = "run.lock"
HEARTBEAT_S = 60.0  # how often the holder refreshes the lock's modification time
STALE_AFTER_S = 600.0  # a lock from another host not refreshed for this long is stale


@dataclasses.dataclass(frozen=True)
class Holder:
    """Who holds a workdir: enough to tell a live holder from a dead one and to name it."""

    host: str
    pid: int
    started: float  # time.time() when the lock was taken
    command: str
    process_start: str = ""  # the pid's start time in /proc (tells a reused pid), or ""

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid} on {self.host}, since {when} ({self.command})"


def _process_start(pid: int) -> str:
    """The start time of process ``pid`` (clock ticks since boot), or "" where /proc does not
    tell."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    # Field 22; the command name (field 2) may hold spaces, so count after its ")".
    return stat.rpartition(")")[2].split()[19]


def _me(command: str) -> Holder:
    return Holder(host=socket.gethostname(), pid=os.getpid(), started=time.time(),
                  command=command, process_start=_process_start(os.getpid()))


def read_holder(workdir: str | os.PathLike) -> Holder | None:
    """The holder named in ``workdir``'s lock, or None when there is no readable lock."""
    try:
        data = json.loads((paths.path(workdir) / LOCK_FILE).read_text())
        return Holder(**data)
    except (OSError, ValueError, TypeError):
        return None


def is_stale(holder: Holder, lock: paths.AnyPath, now: float | None = None) -> bool:
    """Whether ``holder`` is gone (module docstring)."""
    if holder.host == socket.gethostname():
        try:
            os.kill(holder.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, another user's
            return False
        return bool(holder.process_start) and _process_start(holder.pid) != holder.process_start
    try:
        age = (now if now is not None else time.time()) - paths.mtime(lock)
    except FileNotFoundError:
        return True
    return age > STALE_AFTER_S


def live_holder(workdir: str | os.PathLike) -> Holder | None:
    """The holder of ``workdir``'s lock if it is alive, else None."""
    holder = read_holder(workdir)
    if holder is None or is_stale(holder, paths.path(workdir) / LOCK_FILE):
        return None
    return holder


def _try_create(lock: paths.AnyPath, me: Holder) -> bool:
    """Creates ``lock`` holding ``me``, atomically; False if it exists."""
    return paths.create_exclusive(lock, json.dumps(dataclasses.asdict(me)).encode())


def acquire(workdir: str | os.PathLike, command: str) -> Holder:
    """Takes ``workdir``'s lock for this process (creating the workdir); raises
    :class:`WorkdirBusyError` naming the holder when a live run holds it."""
    workdir = paths.path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    lock = workdir / LOCK_FILE
    me = _me(command)
    for _ in range(3):  # a lock that vanishes or goes stale between the looks: look again
        if _try_create(lock, me):
            return me
        holder = read_holder(workdir)
        if holder is None:
            # Unreadable: being written (links and uploads appear whole, so rarely), or damaged.
            time.sleep(0.2)
            if read_holder(workdir) is None and lock.exists():
                logging.warning("workdir lock %s is unreadable; taking it over", lock)
                lock.unlink(missing_ok=True)
            continue
        if not is_stale(holder, lock):
            raise WorkdirBusyError(
                f"workdir {workdir} is in use by another run: {holder.describe()}; wait for "
                f"it, stop it, or pass another --workdir (its lock: {lock})")
        logging.warning("taking over the workdir lock of a run that is gone (%s)",
                        holder.describe())
        if read_holder(workdir) == holder:  # not taken over by someone else meanwhile
            lock.unlink(missing_ok=True)
    raise WorkdirBusyError(f"cannot take the workdir lock {lock}: it keeps changing; is "
                           "another run starting in this workdir?")


def release(workdir: str | os.PathLike, me: Holder) -> None:
    """Removes ``workdir``'s lock if ``me`` still holds it."""
    if read_holder(workdir) == me:
        (paths.path(workdir) / LOCK_FILE).unlink(missing_ok=True)


def _heartbeat(workdir: str | os.PathLike, me: Holder, stop: threading.Event) -> None:
    lock = paths.path(workdir) / LOCK_FILE
    while not stop.wait(HEARTBEAT_S):
        # In a bucket a refresh uploads the lock again: only while it is still ours (a run
        # that took it over as stale keeps its own).
        with contextlib.suppress(OSError):
            if not paths.is_remote(lock) or read_holder(workdir) == me:
                paths.touch(lock)


@contextlib.contextmanager
def hold(workdir: str | os.PathLike, command: str | None = None) -> Iterator[None]:
    """Holds ``workdir``'s lock for the block (process 0 of a multi-host run; the other
    processes fail with it when it cannot)."""
    import jax

    command = command if command is not None else " ".join(
        [Path(sys.argv[0]).name, *sys.argv[1:]])[:200]
    me, error = None, None
    if jax.process_index() == 0:
        try:
            me = acquire(workdir, command)
        except WorkdirBusyError as e:
            error = e
    if jax.process_count() > 1:
        import numpy as np
        from jax.experimental import multihost_utils

        got = multihost_utils.broadcast_one_to_all(np.int32(error is None))
        if not int(got) and error is None:
            error = WorkdirBusyError(f"workdir {workdir} is in use by another run (process 0 "
                                     "could not take its lock)")
    if error is not None:
        raise error
    stop = threading.Event()
    if me is not None:
        threading.Thread(target=_heartbeat, args=(workdir, me, stop),
                         daemon=True, name="workdir-lock-heartbeat").start()
    try:
        yield
    finally:
        stop.set()
        if me is not None:
            release(workdir, me)
