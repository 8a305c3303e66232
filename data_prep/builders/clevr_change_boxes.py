"""CLEVR-Change's changed-object boxes and viewpoint-change IoUs (docs/datasets.md §1.2).

The official download ships two files beside ``splits.json`` that Park et al.'s evaluation
scripts read (Seth-Park/RobustChangeCaptioning ``evaluate_pointing.py``,
``evaluate_by_IOU.py``):

- ``change_captions_with_bbox.json``: ``{"123": {"bbox_before": [x, y, w, h] | null,
  "bbox_after": [x, y, w, h] | null, ...}}``, keyed by ``str(int(id))``: the changed object's
  box in the before and in the semantic-after image, in pixels; null where the object is not
  in that image (an added object has no before box, a dropped one no after box). Other keys
  are ignored.
- ``change_captions_by_IOU.json``: ``{"123": iou}``, the viewpoint-change IoU of the semantic
  pair (lower: the camera moved more); the official script bins the test pairs by it.

They become the record fields ``bbox_before`` / ``bbox_after`` (all -1: absent, the
synthetic builder's convention) and ``viewpoint_iou_semantic`` (NaN: unknown) of
``changecap_jax/data/schema.py``; the file has no IoU of the distractor pair, so
``viewpoint_iou_distractor`` is NaN in every record. Malformed entries stop the build with a
:class:`BuildError` naming the file, the id and the key.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from data_prep.builders.base import BuildError, PairSpec, load_json, skip

BOX_FILE = "change_captions_with_bbox.json"
IOU_FILE = "change_captions_by_IOU.json"
BOX_KEYS = ("bbox_before", "bbox_after")
ABSENT_BOX = (-1.0, -1.0, -1.0, -1.0)  # schema.py: no such object in that image
# CLEVR's default render size (H, W). RCC's evaluate_pointing.py draws its masks at
# (360, 480) instead; which one the boxes were measured at is unverified (datasets.md §1.1).
CLEVR_IMAGE_SIZE = (320, 480)
NO_BOX = f"records without boxes in {BOX_FILE} (stored as -1)"
NO_IOU = f"records without a viewpoint IoU in {IOU_FILE} (stored as NaN)"


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def read_id_map(path: Path, what: str) -> dict[int, object]:
    """A JSON object keyed by ``str(int(id))`` -> id -> value; the key must be an integer."""
    data = load_json(path, what)
    if not isinstance(data, dict):
        raise BuildError(f"{path}: expected an object of id -> value, found "
                         f"{type(data).__name__}")
    out: dict[int, object] = {}
    for key, value in data.items():
        if not re.fullmatch(r"\d+", key):
            raise BuildError(f"{path}: key {key!r} is not an integer id (str(int(id)))")
        out[int(key)] = value
    return out


def parse_box(value: object, path: Path, i: int, key: str) -> np.ndarray:
    """``[x, y, w, h]`` (finite, w and h >= 0) -> float32 (4,); null -> all -1."""
    if value is None:
        return np.array(ABSENT_BOX, np.float32)
    if (not isinstance(value, list) or len(value) != 4
            or not all(_is_number(v) for v in value)):
        raise BuildError(f"{path}: id {i}: {key!r} is {value!r}, expected [x, y, w, h] "
                         "(4 finite numbers) or null")
    if value[2] < 0 or value[3] < 0:
        raise BuildError(f"{path}: id {i}: {key!r} is {value!r}, width and height must be "
                         ">= 0")
    return np.array(value, np.float32)


def read_boxes(path: Path) -> dict[int, dict[str, np.ndarray]]:
    """``change_captions_with_bbox.json`` -> id -> {"bbox_before": (4,), "bbox_after": (4,)}."""
    out = {}
    for i, entry in read_id_map(path, "box file").items():
        if not isinstance(entry, dict):
            raise BuildError(f"{path}: id {i}: expected an object with keys {list(BOX_KEYS)}, "
                             f"found {type(entry).__name__}")
        for key in BOX_KEYS:
            if key not in entry:
                raise BuildError(f"{path}: id {i}: missing key {key!r} (found keys "
                                 f"{sorted(entry)})")
        out[i] = {key: parse_box(entry[key], path, i, key) for key in BOX_KEYS}
    return out


def read_ious(path: Path) -> dict[int, float]:
    """``change_captions_by_IOU.json`` -> id -> IoU in [0, 1]."""
    out = {}
    for i, value in read_id_map(path, "IoU file").items():
        if not _is_number(value) or not 0.0 <= value <= 1.0:
            raise BuildError(f"{path}: id {i}: the IoU is {value!r}, expected a number in "
                             "[0, 1]")
        out[i] = float(value)
    return out


def image_size(path: Path) -> tuple[int, int]:
    """(H, W) of an image, from its header."""
    try:
        with Image.open(path) as image:
            width, height = image.size
    except (OSError, UnidentifiedImageError) as e:
        raise BuildError(f"cannot read the size of image {path}: {e}") from e
    return (height, width)


def attach_boxes(specs: Iterable[PairSpec], path: Path, skipped: dict[str, int]) -> None:
    """Adds ``bbox_before`` / ``bbox_after`` to every record; ids the file lacks get -1 boxes
    and are counted in ``skipped``."""
    boxes = read_boxes(path)
    for spec in specs:
        if spec.id not in boxes:
            skip(skipped, NO_BOX)
        spec.extra.update(boxes.get(spec.id) or {
            key: np.array(ABSENT_BOX, np.float32) for key in BOX_KEYS})


def attach_ious(specs: Iterable[PairSpec], path: Path, skipped: dict[str, int]) -> None:
    """Adds ``viewpoint_iou_semantic`` (NaN where the file lacks the id, counted in
    ``skipped``) and ``viewpoint_iou_distractor`` (NaN: the file has none) to every record."""
    ious = read_ious(path)
    for spec in specs:
        if spec.id not in ious:
            skip(skipped, NO_IOU)
        extra: dict[str, Any] = {
            "viewpoint_iou_semantic": np.float32(ious.get(spec.id, math.nan)),
            "viewpoint_iou_distractor": np.float32(math.nan),
        }
        spec.extra.update(extra)
