"""What the commands print while they run: one policy for every ``python -m`` command.

* Log lines: the project's INFO lines; the libraries' INFO chatter (JAX, orbax, TFDS, grain)
  only with ``--verbose``; everyone's warnings always.
* Progress: :class:`Progress` (a tqdm bar) on a terminal. When stderr is not a terminal (a log
  file, a job scheduler), a bar's redraws would leave ``\\r``-joined fragments glued to the
  log lines, so the same object writes a plain log line instead, at most every
  ``LOG_PROGRESS_EVERY_S`` seconds and once at the end.

On a terminal a bar keeps its line open (no newline) and redraws it with ``\\r``; a log line
written meanwhile would be glued to the end of the bar. :func:`install_bar_safe_logging` makes
the console handlers clear the open bars, write, and redraw them (``tqdm.write``'s way).
:class:`StepBar` is the training loops' bar, its ETA not fooled by their stalls.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from typing import Any

from absl import logging as absl_logging
from tqdm import tqdm

# Loggers whose INFO lines are for their own developers, e.g. JAX's "Unable to initialize
# backend 'tpu'" on every machine without a TPU; their warnings still show.
QUIET_LIBRARIES = ("jax",)
# Sources whose INFO lines are chatter: libraries that log through absl (one logger for all,
# so told apart by the file that logged).
QUIET_SOURCES = ("/orbax/", "/tensorflow_datasets/", "/grain/", "/etils/", "/fsspec/", "/gcsfs/")
LOG_PROGRESS_EVERY_S = 30.0  # off a terminal: the least time between two progress lines
# tqdm's cursor moves between stacked bars (ESC [ n A and the like): a terminal's business.
_CURSOR_CODES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def is_terminal() -> bool:
    """Whether stderr (where bars and logs go) is a terminal."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        return False


class _ProgressLog:
    """tqdm's output file off a terminal: each redraw becomes one INFO log line."""

    def write(self, text: str) -> None:
        text = _CURSOR_CODES.sub("", text).replace("\r", "").strip()
        if text:
            logging.getLogger("changecap_jax.progress").info("%s", text)

    def flush(self) -> None:
        pass


class Progress(tqdm):
    """A progress bar on a terminal, periodic log lines otherwise (module docstring). Takes
    tqdm's arguments."""

    def __init__(self, *args: Any, **kwargs: Any):
        if not is_terminal() and "file" not in kwargs:
            kwargs.update(file=_ProgressLog(), dynamic_ncols=False, ncols=None,
                          mininterval=max(kwargs.get("mininterval", 0), LOG_PROGRESS_EVERY_S),
                          bar_format="{desc}: {n_fmt}/{total_fmt} [{elapsed}<{remaining}, "
                                     "{rate_fmt}{postfix}]")
        super().__init__(*args, **kwargs)

    def set_postfix(self, ordered_dict: Any = None, refresh: bool = True, **kwargs: Any) -> None:
        # Off a terminal a redraw is a log line: the postfix waits for the next periodic one.
        super().set_postfix(ordered_dict, refresh=refresh and is_terminal(), **kwargs)


def _quiet_library_info(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or not any(
        source in record.pathname.replace(os.sep, "/") for source in QUIET_SOURCES)


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


class StepBar(Progress):
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
        for handler in logging.getLogger().handlers:  # absl's and any other console's
            if _quiet_library_info not in handler.filters:
                handler.addFilter(_quiet_library_info)
