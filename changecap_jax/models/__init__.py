"""The models of the trunk, built from their config by name.

``config.model.name`` is one of :data:`MODELS`, or ``"package.module:ClassName"``: a model
that lives outside this package (a research prototype, ``tests/example_model/``) plugs in
with its own file and config, and no edit here (docs/adding_a_model.md).
"""

from __future__ import annotations

import importlib
from typing import Any

import ml_collections

from changecap_jax.errors import UserError
from changecap_jax.models import cheers, contract, dirl, idc_pcl, scorer, subtraction

# Every class here satisfies models/contract.py (tests/test_model_contract.py checks it).
MODELS = {
    "dirl": dirl.DIRLCCR, "scorer": scorer.SCORERCBR, "subtraction": subtraction.Subtraction,
    "cheers": cheers.CHEERS, "idc_pcl": idc_pcl.IDCPCL,
}


class UnknownModelError(UserError, ValueError):
    """``config.model.name`` names no model."""


def model_class(name: str) -> type:
    """The class of ``name``: a key of :data:`MODELS` or ``"package.module:ClassName"``."""
    if name in MODELS:
        return MODELS[name]
    if ":" not in name:
        raise UnknownModelError(f"unknown model {name!r}; known: {sorted(MODELS)}, or "
                                "'package.module:ClassName' for a model outside the trunk")
    module_name, _, class_name = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UnknownModelError(f"model {name!r}: cannot import {module_name}: {e}") from e
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise UnknownModelError(f"model {name!r}: {module_name} has no class {class_name!r}")
    missing = contract.missing_members(cls)
    if missing:
        raise UnknownModelError(f"model {name!r} does not satisfy the model contract "
                                f"(models/contract.py): it lacks {missing}")
    return cls


def build(model_config: ml_collections.ConfigDict, *, vocab_size: int, max_len: int) -> Any:
    """Instantiates the class of ``model_config.name`` with the config's other fields; a
    nested group (a plug-in's fields, e.g. ``model.medic``) comes frozen, so that the model
    stays hashable (it is a static argument of the jitted decoding)."""
    group = dict | ml_collections.ConfigDict
    fields = {k: ml_collections.FrozenConfigDict(v) if isinstance(v, group) else v
              for k, v in dict(model_config).items()}
    return model_class(fields.pop("name"))(vocab_size=vocab_size, max_len=max_len, **fields)
