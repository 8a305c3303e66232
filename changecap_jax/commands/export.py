"""Self-contained exported models: ``python -m changecap_jax export --workdir=DIR --out=DIR``
writes a training (or convert) workdir's checkpoint in the format of
:mod:`changecap_jax.exported_model` (docs/inference.md).

    --workdir=DIR       a training (or convert) workdir with checkpoints/ and config.json
    --out=DIR           the export directory (must not exist, or be empty)
    --step=N            the checkpoint to export (default: the best by val CIDEr if the
                        workdir kept one, else the latest; a damaged one is passed with a
                        warning, a damaged --step is an error)
    --config=FILE       only for workdirs without config.json (written by the trainer and
                        the converter since this feature landed)
    --weights=PATH      ResNet-101 weights to record for a resnet101 extractor (``predict``
                        can also take --weights)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from changecap_jax import cli, compile_cache, experiment
from changecap_jax.exported_model import (
    FORMAT_VERSION,
    ExportError,
    abstract_params,
    extractor_description,
    library_versions,
    load_exported,
    parameter_shapes,
    write_export,
)
from changecap_jax.io import checkpoints, paths, run_config, workdir_lock
from changecap_jax.io.jsonio import read_json


def _check_trained_workdir(workdir: paths.AnyPath) -> None:
    """Errors naming what is missing when ``workdir`` holds no training run."""
    if not workdir.is_dir():
        raise ExportError(f"workdir {workdir} does not exist; pass the --workdir of a training "
                          "run (python -m changecap_jax.main --workdir=...)")
    directory = workdir / checkpoints.CHECKPOINTS_DIR
    if not directory.is_dir() or not any(directory.iterdir()):
        raise ExportError(f"{workdir} holds no checkpoint ({directory} is missing or empty): "
                          "nothing was trained there")
    holder = workdir_lock.live_holder(workdir)
    if holder is not None:
        raise ExportError(f"workdir {workdir} is still being written by its run "
                          f"({holder.describe()}); export it when that run has ended")


def _metrics_at(workdir: paths.AnyPath, step: int) -> dict[str, Any]:
    metrics = {}
    for path in sorted((workdir / "metrics").glob(f"*_{step}.json")):
        split = path.stem[: -len(f"_{step}")]
        metrics[split] = read_json(path, "metrics file")
    return metrics


def export_model(workdir: str | os.PathLike, out: str | os.PathLike, *, step: int | None = None,
                 config: ml_collections.ConfigDict | None = None,
                 weights: str | None = None) -> paths.AnyPath:
    """Writes the export directory ``out`` from a workdir's checkpoint (see the module
    docstring); atomic: a temporary sibling directory renamed at the end."""
    workdir, out = paths.path(workdir), paths.path(out)
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out} exists and is not empty; choose a new --out directory")
    _check_trained_workdir(workdir)  # before the dataset is opened (or built)
    config = config if config is not None else run_config.load_workdir_config(workdir)
    exp = experiment.build(config)
    step, params = _restore_params(workdir, exp, step)
    meta = exp.dataset.meta
    description = {
        "format_version": FORMAT_VERSION,
        "versions": library_versions(),
        "step": int(step),
        "config": json.loads(config.to_json_best_effort()),
        "dataset": {"name": exp.dataset.name, "directory": str(exp.dataset.directory),
                    "meta": dataclasses.asdict(meta)},
        "extractor": extractor_description(meta, weights),
        "metrics": _metrics_at(workdir, step),
        "parameters": {k: list(v) for k, v in
                       parameter_shapes(exp.model, meta, exp.max_len).items()},
    }
    write_export(out, params, exp.dataset.vocab, description)
    logging.info("exported step %d of %s to %s", step, workdir, out)
    return out


def _restore_params(workdir: paths.AnyPath, exp: experiment.Experiment,
                    step: int | None) -> tuple[int, Any]:
    """(step, host parameters) of checkpoint ``step``, or of the best intact one: best val
    CIDEr first, then the unscored ones latest first (``checkpoints.best_first_steps``)."""
    directory = workdir / checkpoints.CHECKPOINTS_DIR
    found = checkpoints.steps(directory)
    if not found:
        raise ExportError(f"no checkpoint in {directory}")
    if step is not None and step not in found:
        raise ExportError(f"no checkpoint of step {step} in {directory}; there are {found}")
    like = abstract_params(exp.model, exp.dataset.meta, exp.max_len)
    try:
        # The step a checkpoint holds is the step it was saved at.
        step, params = checkpoints.restore_params(workdir, like,
                                                  step="best" if step is None else step)
    except checkpoints.CheckpointError as e:
        raise ExportError(str(e)) from None
    return step, jax.device_get(params)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    flags_ = flags.FLAGS
    config = flags_.config if flags_["config"].present else None
    out = export_model(flags_.workdir, flags_.out, step=flags_.step, config=config,
                       weights=flags_.weights)
    exported = load_exported(out)
    print(f"exported {flags_.workdir} step {exported.step} -> {out} "
          f"({sum(np.size(x) for x in jax.tree_util.tree_leaves(exported.params))} parameters, "
          f"extractor {exported.extractor['name']})")


if __name__ == "__main__":
    # The flags exist only when this module is the program (importing it defines none).
    config_flags.DEFINE_config_file("config", None, "Run config (workdirs without config.json).")
    flags.DEFINE_string("workdir", None, "Training or convert workdir.", required=True)
    flags.DEFINE_string("out", None, "Export directory to create.", required=True)
    flags.DEFINE_integer("step", None, "Checkpoint step (default: best by val CIDEr, else latest).")
    flags.DEFINE_string("weights", None, "ResNet-101 weights to record for predict.")
    compile_cache.enable()
    cli.run(main)
