"""Image Editing Request (Tan et al., ACL 2019) from its official download (datasets.md §4).

Raw layout (airsplay/VisualRelationships ``dataset/adobe/`` plus the image download)::

    train.json, valid.json, test.json   [{"img0": name, "img1": name, "sents": [str, ...],
                                          "uid": str}, ...]
    images/<name>                       the images the entries name (or directly in raw_dir)

The json files are looked for in ``raw_dir``, then ``raw_dir/dataset/adobe/`` (the
repository's path); the images by file name in ``raw_dir/images/`` when that folder exists,
else in ``raw_dir`` itself. ``img0`` is the image to edit, ``img1`` the edited one; file
formats are mixed (jpg, png, JPG, jpeg, gif: a gif's first frame, as RGB).

One record per entry, split ``valid`` stored as ``val``: ``id`` counts the entries of train,
then valid, then test in file order (0 .. 3,938 for the real data); ``image_id`` is the
``uid`` (unique over the three files: a repeat is an error naming both places);
``before`` / ``after_semantic`` are ``img0`` / ``img1``; ``change_captions`` are the ``sents``
as given (1 per train entry, 3 per valid / test entry; the evaluation references are all
``sents`` of the uid, as ``src/evaluate.py``). The same image pair recurs in several entries
and the official splits share images (valid / test: 55 identical pairs), kept as distributed.

Tokeniser and vocabulary as airsplay ``src/tok.py`` / ``script/build_vocab.py``: ``ier``
tokeniser (lower-cased), words of train + valid seen at least 3 times, most frequent first
(808 entries with the 4 specials for the real data), rarer words ``<UNK>`` in every split;
captions capped at 40 tokens with a forced ``<END>`` (``--maxInput 40``). Features: ResNet-101
layer3 (1024 x 14 x 14, as SCORER / DIRL use on IER), from ``features_dir/<image file
name>.npy`` or extracted from the images.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from data_prep.builders import base
from data_prep.builders.base import (
    Annotations,
    BuildError,
    PairDatasetBuilder,
    PairSpec,
    read_entry_list,
)

# official file name -> stored split name, in id order
SPLIT_FILES = {"train": "train", "valid": "val", "test": "test"}
ANNOTATION_DIRS = (".", "dataset/adobe")
KEYS = ("img0", "img1", "sents", "uid")


def read_entries(path: Path) -> list[dict[str, Any]]:
    """One split's json -> its validated entries; errors name file, index, key and values."""
    data = read_entry_list(path, "Image Editing Request annotation file", KEYS,
                           "{" + ", ".join(KEYS) + "}")
    for i, entry in enumerate(data):
        for key in ("img0", "img1", "uid"):
            value = entry[key]
            # Images are looked up by bare file name, so a path would escape the image folder.
            if not isinstance(value, str) or not value or (key != "uid" and (
                    "/" in value or "\\" in value or value in (".", ".."))):
                raise BuildError(f"{path}: entry {i}: key {key!r}: expected a non-empty "
                                 f"{'string' if key == 'uid' else 'file name'}, found {value!r}")
        sents = entry["sents"]
        if not isinstance(sents, list) or not sents or not all(isinstance(s, str) for s in sents):
            raise BuildError(f"{path}: entry {i} (uid {entry['uid']!r}): key 'sents': expected "
                             f"a non-empty list of strings, found {sents!r}")
    return data


def specs_from_entries(entries: Mapping[str, list[dict[str, Any]]],
                       files: Mapping[str, Path] | None = None,
                       image_dir: str = "") -> dict[str, list[PairSpec]]:
    """Official split name -> entries to stored split -> records; ids run over the splits in
    ``SPLIT_FILES`` order, uids must be unique. ``files`` only names the files in errors."""
    files = files or {}
    prefix = f"{image_dir}/" if image_dir else ""
    seen: dict[str, str] = {}
    specs: dict[str, list[PairSpec]] = {}
    next_id = 0
    for name, split in SPLIT_FILES.items():
        specs[split] = []
        for i, entry in enumerate(entries.get(name, [])):
            uid = entry["uid"]
            here = f"{files.get(name, name + '.json')} entry {i}"
            if uid in seen:
                raise BuildError(f"uid {uid!r} is in both {seen[uid]} and {here}; uids must be "
                                 "unique over train, valid and test")
            seen[uid] = here
            specs[split].append(PairSpec(
                id=next_id, image_id=uid,
                images={"before": prefix + entry["img0"],
                        "after_semantic": prefix + entry["img1"]},
                change_captions=list(entry["sents"])))
            next_id += 1
    return specs


def find_annotation_dir(raw_dir: Path) -> Path:
    """``raw_dir`` or ``raw_dir/dataset/adobe``: the first holding an official json file."""
    return base.find_annotation_dir(raw_dir, ANNOTATION_DIRS, tuple(SPLIT_FILES),
                                    "Image Editing Request")


class ImageEditingRequest(PairDatasetBuilder):
    """Image Editing Request: a photo and its edited version, with the editing requests."""

    DEFAULT_LAYER = 3
    TOKENIZER = "ier"
    VOCAB_SPLITS = ("train", "val")
    VOCAB_MIN_COUNT = 3
    VOCAB_ORDER = "frequency"
    DEFAULT_MAX_CAPTION_LEN = 40
    MAIN_METRICS = ("CIDEr",)
    PROTOCOL = ("every test uid (495), one generated request each; references: all 3 sents "
                "of the uid (airsplay src/evaluate.py LangEvaluator)")

    def read_annotations(self, raw_dir: Path) -> Annotations:
        ann_dir = find_annotation_dir(raw_dir)
        files = {name: ann_dir / f"{name}.json" for name in SPLIT_FILES}
        entries = {name: read_entries(path) for name, path in files.items()}
        image_dir = "images" if (raw_dir / "images").is_dir() else ""
        for name, split_entries in entries.items():
            for i, entry in enumerate(split_entries):
                for key in ("img0", "img1"):
                    path = raw_dir / image_dir / entry[key]
                    if not path.is_file():
                        raise BuildError(f"{files[name]}: entry {i} (uid {entry['uid']!r}): "
                                         f"key {key!r} names image {entry[key]!r}, not found "
                                         f"at {path}")
        return Annotations(specs_from_entries(entries, files, image_dir))
