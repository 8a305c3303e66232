"""Scalars to TensorBoard (tensorboardX) and the log, from process 0 only; the logdir and
the scalars file may be in a bucket (``io/paths.py``).

clu's metric writers need TensorFlow at import time, which the core install avoids; this is
the small part of them the trainer uses.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pathlib
import shutil
import tempfile
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from changecap_jax.io import paths
from changecap_jax.io.jsonio import atomic_write

# In a workdir: every logged scalar, one JSON object per line (the report's curves).
SCALARS_FILE = "scalars.jsonl"
# The logged scalars that measure time: they differ between two runs of the same steps.
TIMING_SCALARS = ("steps_per_second", "examples_per_second", "checkpoint_wait_s")
SYNC_S = 30.0  # a bucket logdir: how often the local event files are uploaded


class MetricWriter:
    def __init__(self, logdir: str | os.PathLike, enabled: bool = True,
                 scalars_file: str | os.PathLike | None = None):
        """``scalars_file``: also append every write as one JSON line {"step", name: value}
        (the report's learning curves read it; no TensorBoard reader needed)."""
        self.enabled = enabled
        self._writer = None
        self._remote_logdir = None
        self._scalars_file = paths.path(scalars_file) if scalars_file else None
        if enabled:
            from tensorboardX import SummaryWriter

            # A bucket logdir: events are written to a local folder and its files uploaded
            # every SYNC_S and at close (tensorboardX's own gs:// writer needs a second GCS
            # client and flushes again from __del__ at exit, after the bucket may be gone).
            self._remote_logdir = paths.path(logdir) if paths.is_remote(logdir) else None
            local = (tempfile.mkdtemp(prefix="changecap_tensorboard_")
                     if self._remote_logdir is not None else os.fspath(logdir))
            self._writer = SummaryWriter(local, flush_secs=30)
            self._synced = time.monotonic()

    def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        values = {k: float(np.asarray(v)) for k, v in scalars.items()}
        for k, v in values.items():
            self._writer.add_scalar(k, v, step)
        if self._scalars_file is not None:
            line = json.dumps({"step": int(step), **{k: v if math.isfinite(v) else None
                                                     for k, v in values.items()}})
            paths.append_text(self._scalars_file, line + "\n")
        logging.info("[%d] %s", step, ", ".join(f"{k}={v:.4g}" for k, v in values.items()))
        if self._remote_logdir is not None and time.monotonic() - self._synced > SYNC_S:
            self._sync()

    def _sync(self) -> None:
        """Uploads the local event files to the bucket logdir (each whole: they are small)."""
        self._writer.flush()
        local = pathlib.Path(self._writer.logdir)
        for p in local.iterdir():
            (self._remote_logdir / p.name).write_bytes(p.read_bytes())
        self._synced = time.monotonic()

    def truncate_after(self, step: int) -> int:
        """Drops the scalars-file lines logged after ``step`` (a resume replays those steps,
        which would log them twice); returns how many were dropped. Atomic rewrite."""
        if not self.enabled or self._scalars_file is None or not self._scalars_file.exists():
            return 0
        lines = self._scalars_file.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = [line for line in lines if _line_step(line) <= step]
        if len(kept) < len(lines):
            atomic_write(self._scalars_file, lambda fh: fh.writelines(kept))
        return len(lines) - len(kept)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            if self._remote_logdir is not None:
                self._sync()
                shutil.rmtree(self._writer.logdir, ignore_errors=True)


def _line_step(line: str) -> float:
    """The step of one scalars-file line; a damaged line (a crash mid-write) sorts last, so a
    resume drops it."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return math.inf
