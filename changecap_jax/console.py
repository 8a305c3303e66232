"""What the commands print while they run: log lines and tqdm progress bars share stderr.

A tqdm bar keeps its line open (no newline) and redraws it with ``\\r``; a log line written
meanwhile would be glued to the end of the bar. :func:`install_bar_safe_logging` makes the
console handlers clear the open bars, write, and redraw them (``tqdm.write``'s way).
"""

from __future__ import annotations

import logging
import sys

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


def setup(verbose: bool = False) -> None:
    """The console of a command: bar-safe logging, and the libraries' INFO lines only with
    ``verbose``."""
    install_bar_safe_logging()
    if not verbose:
        for name in QUIET_LIBRARIES:
            logging.getLogger(name).setLevel(logging.WARNING)
