"""CLEVR-Change (Park et al., ICCV 2019) from its official download (datasets.md §1).

Raw layout (the ``data/`` folder of ``clevr_change.tar.gz``; ``raw_dir`` may be that folder
or its parent)::

    images/CLEVR_default_%06d.png       before
    sc_images/CLEVR_semantic_%06d.png   after, semantic change     -> change_captions.json
    nsc_images/CLEVR_nonsemantic_%06d.png  after, distractors only -> no_change_captions.json
    change_captions.json, no_change_captions.json   {"CLEVR_default_%06d.png": [captions]}
    splits.json        {"train": [int], "val": [...], "test": [...]}
    type_mapping.json  {"color": ["%06d.png", ...], "material": ..., "move", "drop", "add"}

One record per id of ``splits.json`` with both pairs. Ids with images but in neither
``splits.json`` nor ``type_mapping.json`` (197 in the real data) are skipped and counted; an
id in only one of the two, or one without captions or images, is an error. Tokeniser and
vocabulary as SCORER / DIRL (train change + no-change captions, threshold 1, sorted); captions
padded to the longest over all splits (24 tokens for the real data). Features: ResNet-101
layer3 (1024 x 14 x 14), or the official ``features/``, ``sc_features/``, ``nsc_features/``
folders of ``<png name>.npy``.

When the download's ``change_captions_with_bbox.json`` and ``change_captions_by_IOU.json`` are
present, every record also carries the changed object's boxes (``bbox_before``,
``bbox_after``: [x, y, w, h] px, -1 where absent) and the semantic pair's viewpoint-change IoU
(``viewpoint_iou_semantic``; ``viewpoint_iou_distractor`` is NaN, the file has none), which the
difficulty-binned evaluation and its pointing game read (docs/evaluation.md); ``meta.json``
then records the (H, W) image size the boxes refer to (``clevr_change_boxes.py``). Without the
files the records and their spec are those of version 1.1.0.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import tensorflow_datasets as tfds

from changecap_jax.data.synthetic.scenes import CHANGE_TYPES
from data_prep.builders import clevr_change_boxes as boxes
from data_prep.builders.base import (
    SPLITS,
    Annotations,
    BuildError,
    PairDatasetBuilder,
    PairSpec,
    load_json,
)

IMAGE_PATTERN = re.compile(r"^CLEVR_default_(\d+)\.png$")


def read_splits(path: Path) -> dict[str, list[int]]:
    """``splits.json`` -> split name -> ids; checks keys, types and disjointness."""
    data = load_json(path, "split file")
    if not isinstance(data, dict) or set(data) != set(SPLITS):
        found = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise BuildError(f"{path}: expected keys {list(SPLITS)}, found {found}")
    seen: dict[int, str] = {}
    for split in SPLITS:
        for i in data[split]:
            if not isinstance(i, int):
                raise BuildError(f"{path}: {split!r} holds {i!r}; ids must be integers")
            if i in seen:
                raise BuildError(f"{path}: id {i} is in both {seen[i]!r} and {split!r}")
            seen[i] = split
    return {s: list(data[s]) for s in SPLITS}


def read_type_mapping(path: Path) -> dict[int, int]:
    """``type_mapping.json`` -> id -> index into CHANGE_TYPES."""
    data = load_json(path, "type mapping")
    if not isinstance(data, dict) or set(data) != set(CHANGE_TYPES):
        found = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise BuildError(f"{path}: expected keys {sorted(CHANGE_TYPES)}, found {found}")
    out: dict[int, int] = {}
    for ctype, names in data.items():
        for name in names:
            m = re.fullmatch(r"(\d+)\.png", str(name))
            if not m:
                raise BuildError(f"{path}: {ctype!r} holds {name!r}, expected '%06d.png'")
            i = int(m.group(1))
            if i in out:
                raise BuildError(f"{path}: id {i} has two types")
            out[i] = CHANGE_TYPES.index(ctype)
    return out


def read_captions(path: Path, what: str) -> dict[int, list[str]]:
    data = load_json(path, what)
    if not isinstance(data, dict):
        raise BuildError(f"{path}: expected an object of image name -> captions")
    out = {}
    for name, captions in data.items():
        m = IMAGE_PATTERN.match(name)
        if not m:
            raise BuildError(f"{path}: key {name!r} is not 'CLEVR_default_%06d.png'")
        if not isinstance(captions, list) or not captions:
            raise BuildError(f"{path}: {name!r} must map to a non-empty list of captions")
        out[int(m.group(1))] = [str(c) for c in captions]
    return out


def resolve_raw_dir(raw_dir: Path, marker: str) -> Path:
    """The folder holding ``marker``: raw_dir itself or its ``data/`` sub-folder."""
    if not (raw_dir / marker).exists() and (raw_dir / "data" / marker).exists():
        return raw_dir / "data"
    return raw_dir


def check_annotated_ids(raw_dir: Path, splits: dict[str, list[int]], types: dict[int, int],
                         captions: dict[str, dict[int, list[str]]]) -> set[int]:
    """The ids of ``splits.json``; each must have a type, and every captioned id a split."""
    split_ids = {i for ids in splits.values() for i in ids}
    for i in sorted(split_ids ^ set(types))[:1]:
        where = "splits.json" if i in split_ids else "type_mapping.json"
        other = "type_mapping.json" if i in split_ids else "splits.json"
        raise BuildError(f"{raw_dir}: id {i} ('{i:06d}.png') is in {where} but not in "
                         f"{other}")
    for fname, by_id in captions.items():
        outside = sorted(set(by_id) - split_ids)
        if outside:
            raise BuildError(f"{raw_dir / fname}: {len(outside)} captioned id(s) are in "
                             f"no split of splits.json, e.g. CLEVR_default_"
                             f"{outside[0]:06d}.png")
    return split_ids


def pair_spec(raw_dir: Path, i: int, split: str, types: dict[int, int],
              captions: dict[str, dict[int, list[str]]]) -> PairSpec:
    """The record of id ``i``: its three images, both pairs' captions and its change type."""
    name = f"CLEVR_default_{i:06d}.png"
    for fname, by_id in captions.items():
        if i not in by_id:
            raise BuildError(f"{raw_dir / fname}: no captions for {name} ({split} id {i})")
    return PairSpec(
        id=i, image_id=f"{i:06d}.png",
        images={"before": f"images/{name}",
                "after_semantic": f"sc_images/CLEVR_semantic_{i:06d}.png",
                "after_distractor": f"nsc_images/CLEVR_nonsemantic_{i:06d}.png"},
        change_captions=captions["change_captions.json"][i],
        no_change_captions=captions["no_change_captions.json"][i],
        change_type=types[i])


class ClevrChange(PairDatasetBuilder):
    """CLEVR-Change: before / semantic-after / distractor-after triplets.

    Beside the base builder's arguments: ``image_size`` (H, W), what the boxes of
    ``change_captions_with_bbox.json`` refer to when the raw directory has no before image to
    read it from (default: CLEVR's render size, ``clevr_change_boxes.CLEVR_IMAGE_SIZE``).
    """

    VERSION = tfds.core.Version("1.2.0")
    RELEASE_NOTES = {
        **PairDatasetBuilder.RELEASE_NOTES,
        "1.2.0": "Records carry bbox_before / bbox_after and viewpoint_iou_semantic / "
                 "viewpoint_iou_distractor when the raw download has "
                 "change_captions_with_bbox.json / change_captions_by_IOU.json; meta.json "
                 "then records image_size. Unchanged without those files.",
    }
    HAS_DISTRACTOR = True
    PROTOCOL = ("both pairs of every test id (semantic '%06d.png', distractor '%06d.png_n'); "
                "references: all captions of the pair; rows total / semantic / no-change and "
                "per change type (SCORER / DIRL evaluate.py)")
    FEATURE_SUBDIRS = {"images": "features", "sc_images": "sc_features",
                       "nsc_images": "nsc_features"}

    def __init__(self, *, image_size: tuple[int, int] | None = None, **kwargs: Any):
        if image_size is not None and (
                len(image_size) != 2 or not all(isinstance(v, int) and v > 0
                                                for v in image_size)):
            raise ValueError(f"image_size must be (H, W), two positive ints, got {image_size!r}")
        self.image_size = tuple(image_size) if image_size is not None else None
        super().__init__(**kwargs)

    def _raw_file(self, name: str) -> Path | None:
        """``name`` in the raw directory (or its ``data/``), if it is there."""
        if self.raw_dir is None:
            return None
        path = resolve_raw_dir(self.raw_dir, "splits.json") / name
        return path if path.is_file() else None

    def has_boxes(self) -> bool:
        return self._raw_file(boxes.BOX_FILE) is not None

    def has_viewpoint_iou(self) -> bool:
        return self._raw_file(boxes.IOU_FILE) is not None

    def read_annotations(self, raw_dir: Path) -> Annotations:
        raw_dir = resolve_raw_dir(raw_dir, "splits.json")
        self.raw_dir = raw_dir
        splits = read_splits(raw_dir / "splits.json")
        types = read_type_mapping(raw_dir / "type_mapping.json")
        captions = {
            "change_captions.json": read_captions(raw_dir / "change_captions.json",
                                                  "change captions"),
            "no_change_captions.json": read_captions(raw_dir / "no_change_captions.json",
                                                     "no-change captions")}
        split_ids = check_annotated_ids(raw_dir, splits, types, captions)
        specs = {split: [pair_spec(raw_dir, i, split, types, captions) for i in ids]
                 for split, ids in splits.items()}
        skipped: dict[str, int] = {}
        if (raw_dir / "images").is_dir():
            unannotated = sum(
                1 for p in (raw_dir / "images").iterdir()
                if (m := IMAGE_PATTERN.match(p.name)) and int(m.group(1)) not in split_ids)
            if unannotated:
                skipped["images in neither splits.json nor type_mapping.json"] = unannotated
        ann = Annotations(specs, list(CHANGE_TYPES), skipped)
        self._attach_boxes_and_ious(ann)
        return ann

    def _attach_boxes_and_ious(self, ann: Annotations) -> None:
        """The optional box and IoU files -> record fields, and the boxes' image size."""
        if self.has_boxes():
            boxes.attach_boxes(ann.all_specs(), self._raw_file(boxes.BOX_FILE), ann.skipped)
            ann.image_size = self._boxes_image_size(ann)
        if self.has_viewpoint_iou():
            boxes.attach_ious(ann.all_specs(), self._raw_file(boxes.IOU_FILE), ann.skipped)

    def _boxes_image_size(self, ann: Annotations) -> tuple[int, int]:
        """(H, W) of the first before image, else the ``image_size`` option, else CLEVR's."""
        first = next(ann.all_specs(), None)
        image = self.raw_dir / first.images["before"] if first is not None else None
        if image is None or not image.is_file():
            return self.image_size or boxes.CLEVR_IMAGE_SIZE
        size = boxes.image_size(image)
        if self.image_size is not None and self.image_size != size:
            logging.warning("%s: image_size %s differs from %s's %s; the image's is kept",
                            self.name, self.image_size, image, size)
        return size
