"""What the commands print while they run: log lines and tqdm progress bars share stderr.

A tqdm bar keeps its line open (no newline) and redraws it with ``\\r``; a log line written
meanwhile would be glued to the end of the bar. :func:`install_bar_safe_logging` makes the
console handlers clear the open bars, write, and redraw them (``tqdm.write``'s way).
:class:`StepBar` is the training loops' bar, its ETA not fooled by their stalls.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from absl import logging as absl_logging
from tqdm import tqdm

# Loggers whose INFO lines are for their own developers, e.g. JAX's "Unable to initialize
# backend 'tpu'" on every machine without a TPU; their warnings still show.
QUIET_LIBRARIES = ("jax",)


class BarSafeHandler(logging.Handler):
    """Emits through ``handler`` with the open tqdm bars cleared first and redrawn after."""

    def __init__(self, handler: logging.Handler):
        super().__init__()  # NOTSET: the wrapped handler's level decides (absl changes it)
        self.handler = handler

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno < self.handler.level:
            return
        # Clears the bars on stdout and stderr (a terminal shows both on one screen).
        with tqdm.external_write_mode(file=sys.stderr):
            self.handler.handle(record)

    def flush(self) -> None:
        self.handler.flush()

    def close(self) -> None:
        self.handler.close()
        super().close()


def _is_console(handler: logging.Handler) -> bool:
    if isinstance(handler, absl_logging.ABSLHandler):
        return True
    return (isinstance(handler, logging.StreamHandler)
            and getattr(handler, "stream", None) in (sys.stdout, sys.stderr))


def install_bar_safe_logging(logger: logging.Logger | None = None) -> None:
    """Wraps the console handlers of ``logger`` (default: the root logger, where absl puts
    its handler) in :class:`BarSafeHandler`; idempotent."""
    logger = logger if logger is not None else logging.getLogger()
    logger.handlers = [BarSafeHandler(h) if _is_console(h) else h for h in logger.handlers]


class StepBar(tqdm):
    """The progress bar of a training loop: its rate and ETA are the run's average step time,
    leaving out the time from :meth:`pause` to :meth:`unpause` (compiles, evaluations); the
    elapsed time stays the wall clock's. The bar starts paused: unpause it after the first
    step, which compiles.

    tqdm's default moving average is fooled by a training loop: most steps return once they
    are dispatched, the logged steps wait for all of them (the metrics fetch), and the ETA
    swung to hours at every log and evaluation.
    """

    def __init__(self, total: int, initial: int, desc: str, disable: bool = False):
        # Set before tqdm's __init__, which draws the bar (format_dict).
        self._left_out, self._paused_at = 0.0, time.time()
        # miniters=1: without smoothing, tqdm would stretch its redraws to the longest burst
        # of steps seen between two redraws.
        super().__init__(total=total, initial=initial, desc=desc, disable=disable,
                         dynamic_ncols=True, smoothing=0, miniters=1)
        self._paused_at = getattr(self, "start_t", self._paused_at)  # paused from the start

    def pause(self) -> None:
        """Leaves the time until :meth:`unpause` out of the rate."""
        if self._paused_at is None:
            self._paused_at = time.time()

    def unpause(self) -> None:
        if self._paused_at is not None:
            self._left_out += time.time() - self._paused_at
            self._paused_at = None

    @property
    def format_dict(self) -> dict[str, Any]:
        info = super().format_dict
        paused = time.time() - self._paused_at if self._paused_at is not None else 0.0
        active = (info["elapsed"] or 0) - self._left_out - paused
        if active > 0 and self.n > self.initial:  # (a disabled bar has no initial)
            info["rate"] = (self.n - self.initial) / active
        return info


def setup(verbose: bool = False) -> None:
    """The console of a command: bar-safe logging, and the libraries' INFO lines only with
    ``verbose``."""
    install_bar_safe_logging()
    if not verbose:
        for name in QUIET_LIBRARIES:
            logging.getLogger(name).setLevel(logging.WARNING)
