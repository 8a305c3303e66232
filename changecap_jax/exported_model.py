"""The exported-model format: a directory ``predict``, ``--mode=eval --model=DIR`` and
``--config.init_from`` read without the training workdir or the dataset (written by
``python -m changecap_jax export``, changecap_jax/commands/export.py; docs/inference.md):

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
"""

from __future__ import annotations

import dataclasses
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

from changecap_jax import models
from changecap_jax.data import schema, streams
from changecap_jax.data.vocab import Vocabulary
from changecap_jax.errors import UserError
from changecap_jax.features import grid
from changecap_jax.io import paths, run_config
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


def write_export(out: paths.AnyPath, params: Any, vocab: Vocabulary,
                  description: dict[str, Any]) -> None:
    """The export directory's files, written into a temporary sibling renamed to ``out``; in a
    bucket, which has no folder rename, written locally and uploaded, model.json last (what
    :func:`load_exported` checks first)."""
    if paths.is_remote(out):
        local = Path(tempfile.mkdtemp(prefix="changecap_export_"))
        try:
            write_export(local / out.name, params, vocab, description)
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
