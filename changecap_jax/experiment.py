"""An experiment built from its config, without training it: dataset, model, mesh, lengths.

:func:`build` is what the trainer's start-up does before any optimiser or step exists, and
what export, report, benchmark and evaluation of a checkpoint need to get a model:

* the mesh (default: every device) and the check that both batch sizes divide over it;
* the prepared dataset (``datasets.prepare``, built on first use when the config allows),
  with the model's extra per-pair inputs (e.g. retrieved entities) joined to its records;
* the model (``models.build``), decoding ``config.decode.max_len`` tokens or, when that is 0,
  the dataset's longest caption;
* the steps of one epoch, for the learning-rate schedule.

Restoring a checkpoint into it is ``checkpoints.restore_params`` / ``restore_state``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import ml_collections

from changecap_jax import models, parallel
from changecap_jax.data import datasets
from changecap_jax.models import contract, precision
from changecap_jax.models.base import conditioning_shapes, extra_tokens


@dataclasses.dataclass(frozen=True)
class Experiment:
    """What a config builds before training: see the module docstring."""

    config: ml_collections.ConfigDict
    dataset: datasets.PreparedDataset  # with the model's conditioning attached
    model: Any  # the Flax module
    mesh: Any
    max_len: int  # decoded caption length, START included
    conditioning: dict[str, tuple[int, ...]]  # extra per-pair input -> per-example shape
    extra_tokens: dict[int, str]  # ids beyond the vocabulary with their text, e.g. [MASK]
    compute_dtype: jnp.dtype
    steps_per_epoch: int

    @property
    def streams(self) -> tuple[str, ...]:
        """The caption streams the model trains on ("semantic", maybe "distractor")."""
        return contract.model_streams(self.model)


def build(config: ml_collections.ConfigDict, *, mesh: Any | None = None) -> Experiment:
    """The experiment of ``config`` on ``mesh`` (default ``parallel.make_mesh()``).

    Raises ``datasets.DatasetError`` when the model trains on distractor pairs and the
    dataset has none, and ``parallel``'s error when a batch size does not divide over the mesh.
    """
    mesh = mesh if mesh is not None else parallel.make_mesh()
    parallel.check_global_batch(config.batch_size, mesh)
    parallel.check_global_batch(config.eval_batch_size, mesh, "eval_batch_size")
    dataset = datasets.prepare_config(config.dataset)
    max_len = config.decode.max_len or dataset.meta.max_caption_len
    model = models.build(config.model, vocab_size=len(dataset.vocab), max_len=max_len)
    check = contract.dataset_check(model)
    if check is not None:
        check(dataset.meta)
    conditioning = conditioning_shapes(model)
    dataset = datasets.attach_conditioning(dataset, conditioning)
    streams = contract.model_streams(model)
    if "distractor" in streams and not dataset.meta.has_distractor:
        raise datasets.DatasetError(
            f"the model trains on distractor pairs but dataset {config.dataset.name!r} has "
            f"none; set --config.model.pairs=semantic_only (or use the dataset's preset)")
    num_train = dataset.meta.split_sizes.get("train") or len(dataset.split("train"))
    return Experiment(
        config=config, dataset=dataset, model=model, mesh=mesh, max_len=max_len,
        conditioning=conditioning, extra_tokens=extra_tokens(model),
        compute_dtype=precision.compute_dtype(config.get("compute_dtype", "float32")),
        steps_per_epoch=math.ceil(num_train / config.batch_size))
