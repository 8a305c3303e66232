"""Every model config offers a preset per real dataset, each selecting that dataset."""

from __future__ import annotations

import importlib

import pytest

from changecap_jax import models
from data_prep import builders

CONFIGS = ("dirl", "scorer", "subtraction")


@pytest.mark.parametrize("config_name", CONFIGS)
@pytest.mark.parametrize("preset", sorted(builders.BUILDERS))
def test_paper_presets_select_their_dataset(config_name, preset):
    module = importlib.import_module(f"configs.{config_name}")
    config = module.get_config(preset)
    assert config.dataset.name == preset
    assert not config.dataset.build_if_missing  # real datasets are built by data_prep.build
    assert config.finish_last_epoch  # the official loop's iteration count
    assert config.model.name == config_name
    # Datasets without distractor images train on the semantic pair only.
    distractors = preset == "clevr_change"
    assert (config.model.pairs == "both") == distractors
    models.build(config.model, vocab_size=20, max_len=12)  # the fields are the model's


@pytest.mark.parametrize("config_name", CONFIGS)
def test_unknown_preset_lists_the_presets(config_name):
    module = importlib.import_module(f"configs.{config_name}")
    with pytest.raises(ValueError, match="spot_the_diff"):
        module.get_config("spot-the-diff")


def test_the_quickstart_preset_is_the_synthetic_one_with_its_budget():
    from flax import traverse_util

    from configs import dirl

    quick, synthetic = (traverse_util.flatten_dict(dirl.get_config(p).to_dict(), sep=".")
                        for p in ("quickstart", "synthetic"))
    changed = {k for k in quick.keys() | synthetic.keys() if quick.get(k) != synthetic.get(k)}
    assert changed == {"num_train_steps", "optim.learning_rate", "eval_every_steps",
                       "checkpoint_every_steps", "final_eval_splits", "dataset.on_device",
                       "loss_weights.dirl", "loss_weights.ccr"}
    assert quick["eval_every_steps"] == quick["num_train_steps"]  # one evaluation, at the end
    # Its ablations apply as on the synthetic preset.
    assert "ccr" not in dirl.get_config("quickstart/dirl").loss_weights
