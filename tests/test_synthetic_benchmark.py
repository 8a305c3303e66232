"""The synthetic benchmark from builder 2.0.0 on: grid extractor version 2, the 'weak'
distractor strength, and older builder versions read and built as they were."""

import numpy as np
import pytest
import tensorflow_datasets as tfds
from conftest import SMALL
from PIL import Image

from changecap_jax.data import datasets
from changecap_jax.data.boxes import mean_box_iou
from changecap_jax.data.synthetic import builder, render, scenes
from changecap_jax.features import grid

TINY = dict(SMALL, num_train=6, num_val=3, num_test=3)


def _scene_image(light: scenes.Lighting) -> np.ndarray:
    ex = scenes.sample_example(np.random.default_rng([3, 1]), "color", "moderate", 6)
    image, _ = render.render(ex.before, scenes.Camera(), light, (128, 128))
    return image


def _change(a: np.ndarray, b: np.ndarray, version: int) -> float:
    fa, fb = (grid.extract(x[None], (8, 8, 64), np.float32, version)[0] for x in (a, b))
    return float(np.linalg.norm(fa - fb) / np.linalg.norm(fa))


def test_version_2_discounts_a_global_light_cast_that_version_1_sees():
    base = _scene_image(scenes.Lighting())
    cast = _scene_image(scenes.Lighting(brightness=1.12, tint=(1.04, 0.97, 1.0)))
    v1, v2 = _change(base, cast, 1), _change(base, cast, 2)
    assert v1 > 0.1
    assert v2 < 0.25 * v1


def test_version_2_still_sees_a_colour_change():
    ex = scenes.sample_example(np.random.default_rng([3, 1]), "color", "moderate", 6)
    before, _ = render.render(ex.before, scenes.Camera(), scenes.Lighting(), (128, 128))
    after, _ = render.render(ex.after, scenes.Camera(), scenes.Lighting(), (128, 128))
    cast = _scene_image(scenes.Lighting(brightness=1.12, tint=(1.04, 0.97, 1.0)))
    # The recolouring of one object moves the features more than the light cast does.
    assert _change(before, after, 2) > 2.0 * _change(before, cast, 2)


def test_shift_robust_statistics_ignore_a_shift_inside_the_patch_but_see_the_colour():
    floor = np.broadcast_to(grid.FLOOR_REFERENCE.astype(np.uint8), (16, 32, 3))

    def square(y: int, x: int, color: tuple[int, int, int]) -> np.ndarray:
        image = floor.copy()
        image[y:y + 6, x:x + 6] = color
        return image

    here, shifted = square(1, 2, (200, 40, 40)), square(8, 9, (200, 40, 40))
    blue = square(1, 2, (40, 40, 200))
    robust = lambda im: grid.shift_robust_statistics(im, (1, 2))  # noqa: E731
    np.testing.assert_allclose(robust(here), robust(shifted), atol=1e-6)
    assert np.abs(robust(here) - robust(blue))[0, 0, :grid.HUE_BINS].max() > 0.5
    # The sub-cell means of version 1 do move with the shift.
    assert not np.allclose(grid.patch_statistics(here, (1, 2)),
                           grid.patch_statistics(shifted, (1, 2)))


def test_white_balance_maps_the_median_colour_to_the_floor_reference():
    image = np.broadcast_to(np.array([120, 135, 150], np.uint8), (32, 32, 3)).copy()
    image[:4, :4] = (250, 10, 10)
    balanced = grid.white_balance(image)
    np.testing.assert_allclose(balanced[10, 10], grid.FLOOR_REFERENCE, atol=1.0)
    assert balanced.dtype == np.uint8


def test_extractor_versions_are_named():
    image = np.zeros((128, 128, 3), np.uint8)
    assert grid.patch_statistics(image, (8, 8), 2).shape == (8, 8, grid.NUM_STATS[2])
    with pytest.raises(ValueError, match="unknown grid extractor version 3"):
        grid.extract(image[None], (8, 8, 64), version=3)


def test_weak_distractors_are_moderate_halved_example_by_example():
    for k in range(40):
        change = scenes.CHANGE_TYPES[k % 5]
        weak, moderate = (scenes.sample_example(np.random.default_rng([11, k]), change, s, 6)
                          for s in ("weak", "moderate"))
        assert weak.before == moderate.before and weak.after == moderate.after
        assert weak.change_captions == moderate.change_captions
        for view in ("semantic", "distractor"):
            cw, cm = getattr(weak, f"camera_{view}"), getattr(moderate, f"camera_{view}")
            np.testing.assert_allclose([cw.yaw, cw.tx, cw.ty, cw.zoom - 1],
                                       np.array([cm.yaw, cm.tx, cm.ty, cm.zoom - 1]) / 2,
                                       atol=1e-12)
            lw, lm = getattr(weak, f"light_{view}"), getattr(moderate, f"light_{view}")
            base = weak.light_before.azimuth
            np.testing.assert_allclose(
                [lw.azimuth - base, lw.brightness - 1, *(np.array(lw.tint) - 1),
                 lw.ambient - 0.45],
                np.array([lm.azimuth - base, lm.brightness - 1, *(np.array(lm.tint) - 1),
                          lm.ambient - 0.45]) / 2, atol=1e-12)


def test_viewpoint_overlap_orders_the_distractor_strengths():
    def mean_iou(strength: str) -> float:
        ious = []
        for k in range(24):
            ex = scenes.sample_example(np.random.default_rng([5, k]), "move", strength, 6)
            _, before = render.render(ex.before, ex.camera_before, ex.light_before, (128, 128))
            _, after = render.render(ex.before, ex.camera_distractor, ex.light_distractor,
                                     (128, 128))
            ious.append(mean_box_iou(list(zip(before, after, strict=True))))
        return float(np.mean(ious))

    none, weak, moderate, extreme = (mean_iou(s) for s in ("none", "weak", "moderate",
                                                           "extreme"))
    assert none == pytest.approx(1.0)
    assert none > weak + 0.1 > moderate + 0.2 > extreme + 0.3


def _stored_matches_extractor(ds: datasets.PreparedDataset, version: int) -> None:
    record = ds.split("test")[0]
    raw = ds.directory / "raw"
    image = np.asarray(Image.open(builder.image_path(raw, "before", int(record["id"]))))
    np.testing.assert_array_equal(
        grid.extract(image[None], TINY["feature_shape"], version=version)[0], record["before"])


def test_the_newest_version_uses_extractor_2_and_a_1_3_0_build_stays_readable(
        tmp_path, monkeypatch):
    new = datasets.prepare("synthetic", tmp_path, "weak", TINY)
    assert new.directory.name == "2.0.0" and new.meta.extractor == "synthetic_grid_v2"
    _stored_matches_extractor(new, 2)
    # TFDS builds only a builder's newest version: a 1.3.0 dataset as the 1.3.0 code built it.
    with monkeypatch.context() as m:
        m.setattr(builder.SyntheticChange, "VERSION", tfds.core.Version("1.3.0"))
        m.setattr(builder.SyntheticChange, "SUPPORTED_VERSIONS", [])
        datasets.prepare("synthetic", tmp_path, "weak", TINY)
    old = datasets.prepare("synthetic", tmp_path, "weak", dict(TINY, version="1.3.0"),
                           build_if_missing=False)
    assert old.directory.name == "1.3.0" and old.meta.extractor == "synthetic_grid"
    _stored_matches_extractor(old, 1)
    # The same scenes and captions: only the features differ between the versions.
    a, b = new.split("train")[0], old.split("train")[0]
    assert a["id"] == b["id"] and list(a["change_captions"]) == list(b["change_captions"])
    assert not np.array_equal(a["before"], b["before"])


def test_an_unknown_version_is_one_line(tmp_path):
    with pytest.raises(datasets.DatasetOptionError,
                       match=r"option version='1\.0\.0': expected one of \['2\.0\.0', '1\.3\.0'\]"):
        datasets.prepare("synthetic", tmp_path, "weak", dict(TINY, version="1.0.0"))
