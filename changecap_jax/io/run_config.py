"""A run's config in its workdir: ``<workdir>/config.json``, written when training starts and
read back by ``export``, ``report`` and ``--mode=eval --model``."""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import ml_collections

from changecap_jax.errors import UserError
from changecap_jax.io import paths
from changecap_jax.io.jsonio import read_json, write_json_atomic

CONFIG_FILE = "config.json"  # in a workdir: the run's config, written by the trainer


class RunConfigError(UserError, FileNotFoundError):
    """A workdir without its config.json."""


def save_config(workdir: str | os.PathLike, config: ml_collections.ConfigDict) -> None:
    """Writes a run's config as ``<workdir>/config.json`` (process 0 only)."""
    if jax.process_index() == 0:
        write_json_atomic(paths.path(workdir) / CONFIG_FILE,
                          json.loads(config.to_json_best_effort()), indent=1)


def config_from_json(data: dict[str, Any]) -> ml_collections.ConfigDict:
    """A config read back from JSON; lists become tuples again (JSON has no tuples)."""

    def tuples(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: tuples(v) for k, v in x.items()}
        if isinstance(x, list):
            return tuple(tuples(v) for v in x)
        return x

    return ml_collections.ConfigDict(tuples(data))


def load_workdir_config(workdir: str | os.PathLike) -> ml_collections.ConfigDict:
    path = paths.path(workdir) / CONFIG_FILE
    if not path.exists():
        raise RunConfigError(f"{path} does not exist: this workdir predates config.json; pass "
                          f"the run's config with --config=configs/MODEL.py[:PRESET]")
    return config_from_json(read_json(path, "run config"))
