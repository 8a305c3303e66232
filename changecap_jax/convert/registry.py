"""The model converters by ``config.model.name``: :func:`converter_for` finds one.

Each model's converter is a module in ``changecap_jax/convert/models/`` that defines
``CONVERTER``, a :class:`~changecap_jax.convert.model_converter.ModelConverter`. Adding one: the
module, and its name in the import line and in ``_MODULES`` below (docs/converters.md). Code
outside the package (a test's example model) can add its own with :func:`register`.
"""

from __future__ import annotations

from changecap_jax.convert.errors import WrongModelError
from changecap_jax.convert.model_converter import ModelConverter
from changecap_jax.convert.models import dirl, idc_pcl, scorer

# config.model.name -> converter.
CONVERTERS: dict[str, ModelConverter] = {}


def register(converter: ModelConverter) -> ModelConverter:
    """Makes ``converter`` the one for ``config.model.name == converter.name``."""
    if converter.name in CONVERTERS and CONVERTERS[converter.name] is not converter:
        raise ValueError(f"a converter for model {converter.name!r} is already registered")
    CONVERTERS[converter.name] = converter
    return converter


def converter_for(model_name: str) -> ModelConverter:
    """The converter of ``model_name``; WrongModelError naming the models that have one."""
    if model_name not in CONVERTERS:
        raise WrongModelError(
            f"no torch checkpoint mapping for model {model_name!r}; models with one: "
            f"{sorted(CONVERTERS)}")
    return CONVERTERS[model_name]


_MODULES = (dirl, scorer, idc_pcl)  # one per model with a converter
for _module in _MODULES:
    register(_module.CONVERTER)
