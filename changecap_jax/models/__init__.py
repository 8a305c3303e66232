"""The models of the trunk, built from their config by name."""

from __future__ import annotations

import ml_collections

from changecap_jax.models import cheers, dirl, idc_pcl, scorer, subtraction

# Every class here satisfies models/contract.py (tests/test_model_contract.py checks it).
MODELS = {
    "dirl": dirl.DIRLCCR, "scorer": scorer.SCORERCBR, "subtraction": subtraction.Subtraction,
    "cheers": cheers.CHEERS, "idc_pcl": idc_pcl.IDCPCL,
}


def build(model_config: ml_collections.ConfigDict, *, vocab_size: int, max_len: int):
    """Instantiates ``MODELS[model_config.name]`` with the config's other fields."""
    fields = dict(model_config)
    name = fields.pop("name")
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    return MODELS[name](vocab_size=vocab_size, max_len=max_len, **fields)
