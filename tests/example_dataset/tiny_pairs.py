"""A dataset the project has never heard of (docs/adding_a_dataset.md): tiny before/after
pairs, built by ``python -m data_prep.build example_dataset.tiny_pairs:TinyPairs`` and trained
on by name (``tiny_pairs``) without a line of the library changed.

Raw layout::

    pairs.json        {"train" | "val" | "test": [{"before": file, "after": file,
                                                   "captions": [str, ...]}, ...]}
    <file>            every image the entries name (only their presence is checked: the
                      features come from ``features_dir/<file>.npy``, (C, H, W) = (16, 4, 4))
"""

from __future__ import annotations

from pathlib import Path

import tensorflow_datasets as tfds

from data_prep.builders.base import (
    Annotations,
    BuildError,
    PairDatasetBuilder,
    PairSpec,
    load_json,
)

FEATURE_CHW = (16, 4, 4)


class TinyPairs(PairDatasetBuilder):
    """Tiny before/after pairs with their change captions (a test dataset)."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "First release."}
    TOKENIZER = "clevr"  # lower-cased words, punctuation dropped (data/vocab.py)

    @property
    def feature_chw(self) -> tuple[int, int, int]:
        return FEATURE_CHW

    @property
    def extractor_name(self) -> str:
        return "tiny_pairs_features"

    def read_annotations(self, raw_dir: Path) -> Annotations:
        path = raw_dir / "pairs.json"
        entries = load_json(path, "tiny pairs annotation file")
        if not isinstance(entries, dict) or set(entries) != {"train", "val", "test"}:
            raise BuildError(f"{path}: expected keys train, val, test")
        splits, next_id = {}, 0
        for split, rows in entries.items():
            splits[split] = []
            for i, row in enumerate(rows):
                if set(row) != {"before", "after", "captions"}:
                    raise BuildError(f"{path}: {split}[{i}]: expected keys before, after, "
                                     f"captions; found {sorted(row)}")
                splits[split].append(PairSpec(
                    id=next_id, image_id=f"{split}_{i}",
                    images={"before": row["before"], "after_semantic": row["after"]},
                    change_captions=list(row["captions"])))
                next_id += 1
        return Annotations(splits=splits)
