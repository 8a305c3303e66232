"""A ``jax.profiler`` trace of a few training steps (``config.profile_steps``, docs/training.md
"Profiling a run").

``profile_steps = (start, count)`` traces steps ``start`` .. ``start + count - 1`` (1-based, as
the loop counts them) of process 0 into ``<workdir>/profile/``, where TensorBoard's profile
plugin reads it (``tensorboard --logdir <workdir>/profile``): the trace starts before step
``start`` is dispatched and stops once the last traced step's outputs are ready, so the
device's work of every traced step is inside it. ``()`` or a count of 0: off.

A bucket workdir (``gs://...``) is traced to a local folder first and copied there when the
trace stops (``io.paths.upload``): the profiler writes through its own file system layer,
which need not reach the bucket.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax

from changecap_jax.errors import UserError
from changecap_jax.io import paths

T = TypeVar("T")
PROFILE_DIR = "profile"  # under the workdir: TensorBoard's --logdir for the trace


class ProfileStepsError(UserError):
    """``config.profile_steps`` is not ``()`` or a ``(start, count)`` pair."""


def parse_steps(value: Sequence[int] | None) -> tuple[int, int] | None:
    """``(start, count)`` from ``config.profile_steps``, None when profiling is off."""
    if not value:
        return None
    items = tuple(value)
    if (len(items) != 2 or not all(isinstance(v, int) and not isinstance(v, bool)
                                   for v in items) or items[0] < 1 or items[1] < 0):
        raise ProfileStepsError(f"config.profile_steps={value!r}: give (start, count), start "
                                f">= 1 and count >= 0 (steps start..start+count-1), or ()")
    return None if items[1] == 0 else (items[0], items[1])


class StepProfiler:
    """Starts and stops the trace around the loop's steps (module docstring)."""

    def __init__(self, value: Sequence[int] | None, workdir: paths.PathLike, enabled: bool,
                 first_step: int):
        steps = parse_steps(value)
        self.start, self.stop = (steps[0], steps[0] + steps[1] - 1) if steps else (0, -1)
        self.target = paths.path(workdir) / PROFILE_DIR
        self.local: str | None = None  # the folder the running trace writes to
        if steps and enabled and self.start <= first_step:
            logging.warning("config.profile_steps starts at step %d, but the run starts after "
                            "step %d: no profile", self.start, first_step)
        self.on = bool(steps) and enabled and self.start > first_step

    def step(self, step: int, run: Callable[..., T], *args: Any) -> T:
        """``run(*args)``, the loop's ``step``, inside the trace when it is a traced one."""
        self.before(step)
        out = run(*args)
        self.after(step, out)
        return out

    def before(self, step: int) -> None:
        """Called before ``step`` is dispatched."""
        if self.on and step == self.start:
            if paths.is_remote(self.target):
                self.local = tempfile.mkdtemp(prefix="changecap_profile_")
            else:
                self.target.mkdir(parents=True, exist_ok=True)
                self.local = str(self.target)
            jax.profiler.start_trace(self.local)

    def after(self, step: int, outputs: Any) -> None:
        """Called with ``step``'s outputs once it is dispatched."""
        if self.local is not None and step == self.stop:
            # Dispatch is asynchronous: wait for the device to finish the traced steps.
            jax.block_until_ready(outputs)
            self.close()

    def close(self) -> None:
        """Stops a running trace (the last traced step, or the loop ending early) and writes
        it out."""
        if self.local is None:
            return
        local, self.local = self.local, None
        jax.profiler.stop_trace()
        if paths.is_remote(self.target):
            paths.upload(local, self.target, "the profile")
            shutil.rmtree(local, ignore_errors=True)
        logging.info("profile of steps %d-%d in %s (tensorboard --logdir %s)", self.start,
                     self.stop, self.target, self.target)
