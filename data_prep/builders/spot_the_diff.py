"""Spot-the-Diff (Jhamtani & Berg-Kirkpatrick, EMNLP 2018), single-change setting (datasets.md §3).

Raw layout (harsh19/spot-the-diff's ``data/`` with the ``resized_images`` download)::

    annotations/{train,val,test}.json   [{"img_id": "<digits>", "sentences": [str, ...]}, ...]
    resized_images/<img_id>.png         before (224 x 224; ``.jpg`` accepted too)
    resized_images/<img_id>_2.png       after  (``.jpg`` accepted too)

``raw_dir`` may be that ``data/`` folder or the repository root; the annotation files are
looked for in ``raw_dir/annotations/``, then ``raw_dir/data/annotations/``, then ``raw_dir``
itself, the images in ``raw_dir/resized_images/``, then ``raw_dir/data/resized_images/``.

Each json entry is ONE annotator's list of difference sentences; an ``img_id`` may have 2-3
entries. Records, as SCORER / DIRL evaluate the single-change setting:

* one record per unique ``img_id`` per split, in order of first appearance; ``id`` is
  ``int(img_id)``, ``image_id`` the bare ``img_id`` string (the official COCO ground truth's
  ``image_id``). Ids must be disjoint across splits.
* ``change_captions`` (stored text, the evaluation references) = every sentence of every entry
  of the id, exactly as ``code/predictions/ddla_rerun_gtfile.json`` has them
  (:func:`official_references`). That file keeps the empty sentences: all 7 of the test split
  are ``""`` (none is whitespace-only) and each is the only sentence of its id, so 7 of the
  1,270 test ids have the single reference ``""``; 2,107 references in all.
* ``change_caption_ids`` (training targets) = the sentences that are not empty after
  ``.strip()``. A train / val id without any is skipped and counted (train 37, val 4 in the
  real data). A test id without any is KEPT, so the official 1,270 test ids are all
  evaluated: its target is the single placeholder :data:`NO_SENTENCE_TARGET` (``<UNK>``,
  encoded ``<START> <UNK> <END>``), never used for training (the test split is not trained
  on) while its references stay ``[""]`` as in the official file.
* ``annotation_index`` (N,) int32, aligned with ``change_captions``: which entry (annotator,
  0, 1, ... in file order) of the id each sentence came from, so the multi-sentence paragraph
  setting (CARD's ``". "``-joined paragraphs) can be derived from the records.

Tokeniser and vocabulary as SCORER / DIRL: the CLEVR tokeniser (a double space gives an
empty-string token, as the official one), every word of the train targets, threshold 1,
sorted; captions padded to the longest over all splits. Features: ResNet-101 layer3
(1024 x 14 x 14), from ``features_dir/<image file name>.npy`` (flat or under
``resized_images/``) or extracted from the images.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from data_prep.builders import base
from data_prep.builders.base import (
    SPLITS,
    Annotations,
    BuildError,
    PairDatasetBuilder,
    PairSpec,
    read_entry_list,
    skip,
)

ANNOTATION_DIRS = ("annotations", "data/annotations", ".")
IMAGE_DIRS = ("resized_images", "data/resized_images")
IMAGE_EXTENSIONS = (".png", ".jpg")  # as airsplay's process_dataset_spotdiff.py accepts
# The token target of a test id whose sentences are all empty (kept for evaluation only).
NO_SENTENCE_TARGET = "<UNK>"
_IMG_ID = re.compile(r"0|[1-9][0-9]*")  # canonical digits: "<img_id>.png" and int() agree


def read_entries(path: Path) -> list[dict[str, Any]]:
    """One split's json -> its validated entries; errors name file, index, key and values."""
    data = read_entry_list(path, "Spot-the-Diff annotation file", ("img_id", "sentences"),
                           "{'img_id', 'sentences'}")
    for i, entry in enumerate(data):
        img_id = entry["img_id"]
        if not isinstance(img_id, str) or not _IMG_ID.fullmatch(img_id):
            raise BuildError(f"{path}: entry {i}: key 'img_id': expected a string of digits "
                             f"such as '400', found {img_id!r}")
        sentences = entry["sentences"]
        if (not isinstance(sentences, list) or not sentences
                or not all(isinstance(s, str) for s in sentences)):
            raise BuildError(f"{path}: entry {i} (img_id {img_id}): key 'sentences': expected "
                             f"a non-empty list of strings, found {sentences!r}")
    return data


def group_entries(entries: Sequence[Mapping[str, Any]]) -> dict[str, list[list[str]]]:
    """img_id -> its entries' sentence lists, ids in order of first appearance."""
    groups: dict[str, list[list[str]]] = {}
    for entry in entries:
        groups.setdefault(entry["img_id"], []).append(list(entry["sentences"]))
    return groups


def official_references(entries: Sequence[Mapping[str, Any]]) -> dict[str, list[str]]:
    """img_id -> references as the official ``ddla_rerun_gtfile.json`` holds them: every
    sentence (empty ones included) of every entry of the id, entries in file order."""
    return {img_id: [s for sentences in groups for s in sentences]
            for img_id, groups in group_entries(entries).items()}


def specs_from_entries(
    entries: dict[str, list[dict[str, Any]]], files: Mapping[str, Path] | None = None,
    image_dir: str = "resized_images",
) -> tuple[dict[str, list[PairSpec]], dict[str, int]]:
    """Split -> entries to split -> records (images named ``.png``) and the skip counts.

    ``files`` (split -> annotation path) only names the files in errors.
    """
    files = files or {}
    seen: dict[str, str] = {}
    specs: dict[str, list[PairSpec]] = {}
    skipped: dict[str, int] = {}
    for split, split_entries in entries.items():
        references = official_references(split_entries)
        specs[split] = []
        kept_without_text = 0
        for img_id, groups in group_entries(split_entries).items():
            if img_id in seen:
                raise BuildError(
                    f"img_id {img_id!r} is in both {files.get(seen[img_id], seen[img_id])} and "
                    f"{files.get(split, split)}; Spot-the-Diff splits must be disjoint")
            seen[img_id] = split
            refs = references[img_id]
            targets = [s for s in refs if s.strip()]
            if not targets:
                if split != "test":
                    skip(skipped, f"{split} img_ids whose sentences are all empty")
                    continue
                # Keep the official test id; the placeholder target is never trained on.
                targets = [NO_SENTENCE_TARGET]
                kept_without_text += 1
            annotation_index = np.array(
                [k for k, sentences in enumerate(groups) for _ in sentences], np.int32)
            specs[split].append(PairSpec(
                id=int(img_id), image_id=img_id,
                images={"before": f"{image_dir}/{img_id}.png",
                        "after_semantic": f"{image_dir}/{img_id}_2.png"},
                change_captions=targets, references=refs,
                extra={"annotation_index": annotation_index}))
        if kept_without_text:
            logging.warning("spot_the_diff: %d %s img_id(s) have only empty sentences; kept "
                            "with references [''] and the target %r", kept_without_text,
                            split, NO_SENTENCE_TARGET)
    return specs, skipped


def find_annotation_dir(raw_dir: Path) -> Path:
    """The first of ``annotations/``, ``data/annotations/``, ``raw_dir`` with a split file."""
    return base.find_annotation_dir(raw_dir, ANNOTATION_DIRS, SPLITS, "Spot-the-Diff")


def find_image_root(raw_dir: Path) -> Path:
    """The folder holding ``resized_images/``: raw_dir itself or its ``data/`` sub-folder."""
    for sub in IMAGE_DIRS:
        if (raw_dir / sub).is_dir():
            return (raw_dir / sub).parent
    looked = ", ".join(str(raw_dir / sub) for sub in IMAGE_DIRS)
    raise BuildError(f"no Spot-the-Diff image folder: none of {looked} exists")


def resolve_image(root: Path, rel: str, where: str) -> str:
    """``<name>.png`` if it exists, else ``<name>.jpg``; an error names both."""
    stem = rel.rsplit(".", 1)[0]
    for ext in IMAGE_EXTENSIONS:
        if (root / (stem + ext)).is_file():
            return stem + ext
    tried = " or ".join(str(root / (stem + ext)) for ext in IMAGE_EXTENSIONS)
    raise BuildError(f"spot_the_diff: {where} needs image {tried}, which does not exist")


class SpotTheDiff(PairDatasetBuilder):
    """Spot-the-Diff: before / after street-scene frames with annotators' difference sentences."""

    DEFAULT_LAYER = 3
    TOKENIZER = "clevr"
    VOCAB_SPLITS = ("train",)
    VOCAB_MIN_COUNT = 1
    VOCAB_ORDER = "sorted"
    DEFAULT_MAX_CAPTION_LEN = 0
    MAIN_METRICS = ("CIDEr",)
    PROTOCOL = ("every test img_id (1,270), one generated sentence each; references: every "
                "sentence of every annotator entry of the id, empty ones included (official "
                "code/predictions/ddla_rerun_gtfile.json, image_id = bare img_id)")

    def extra_features(self) -> dict[str, tfds.features.FeatureConnector]:
        return {"annotation_index": tfds.features.Tensor(shape=(None,), dtype=np.int32)}

    def read_annotations(self, raw_dir: Path) -> Annotations:
        ann_dir = find_annotation_dir(raw_dir)
        files = {split: ann_dir / f"{split}.json" for split in SPLITS}
        entries = {split: read_entries(path) for split, path in files.items()}
        root = find_image_root(raw_dir)
        self.raw_dir = root  # image paths are relative to the folder of resized_images/
        specs, skipped = specs_from_entries(entries, files)
        for split, split_specs in specs.items():
            for spec in split_specs:
                where = f"{split} img_id {spec.image_id!r} ({files[split].name})"
                spec.images = {key: resolve_image(root, rel, where)
                               for key, rel in spec.images.items()}
        return Annotations(specs, [], skipped)
