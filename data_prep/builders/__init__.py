"""TFDS builders of the real datasets, one module each; see ``data_prep.build``."""

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
    if name not in BUILDERS:
        raise KeyError(f"no builder for dataset {name!r}; available: {sorted(BUILDERS)}")
    module, cls = BUILDERS[name].split(":")
    return getattr(importlib.import_module(module), cls)
