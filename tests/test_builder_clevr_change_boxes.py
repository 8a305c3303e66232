"""CLEVR-Change builder: the optional box and viewpoint-IoU files become record fields."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from builder_helpers import build, clevr_change_raw, records, write_json

from data_prep.builders.base import BuildError
from data_prep.builders.clevr_change import ClevrChange
from data_prep.builders.clevr_change_boxes import BOX_FILE, IOU_FILE, NO_BOX, NO_IOU

# ids 0-4 are annotated (builder_helpers); 2 is an "add" (no before box), 3 a "drop" (no after
# box); 4 is missing from the box file, 1 from the IoU file; 5 (images only) and 99 (no images)
# are in the files but in no split, as the real files may cover ids outside splits.json.
BOXES = {
    "0": {"bbox_before": [10, 12, 5, 6], "bbox_after": [11, 12, 5.5, 6], "caption": "x"},
    "1": {"bbox_before": [0, 0, 48, 32], "bbox_after": [1.25, 2.5, 3, 4]},
    "2": {"bbox_before": None, "bbox_after": [20, 8, 7, 7]},
    "3": {"bbox_before": [30, 1, 9, 10], "bbox_after": None},
    "5": {"bbox_before": [1, 1, 1, 1], "bbox_after": [2, 2, 2, 2]},
    "99": {"bbox_before": None, "bbox_after": None},
}
IOUS = {"0": 0.75, "2": 0.125, "3": 1, "4": 0.0, "5": 0.5, "99": 0.9}
FEATURE_KEYS = {"id", "image_id", "before", "after_semantic", "after_distractor",
                "change_captions", "change_caption_ids", "no_change_captions",
                "no_change_caption_ids", "change_type"}
EXTRA_KEYS = {"bbox_before", "bbox_after", "viewpoint_iou_semantic", "viewpoint_iou_distractor"}


def _raw_with_extras(root: Path, *, features: bool = False) -> Path:
    root = clevr_change_raw(root, with_features=features)
    write_json(root / "data" / BOX_FILE, BOXES)
    write_json(root / "data" / IOU_FILE, IOUS)
    return root


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = _raw_with_extras(tmp_path_factory.mktemp("raw"), features=True)
    return build("clevr_change", root, tmp_path_factory.mktemp("data"),
                 features_dir=root / "features")


def test_records_carry_the_files_boxes_and_ious(built):
    assert built.directory.name == "1.2.0"
    assert set(built.builder.info.features.keys()) == FEATURE_KEYS | EXTRA_KEYS
    recs = {int(r["id"]): r for split in ("train", "val", "test")
            for r in records(built, split).values()}
    assert sorted(recs) == [0, 1, 2, 3, 4]
    for i, rec in recs.items():
        entry = BOXES.get(str(i), {"bbox_before": None, "bbox_after": None})
        for key in ("bbox_before", "bbox_after"):
            expected = [-1.0] * 4 if entry[key] is None else entry[key]
            assert rec[key].dtype == np.float32
            np.testing.assert_array_equal(rec[key], np.array(expected, np.float32),
                                          err_msg=f"id {i} {key}")
        iou = float(rec["viewpoint_iou_semantic"])
        assert iou == IOUS[str(i)] if str(i) in IOUS else math.isnan(iou), f"id {i}: {iou}"
        assert math.isnan(float(rec["viewpoint_iou_distractor"]))


def test_meta_counts_the_missing_ids_and_records_the_image_size(built):
    # builder_helpers.write_image renders 48 x 32 (W x H) images.
    assert built.meta.image_size == (32, 48)
    assert built.meta.skipped == {"images in neither splits.json nor type_mapping.json": 1,
                                  NO_BOX: 1, NO_IOU: 1}


def test_without_the_files_the_spec_and_meta_are_unchanged(tmp_path):
    root = clevr_change_raw(tmp_path / "raw", with_features=True)
    plain = build("clevr_change", root, tmp_path / "data", features_dir=root / "features")
    assert set(plain.builder.info.features.keys()) == FEATURE_KEYS
    assert plain.meta.image_size is None
    assert plain.meta.skipped == {"images in neither splits.json nor type_mapping.json": 1}
    assert not EXTRA_KEYS & set(records(plain, "val")["000003.png"])


def test_each_file_alone_adds_only_its_fields(tmp_path):
    root = clevr_change_raw(tmp_path / "raw")
    write_json(root / "data" / IOU_FILE, IOUS)
    ious_only = ClevrChange(data_dir=str(tmp_path / "a"), raw_dir=root)
    assert set(ious_only.info.features.keys()) == FEATURE_KEYS | {
        "viewpoint_iou_semantic", "viewpoint_iou_distractor"}
    assert ious_only.read_annotations(root).image_size is None
    (root / "data" / IOU_FILE).rename(root / "data" / BOX_FILE)
    write_json(root / "data" / BOX_FILE, BOXES)
    boxes_only = ClevrChange(data_dir=str(tmp_path / "b"), raw_dir=root)
    assert set(boxes_only.info.features.keys()) == FEATURE_KEYS | {"bbox_before", "bbox_after"}


@pytest.mark.parametrize("option, expected", [(None, (320, 480)), ((360, 480), (360, 480))])
def test_image_size_without_images_is_the_option_else_clevrs(tmp_path, option, expected):
    root = _raw_with_extras(tmp_path / "raw")
    for image in (root / "data" / "images").iterdir():
        image.unlink()
    builder = ClevrChange(data_dir=str(tmp_path / "out"), raw_dir=root, image_size=option)
    assert builder.read_annotations(root).image_size == expected


def _edit(path: Path, fn) -> None:
    path.write_text(json.dumps(fn(json.loads(path.read_text()))))


@pytest.mark.parametrize("fname, edit, message", [
    (BOX_FILE, lambda b: {**b, "1": {**b["1"], "bbox_after": [1, 2, 3]}},
     r"id 1: 'bbox_after' is \[1, 2, 3\], expected \[x, y, w, h\]"),
    (BOX_FILE, lambda b: {**b, "2": {**b["2"], "bbox_after": [1, "2", 3, 4]}},
     r"id 2: 'bbox_after' is \[1, '2', 3, 4\]"),
    (BOX_FILE, lambda b: {**b, "3": {**b["3"], "bbox_before": [1, 2, -3, 4]}},
     r"id 3: 'bbox_before' .* width and height must be >= 0"),
    (BOX_FILE, lambda b: {**b, "0": {"bbox_before": [1, 2, 3, 4]}},
     r"id 0: missing key 'bbox_after'"),
    (BOX_FILE, lambda b: {**b, "4": [1, 2, 3, 4]}, r"id 4: expected an object"),
    (BOX_FILE, lambda b: {**b, "CLEVR_default_000004.png": b["0"]},
     r"key 'CLEVR_default_000004.png' is not an integer id"),
    (BOX_FILE, lambda b: list(b.values()), r"expected an object of id -> value, found list"),
    (IOU_FILE, lambda d: {**d, "2": "0.5"}, r"id 2: the IoU is '0.5', expected a number"),
    (IOU_FILE, lambda d: {**d, "3": 1.5}, r"id 3: the IoU is 1.5"),
    (IOU_FILE, lambda d: {**d, "4": None}, r"id 4: the IoU is None"),
    (IOU_FILE, lambda d: [0.5], r"expected an object of id -> value, found list"),
])
def test_bad_entries_name_the_file_the_id_and_the_key(tmp_path, fname, edit, message):
    root = _raw_with_extras(tmp_path / "raw")
    _edit(root / "data" / fname, edit)
    features = tmp_path / "features"
    features.mkdir()
    with pytest.raises(BuildError, match=rf"{fname}: {message}"):
        build("clevr_change", root, tmp_path / "out", features_dir=features)
    assert not list((tmp_path / "out").rglob("dataset_info.json"))


def test_unparsable_file_is_named(tmp_path):
    root = _raw_with_extras(tmp_path / "raw")
    (root / "data" / IOU_FILE).write_text("{not json")
    with pytest.raises(BuildError, match=IOU_FILE):
        ClevrChange(data_dir=str(tmp_path / "out"), raw_dir=root).read_annotations(root)
