"""A multi-host run that loses a process ends on one line, on every other host, in bounded time.

When one process of a ``jax.distributed`` job dies (killed, out of memory, its host gone), the
others cannot go on: their next collective needs it. JAX's distributed service notices it
(the lost process sends no heartbeat for ``--peer_timeout_s`` seconds; a lost coordinator at
once, its connection closes) and ends every other process from C++: a fatal-error log of a
dozen lines and a stack dump, no Python exception to catch. So ``main --multihost`` runs the
training as a child of this small watcher (no JAX in it): the child's output passes through
unchanged, except the distributed service's own log records, held back until the child either
goes on (then they are shown) or is ended by the service (then they are replaced by one line
naming the lost process, exit status :data:`EXIT_LOST_PROCESS`). SIGTERM and SIGINT sent to
the watcher reach the child (a preemption notice: ``trainers/preemption.py``), and the child
stops if its watcher is killed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO

CHILD_MARK = "CHANGECAP_HOST_WATCH_CHILD"  # set in the child's environment: it runs the job
EXIT_LOST_PROCESS = 4

# A C++ log record of the distributed service (glog prefix, then its source file).
_SERVICE_RECORD = re.compile(
    rb"^[IWEF]\d{4} [\d:.]+\s+\d+ (coordination_service\w*|client|preemption_\w+|"
    rb"distributed_runtime\w*|grpc\w*)\.(cc|h):\d+\]")
_ANY_RECORD = re.compile(rb"^([IWEF]\d{4} [\d:.]+\s+\d+ \S+:\d+\]|\*\*\* |Traceback )")
_FATAL = b"Terminating process because the JAX distributed service detected fatal errors"
_UNHEALTHY = re.compile(rb"stopped sending heartbeats\):\s*\n?((?:\s*\d+[,\s]*)+)")


def lost_processes(log: bytes) -> list[int] | None:
    """The processes the distributed service reported lost in ``log`` ([0] for a lost
    coordinator), or None when the log shows no such fatal error."""
    if _FATAL not in log:
        return None
    unhealthy = _UNHEALTHY.search(log)
    if unhealthy:
        return sorted({int(t) for t in re.findall(rb"\d+", unhealthy.group(1))})
    return [0]  # the connection to the coordinator (process 0) closed


def lost_line(lost: Sequence[int], process_id: int | None, num_processes: int | None,
              peer_timeout_s: int) -> str:
    """The one line a process that stopped for ``lost`` processes prints."""
    me = f"process {process_id}" if process_id is not None else "this process"
    if list(lost) == [0]:
        # The coordinator's connection closed. It may have been lost itself, or have stopped
        # a moment earlier for another lost process, before that news reached this one.
        what = ("the connection to process 0, the coordinator: it was lost, or it stopped "
                "because another process was (process 0's line names it)")
    else:
        of = f" of {num_processes}" if num_processes else ""
        names = ", ".join(str(p) for p in lost)
        what = (f"process{'es' if len(lost) > 1 else ''} {names}{of} (no heartbeat for "
                f"{peer_timeout_s} s): killed, out of memory or its host failed")
    return (f"error: lost {what}; {me} stopped too. Start the job again on every host: it "
            "resumes from the last checkpoint")


class _Relay:
    """Copies the child's stderr to ours, holding the distributed service's records back."""

    def __init__(self, source: IO[bytes], sink: IO[bytes]):
        self.source, self.sink = source, sink
        self.held: list[bytes] = []
        self.log = bytearray()  # what was held back, for lost_processes()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        holding = False
        for line in iter(self.source.readline, b""):
            if _FATAL in self.log:  # the service ends the child: the rest is its stack dump
                holding = True
            elif _SERVICE_RECORD.match(line):
                holding = True
            elif _ANY_RECORD.match(line) or not holding:
                holding = False
                self._release()
            if holding:
                self.held.append(line)
                self.log += line
            else:
                self._write(line)

    def _release(self) -> None:
        for line in self.held:
            self._write(line)
        self.held.clear()

    def _write(self, line: bytes) -> None:
        self.sink.write(line)
        self.sink.flush()

    def drain(self) -> None:
        """Waits until the child's stderr is read to its end (or 10 s)."""
        self.thread.join(timeout=10)

    def finish(self, drop_held: bool) -> None:
        self.drain()
        if not drop_held:
            self._release()


def run_watched(process_id: int | None, num_processes: int | None, peer_timeout_s: int) -> int:
    """Runs this process's command line again as a child with :data:`CHILD_MARK` set, and
    returns the exit status to end with (the child's, or :data:`EXIT_LOST_PROCESS`)."""
    env = dict(os.environ, **{CHILD_MARK: str(os.getpid())})
    child = subprocess.Popen([sys.executable, *sys.orig_argv[1:]], env=env,
                             stderr=subprocess.PIPE)
    relay = _Relay(child.stderr, sys.stderr.buffer)
    forward = lambda signum, frame: child.send_signal(signum)
    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        status = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    relay.drain()  # the fatal record may still be in the pipe when the child has ended
    lost = lost_processes(bytes(relay.log)) if status != 0 else None
    relay.finish(drop_held=lost is not None)
    if lost is not None:
        print(lost_line(lost, process_id, num_processes, peer_timeout_s), file=sys.stderr,
              flush=True)
        return EXIT_LOST_PROCESS
    return status if status >= 0 else 128 - status


def is_watched_child() -> bool:
    """Whether this process is the job run by a watcher (:func:`run_watched`)."""
    return CHILD_MARK in os.environ


def stop_with_watcher() -> None:
    """In a watched child: a thread that ends this process when its watcher is gone (killed
    with -9 along with nothing else, the child would train on alone)."""
    watcher = int(os.environ[CHILD_MARK])

    def watch() -> None:
        while os.getppid() == watcher:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="host_watch").start()
