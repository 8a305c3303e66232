"""A new model plugs in with one model file and one config, no edit to the trunk
(issue 23; docs/adding_a_model.md): tests/example_model/ holds a model the package has never
heard of, named ``"package.module:ClassName"`` in its config. It is trained (with its own
auxiliary loss), evaluated from its checkpoint, exported and used for prediction, each
through the trunk's public entry points.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import SMALL
from example_model import config as example_config
from example_model.gated_difference import GatedDifference

from changecap_jax import exported_model, models
from changecap_jax.commands import export, predict
from changecap_jax.data import image_files
from changecap_jax.models import contract
from changecap_jax.trainers import captioning

PACKAGE = Path(__file__).resolve().parents[1] / "changecap_jax"
STEPS = 12


@pytest.fixture(scope="module")
def run(small_synthetic, tmp_path_factory):
    config = example_config.get_config()
    config.dataset.data_dir = str(small_synthetic.directory.parents[2])
    config.dataset.options = dict(SMALL)
    config.update(batch_size=16, eval_batch_size=8, num_train_steps=STEPS, log_every_steps=4,
                  eval_every_steps=1000, checkpoint_every_steps=1000, eval_splits=(),
                  final_eval_splits=("test",), spice="off")
    workdir = tmp_path_factory.mktemp("example") / "workdir"
    trainer = captioning.Trainer(config, workdir)
    results = trainer.train()
    return config, workdir, trainer, results


def test_the_trunk_does_not_know_the_model():
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        assert "GatedDifference" not in text and "gated_difference" not in text, path
    assert models.model_class(example_config.MODEL) is GatedDifference
    assert contract.missing_members(GatedDifference) == []
    assert isinstance(GatedDifference(vocab_size=9, max_len=5), contract.CaptionModel)


def test_trained_with_its_auxiliary_loss(run):
    _, workdir, trainer, results = run
    assert isinstance(trainer.model, GatedDifference)
    steps = [step for step, _ in trainer.history]
    assert steps == list(range(4, STEPS + 1, 4))
    for _, metrics in trainer.history:
        # The total is the mean of the two caption streams plus 0.01 x the model's loss.
        expected = metrics["loss/caption"] + 0.01 * metrics["loss/memory_norm"]
        assert metrics["loss"] == pytest.approx(expected, rel=1e-6)
        assert metrics["loss/memory_norm"] > 0
    assert math.isfinite(results["test"]["CIDEr"])
    assert (workdir / "metrics" / f"test_{STEPS}.json").exists()


def test_evaluated_from_its_checkpoint(run, tmp_path):
    config, workdir, _, results = run
    again = captioning.evaluate_checkpoint(config, workdir)
    assert again["test"]["CIDEr"] == pytest.approx(results["test"]["CIDEr"], abs=1e-9)


def test_exported_and_predicted(run, small_synthetic, tmp_path):
    _, workdir, _, _ = run
    model_dir = export.export_model(workdir, tmp_path / "exported")
    loaded = exported_model.load_exported(model_dir)
    assert loaded.config.model.name == example_config.MODEL and loaded.step == STEPS
    source = small_synthetic.split("test")
    pairs, ids = [], []
    for i in range(len(source)):
        record = source[i]
        paths = image_files.image_paths(small_synthetic, record)
        image_id = record["image_id"].decode()
        pairs += [(paths["before"], paths["after_semantic"]),
                  (paths["before"], paths["after_distractor"])]
        ids += [image_id, image_id + "_n"]
    results = predict.predict_pairs(model_dir, pairs, tmp_path / "out", batch_size=10,
                                    progress=False)
    captions = json.loads((workdir / "captions" / f"test_{STEPS}.json").read_text())
    expected = {c["image_id"]: c["caption"] for c in captions}
    assert {i: r.caption for i, r in zip(ids, results, strict=True)} == expected
    assert np.isclose(np.sum(json.loads(
        (tmp_path / "out" / "pair_0000.json").read_text())["heatmap_after"]), 1.0, atol=1e-4)


def test_a_name_outside_the_trunk_is_checked_before_it_is_built():
    with pytest.raises(models.UnknownModelError, match=r"unknown model 'nope'; known: \["):
        models.model_class("nope")
    with pytest.raises(models.UnknownModelError, match="cannot import no_such_module"):
        models.model_class("no_such_module:Model")
    with pytest.raises(models.UnknownModelError, match="has no class 'Nope'"):
        models.model_class("example_model.gated_difference:Nope")
    # A class that is no model: every contract member it lacks is named (it has a decode).
    with pytest.raises(models.UnknownModelError, match=r"lacks \['MEMORY_LAYOUT', "
                       r"'capabilities', 'streams'.*'init_cache', 'decode_step'\]"):
        models.model_class("json:JSONDecoder")
