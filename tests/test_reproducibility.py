"""The README's reproducibility claim: the same config and seed on the same machine give the
same metrics and captions to the digit (here: two tiny training runs with an evaluation, each
with its own trainer, hence its own compiles and data loaders). Across CPUs the figures differ
a little (XLA picks kernels by instruction set): README, "Quick start"."""

from __future__ import annotations

import json

import pytest
from train_helpers import SMALL, tiny_config

from changecap_jax import parallel
from changecap_jax.data import datasets
from changecap_jax.io import metric_writer
from changecap_jax.trainers import captioning


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("repro_data")
    datasets.prepare("synthetic", root, "moderate", SMALL)
    return str(root)


def _run(data_dir, workdir):
    config = tiny_config(data_dir, num_train_steps=4, eval_every_steps=4,
                         final_eval_splits=("val",), spice="off")
    captioning.Trainer(config, workdir, mesh=parallel.make_mesh(1)).train()
    metrics = json.loads((workdir / "metrics" / "val_4.json").read_text())
    captions = json.loads((workdir / "captions" / "val_4.json").read_text())
    scalars = (workdir / metric_writer.SCALARS_FILE).read_text().splitlines()
    return metrics, captions, [{k: v for k, v in json.loads(line).items()
                                if k not in metric_writer.TIMING_SCALARS} for line in scalars]


def test_same_seed_same_machine_same_digits(data_dir, tmp_path):
    first = _run(data_dir, tmp_path / "a")
    second = _run(data_dir, tmp_path / "b")
    metrics, captions, losses = first
    assert metrics["num_pairs"] > 0 and len(losses) >= 4 and captions
    assert second == first  # every metric, caption and logged loss, exactly
