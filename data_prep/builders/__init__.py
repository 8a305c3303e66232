"""TFDS builders of the real datasets, one module each; see ``data_prep.build``.

:data:`BUILDERS` is the one place a dataset name is registered (docs/adding_a_dataset.md): the
build command looks its builder up here, and the library reads a built dataset by its name
from ``<data_dir>/<name>/<variant>/<version>/`` without a list of its own. A builder outside
the package is named ``"package.module:ClassName"`` instead of a registered name.
"""

from __future__ import annotations

import importlib

from data_prep.builders.base import PairDatasetBuilder

# dataset name -> "module:Class" (imported on use, so one dataset's reader never loads another)
BUILDERS = {
    "clevr_change": "data_prep.builders.clevr_change:ClevrChange",
    "clevr_dc": "data_prep.builders.clevr_dc:ClevrDC",
    "spot_the_diff": "data_prep.builders.spot_the_diff:SpotTheDiff",
    "image_editing_request": "data_prep.builders.image_editing_request:ImageEditingRequest",
    "birds_to_words": "data_prep.builders.birds_to_words:BirdsToWords",
}


def builder_class(name: str) -> type[PairDatasetBuilder]:
    """The builder of a registered dataset name, or of ``"package.module:ClassName"``."""
    if ":" not in name and name not in BUILDERS:
        raise KeyError(f"no builder for dataset {name!r}; available: {sorted(BUILDERS)} (or "
                       "name one as package.module:ClassName)")
    module, cls = BUILDERS.get(name, name).split(":")
    try:
        found = getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as e:
        raise KeyError(f"cannot import the builder {name!r}: {e}") from e
    if not (isinstance(found, type) and issubclass(found, PairDatasetBuilder)):
        raise KeyError(f"{name!r} is not a PairDatasetBuilder (data_prep/builders/base.py)")
    return found
