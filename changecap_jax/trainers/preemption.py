"""A preempted run saves where it is and stops: SIGTERM (a TPU host's maintenance, a spot or
preemptible VM, a scheduler's cancel) makes the loop save a checkpoint at the next step on
every process and stop with exit status 0; the same command then resumes from that step, so
no finished step is lost.

Several processes: JAX's preemption service (started by ``jax.distributed.initialize``)
catches the signal in whichever process gets it, tells the others, and picks the first step
every process can still reach; :func:`multihost_utils.reached_preemption_sync_point`, asked
at every step, is true at that step on all of them at once. One process: a signal handler
notes the signal, and the loop saves at the next step.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

import jax
from jax.experimental import multihost_utils


class Preempted(Exception):  # an outcome, not an error: the command exits 0
    """The loop saved at ``step`` after a preemption notice and stopped."""

    def __init__(self, step: int, directory: Any):
        super().__init__(f"preempted: saved the checkpoint of step {step} in {directory}; "
                         "the same command resumes from it")
        self.step = step


class PreemptionNotice:
    """Whether a preemption notice has arrived, asked once per step (:meth:`reached`)."""

    def __init__(self) -> None:
        self._several = jax.process_count() > 1
        self._received = False
        self._previous: Any = None
        # Several processes: JAX's service owns SIGTERM (its handler is installed by
        # jax.distributed.initialize; a Python handler would replace it).
        if not self._several and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._note)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self._received = True
        logging.warning("preemption notice (SIGTERM): saving at the next step, then stopping")

    def reached(self, step: int) -> bool:
        """Whether the loop must save at ``step`` and stop (the same answer on every
        process; call at every step, from the first one on)."""
        if self._several:
            return multihost_utils.reached_preemption_sync_point(step)
        return self._received

    def close(self) -> None:
        """Gives SIGTERM back to the handler that was there before."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
