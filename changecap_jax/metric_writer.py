"""Scalars to TensorBoard (tensorboardX) and the log, from process 0 only.

clu's metric writers need TensorFlow at import time, which the core install avoids; this is
the small part of them the trainer uses.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import numpy as np


class MetricWriter:
    def __init__(self, logdir: str | os.PathLike, enabled: bool = True):
        self.enabled = enabled
        self._writer = None
        if enabled:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(str(logdir), flush_secs=30)

    def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        values = {k: float(np.asarray(v)) for k, v in scalars.items()}
        for k, v in values.items():
            self._writer.add_scalar(k, v, step)
        logging.info("[%d] %s", step, ", ".join(f"{k}={v:.4g}" for k, v in values.items()))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
