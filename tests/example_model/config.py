"""The config of the example model (tests/example_model/gated_difference.py): the built-in
synthetic dataset and the CPU trainer settings every model's synthetic preset uses.

    PYTHONPATH=tests python -m changecap_jax.main --config=tests/example_model/config.py
"""

from __future__ import annotations

import ml_collections

from configs import common

MODEL = "example_model.gated_difference:GatedDifference"  # "package.module:ClassName"


def get_config(preset: str = "synthetic") -> ml_collections.ConfigDict:
    if preset not in ("", "synthetic"):
        raise ValueError(f"unknown preset {preset!r}; presets: ['synthetic']")
    config = common.trainer_defaults(ml_collections.ConfigDict())
    config.dataset = common.synthetic_dataset("moderate")
    common.cpu_training(config)
    config.model = ml_collections.ConfigDict({
        "name": MODEL, "pairs": "both", "hidden_dim": 32, "num_heads": 2,
        "decoder_layers": 1, "word_dim": 16, "dropout_rate": 0.0})
    config.loss_weights = {"memory_norm": 0.01}
    return config
