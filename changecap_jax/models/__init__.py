"""The models of the trunk, built from their config by name."""

from __future__ import annotations

import ml_collections

from changecap_jax.models.cheers import CHEERS
from changecap_jax.models.dirl import DIRLCCR
from changecap_jax.models.idc_pcl import IDCPCL
from changecap_jax.models.scorer import SCORERCBR
from changecap_jax.models.subtraction import Subtraction

MODELS = {
    "dirl": DIRLCCR, "scorer": SCORERCBR, "subtraction": Subtraction, "cheers": CHEERS,
    "idc_pcl": IDCPCL,
}


def build(model_config: ml_collections.ConfigDict, *, vocab_size: int, max_len: int):
    """Instantiates ``MODELS[model_config.name]`` with the config's other fields."""
    fields = dict(model_config)
    name = fields.pop("name")
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    return MODELS[name](vocab_size=vocab_size, max_len=max_len, **fields)
