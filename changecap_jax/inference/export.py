"""Self-contained exported models: ``python -m changecap_jax export --workdir=DIR --out=DIR``.

An exported directory holds everything ``predict`` and ``--mode=eval --model=DIR`` need,
without the training workdir or the dataset:

* ``model.json``: format version, the library versions that wrote it, the training config,
  the checkpoint step, the training data's metadata (feature shape, caption length, change
  types, tokenizer), the feature extractor to use on new images, the metrics the checkpoint
  reached (every ``metrics/<split>_<step>.json`` of the workdir at that step) and the shape of
  every parameter;
* ``params.msgpack``: the parameters (``flax.serialization``; no optimiser state);
* ``vocab.json``: the vocabulary.

Loading checks the format version, compares the library versions (a different jax / flax
only warns: parameters are plain arrays), rebuilds the model from the config and checks every
parameter's presence and shape, naming what is wrong.

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
import shutil
import tempfile
from pathlib import Path
from typing import Any

import flax
import jax
import ml_collections
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from changecap_jax import cli, compile_cache, experiment, models
from changecap_jax.data import schema, streams
from changecap_jax.data.vocab import Vocabulary
from changecap_jax.errors import UserError
from changecap_jax.features import grid
from changecap_jax.io import checkpoints, paths, run_config, workdir_lock
from changecap_jax.io.jsonio import read_json, staging_dir, write_json_atomic
from changecap_jax.models import contract
from changecap_jax.models.base import conditioning_shapes

FORMAT_VERSION = 1
MODEL_FILE = "model.json"
PARAMS_FILE = "params.msgpack"
VOCAB_FILE = "vocab.json"


class ExportError(UserError, ValueError):
    """A workdir that cannot be exported or an exported directory that cannot be loaded."""


def library_versions() -> dict[str, str]:
    return {"jax": jax.__version__, "flax": flax.__version__, "numpy": np.__version__}


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


# ---------------------------------------------------------------------------------------------
# The exported model
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ExportedModel:
    """An exported model, loaded: build the Flax module with :meth:`module`."""

    directory: paths.AnyPath
    config: ml_collections.ConfigDict
    params: Any
    vocab: Vocabulary
    meta: schema.DatasetMeta
    extractor: dict[str, Any]
    metrics: dict[str, Any]
    step: int

    @property
    def max_len(self) -> int:
        return int(self.config.decode.max_len or self.meta.max_caption_len)

    def module(self) -> Any:
        return models.build(self.config.model, vocab_size=len(self.vocab), max_len=self.max_len)

    @property
    def variables(self) -> dict[str, Any]:
        return {"params": self.params}


def extractor_description(meta: schema.DatasetMeta, weights: str | None = None) -> dict[str, Any]:
    """How to turn a new image into the model's input features, from the training data's
    metadata (``meta.extractor``)."""
    name = meta.extractor
    versions = {n: v for v, n in grid.NAMES.items()}
    if name in versions:
        return {"name": "synthetic_grid", "version": versions[name],
                "feature_shape": list(meta.feature_shape),
                "image_size": list(meta.image_size) if meta.image_size else None}
    if name.startswith("resnet101_layer"):
        layer = int(name[len("resnet101_layer")])
        return {"name": "resnet101", "layer": layer, "std_fix": name.endswith("_stdfix"),
                "feature_shape": list(meta.feature_shape),
                "weights": str(Path(weights).resolve()) if weights else None}
    return {"name": name or "unknown", "feature_shape": list(meta.feature_shape)}


def example_batch(model: Any, meta: schema.DatasetMeta, max_len: int) -> dict[str, Any]:
    """Zeros shaped like one training example of every stream the model trains on."""
    return streams.example_batch(contract.model_streams(model), tuple(meta.feature_shape),
                                 max_len, conditioning=conditioning_shapes(model), start_id=2)


def abstract_params(model: Any, meta: schema.DatasetMeta, max_len: int) -> Any:
    """The parameter tree of ``model`` on data of ``meta``, as ``jax.ShapeDtypeStruct`` leaves
    (no compute): what ``checkpoints.restore_params`` restores into."""
    batch = example_batch(model, meta, max_len)
    return jax.eval_shape(
        lambda b: model.init({"params": jax.random.key(0)}, b, train=False), batch)["params"]


def parameter_shapes(model: Any, meta: schema.DatasetMeta, max_len: int) -> dict[str, tuple]:
    """'/'-joined parameter path -> shape, for ``model`` on data of ``meta`` (no compute)."""
    shapes = abstract_params(model, meta, max_len)
    return {"/".join(k): tuple(v.shape)
            for k, v in flax.traverse_util.flatten_dict(shapes).items()}


def check_parameters(params: Any, expected: dict[str, tuple], where: str) -> None:
    """Every expected parameter present with its shape, nothing else; raises naming each."""
    found = {"/".join(k): tuple(np.shape(v))
             for k, v in flax.traverse_util.flatten_dict(params).items()}
    problems = [f"missing parameter {k} {expected[k]}" for k in sorted(set(expected) - set(found))]
    problems += [f"unexpected parameter {k} {found[k]}" for k in sorted(set(found) - set(expected))]
    problems += [f"parameter {k} has shape {found[k]}, the model expects {expected[k]}"
                 for k in sorted(set(found) & set(expected)) if found[k] != expected[k]]
    if problems:
        raise ExportError(f"{where}: the parameters do not fit the model of its config:\n  "
                          + "\n  ".join(problems))


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------


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
    _write_export(out, params, exp.dataset.vocab, description)
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


def _write_export(out: paths.AnyPath, params: Any, vocab: Vocabulary,
                  description: dict[str, Any]) -> None:
    """The export directory's files, written into a temporary sibling renamed to ``out``; in a
    bucket, which has no folder rename, written locally and uploaded, model.json last (what
    :func:`load_exported` checks first)."""
    if paths.is_remote(out):
        local = Path(tempfile.mkdtemp(prefix="changecap_export_"))
        try:
            _write_export(local / out.name, params, vocab, description)
            paths.upload(local / out.name, out, "the exported model", last=(MODEL_FILE,))
        finally:
            shutil.rmtree(local, ignore_errors=True)
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = staging_dir(out.parent, out.name)
    try:
        (tmp / PARAMS_FILE).write_bytes(flax.serialization.msgpack_serialize(
            jax.tree_util.tree_map(np.asarray, params)))
        vocab.save(tmp / VOCAB_FILE)
        write_json_atomic(tmp / MODEL_FILE, description, indent=1)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ---------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------


def load_exported(directory: str | os.PathLike) -> ExportedModel:
    """Reads and checks an export directory (see the module docstring); local or in a
    bucket."""
    directory = paths.path(directory)
    if not directory.is_dir():
        raise ExportError(f"{directory} is not a directory (an exported model is a directory "
                          f"made by python -m changecap_jax export)")
    for name in (MODEL_FILE, PARAMS_FILE, VOCAB_FILE):
        if not (directory / name).is_file():
            raise ExportError(f"{directory} is not a complete exported model: {name} is missing")
    desc = read_json(directory / MODEL_FILE, "exported model description")
    version = desc.get("format_version")
    if not isinstance(version, int):
        raise ExportError(f"{directory / MODEL_FILE}: no integer format_version")
    if version > FORMAT_VERSION:
        raise ExportError(f"{directory} was exported in format {version} by a newer "
                          f"changecap_jax; this one reads format {FORMAT_VERSION}: upgrade")
    missing = [k for k in ("step", "config", "dataset", "extractor", "parameters") if k not in desc]
    if missing:
        raise ExportError(f"{directory / MODEL_FILE} lacks {missing}")
    for lib, have in library_versions().items():
        wrote = desc.get("versions", {}).get(lib)
        if wrote and wrote.split(".")[:2] != have.split(".")[:2]:
            logging.warning("%s was exported with %s %s; this is %s %s", directory, lib, wrote,
                            lib, have)
    try:
        meta = schema.DatasetMeta(**desc["dataset"]["meta"])
    except TypeError as e:
        raise ExportError(f"{directory / MODEL_FILE}: dataset.meta is malformed: {e}") from e
    meta.feature_shape = tuple(meta.feature_shape)
    if meta.image_size is not None:
        meta.image_size = tuple(meta.image_size)
    vocab = Vocabulary.load(directory / VOCAB_FILE, meta.tokenizer)
    config = run_config.config_from_json(desc["config"])
    try:
        params = flax.serialization.msgpack_restore((directory / PARAMS_FILE).read_bytes())
    except Exception as e:  # msgpack raises several types on corrupt data
        raise ExportError(f"{directory / PARAMS_FILE} cannot be read: {e}") from e
    exported = ExportedModel(directory=directory, config=config, params=params, vocab=vocab,
                             meta=meta, extractor=dict(desc["extractor"]),
                             metrics=dict(desc.get("metrics", {})), step=int(desc["step"]))
    recorded = {k: tuple(v) for k, v in desc["parameters"].items()}
    expected = parameter_shapes(exported.module(), meta, exported.max_len)
    if recorded != expected:
        raise ExportError(
            f"{directory}: the model its config builds here ({config.model.name}) has other "
            f"parameters than the exported one; differing: "
            f"{sorted(set(recorded.items()) ^ set(expected.items()))[:8]}")
    check_parameters(params, expected, str(directory / PARAMS_FILE))
    return exported


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
