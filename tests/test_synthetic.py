"""The synthetic change dataset: scenes, rendering, features and the TFDS build."""

import hashlib
import json

import numpy as np
import pytest
from conftest import SMALL, shared_file

from changecap_jax.data import datasets, schema
from changecap_jax.data.synthetic import builder, render, scenes
from changecap_jax.data.vocab import CaptionError, tokenize
from changecap_jax.features import grid as grid_features


def _examples(change_type, n=25, distractors="moderate"):
    return [scenes.sample_example(np.random.default_rng([7, k]), change_type, distractors, 6)
            for k in range(n)]


@pytest.mark.parametrize("change_type", scenes.CHANGE_TYPES)
def test_each_change_changes_what_it_claims(change_type):
    for ex in _examples(change_type):
        before, after = list(ex.before), list(ex.after)
        assert 3 <= len(before) <= 7 and 3 <= len(after) <= 7
        for scene in (before, after):  # full descriptions are unique
            assert len({o.attributes for o in scene}) == len(scene)
        if change_type == "add":
            assert after[:-1] == before and ex.changed_index_after == len(before)
            continue
        if change_type == "drop":
            i = ex.changed_index_before
            assert after == before[:i] + before[i + 1:] and ex.changed_index_after == -1
            continue
        i = ex.changed_index_before
        assert before[:i] + before[i + 1:] == after[:i] + after[i + 1:]
        old, new = before[i], after[i]
        differs = {f for f in ("size", "color", "material", "shape") if
                   getattr(old, f) != getattr(new, f)}
        if change_type == "move":
            assert not differs and np.hypot(old.x - new.x, old.y - new.y) > 1.5
        else:
            assert differs == {change_type}


def _attribute_of(word):
    for field, table in (("size", scenes.SIZE_WORDS), ("material", scenes.MATERIAL_WORDS),
                         ("shape", scenes.SHAPE_WORDS)):
        for value, words in table.items():
            if word in words:
                return field, value
    return ("color", word) if word in scenes.COLORS else None


@pytest.mark.parametrize("change_type", scenes.CHANGE_TYPES)
def test_captions_name_the_changed_object(change_type):
    official = json.loads(shared_file("clevr_change", "transformer_vocab.json").read_text())
    for ex in _examples(change_type, n=10):
        scene = ex.after if change_type == "add" else ex.before
        obj = ex.after[ex.changed_index_after] if change_type == "add" else \
            ex.before[ex.changed_index_before]
        assert len(ex.change_captions) == len(set(ex.change_captions)) == 6
        for caption in ex.change_captions:
            words = tokenize(caption)[1:-1]
            assert set(words) <= set(official), caption
            if change_type in ("color", "material"):  # "... changed to <new value>"
                new = ex.after[ex.changed_index_after]
                assert _attribute_of(words[-1]) == (change_type, getattr(new, change_type))
                words = words[:-1]
            mentioned = dict(a for a in map(_attribute_of, words) if a)
            assert {k: getattr(obj, k) for k in mentioned} == mentioned, caption
            # The mentioned attributes pick out exactly the changed object.
            matches = [o for o in scene if all(getattr(o, k) == v for k, v in mentioned.items())]
            assert matches == [obj], caption
        for caption in ex.no_change_captions:
            assert caption in scenes.NO_CHANGE_CAPTIONS


def test_distractor_view_differs_in_pixels_not_in_scene():
    ex = _examples("color", n=1)[0]
    before, _ = render.render(ex.before, ex.camera_before, ex.light_before, (128, 128))
    distractor, _ = render.render(ex.before, ex.camera_distractor, ex.light_distractor, (128, 128))
    again, _ = render.render(ex.before, ex.camera_before, ex.light_before, (128, 128))
    assert np.array_equal(before, again)  # deterministic
    assert np.abs(before.astype(int) - distractor.astype(int)).mean() > 3.0


def test_metal_and_rubber_are_visibly_different():
    def patch(material):
        obj = scenes.SceneObject("large", "red", material, "sphere", 0.0, -1.0, 0.0)
        img, boxes = render.render([obj], scenes.Camera(), scenes.Lighting(), (128, 128))
        x, y, w, h = (int(v) for v in boxes[0])
        return img[y:y + h, x:x + w].astype(float)
    metal, rubber = patch("metal"), patch("rubber")
    assert metal.max() > 240 and rubber.max() < 200  # the specular highlight
    assert metal.std() > 1.3 * rubber.std()


def test_boxes_cover_the_object():
    obj = scenes.SceneObject("large", "blue", "rubber", "cube", 1.0, 0.0, 20.0)
    img, boxes = render.render([obj], scenes.Camera(), scenes.Lighting(), (128, 128))
    empty, _ = render.render([], scenes.Camera(), scenes.Lighting(), (128, 128))
    x, y, w, h = boxes[0]
    changed = np.argwhere(np.abs(img.astype(int) - empty.astype(int)).sum(-1) > 60)
    assert w > 5 and h > 5
    # Pixels that show the object lie inside its box (the soft shadow may fall outside).
    blue = changed[img[changed[:, 0], changed[:, 1], 2] > img[changed[:, 0], changed[:, 1], 0]]
    assert len(blue) > 30
    assert (blue[:, 1] >= x - 1).all() and (blue[:, 1] <= x + w + 1).all()
    assert (blue[:, 0] >= y - 1).all() and (blue[:, 0] <= y + h + 1).all()


def test_grid_features_shape_and_determinism():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(2, 100, 90, 3), dtype=np.uint8)  # any size is resized
    a = grid_features.extract(images, (8, 8, 64))
    b = grid_features.extract(images, (8, 8, 64))
    assert a.shape == (2, 8, 8, 64) and a.dtype == np.float16
    assert np.array_equal(a, b) and (a >= 0).all()
    assert not np.array_equal(a[0], a[1])
    with pytest.raises(ValueError, match="even"):
        grid_features.extract(images, (8, 8, 7))


def test_small_build_layout_and_records(small_synthetic):
    ds = small_synthetic
    assert ds.meta.feature_shape == SMALL["feature_shape"]
    assert ds.meta.split_sizes == {"train": 40, "val": 12, "test": 10}
    raw = ds.directory / "raw"
    splits = json.loads((raw / "splits.json").read_text())
    assert sorted(sum(splits.values(), [])) == list(range(62))
    types = json.loads((raw / "type_mapping.json").read_text())
    captions = json.loads((raw / "change_captions.json").read_text())
    assert len(captions) == 62 and "CLEVR_default_000000.png" in captions
    for key in builder.IMAGE_DIRS:
        assert builder.image_path(raw, key, 61).exists()
    test = ds.split("test")
    assert len(test) == 10
    for k in range(len(test)):
        r = test[k]
        assert r["id"] in splits["test"]
        assert r["before"].shape == SMALL["feature_shape"] and r["before"].dtype == np.float16
        kind = ds.meta.change_types[r["change_type"]]
        assert f"{r['id']:06d}.png" in types[kind]
        texts = [c.decode() for c in r["change_captions"]]
        assert texts == captions[f"CLEVR_default_{r['id']:06d}.png"]
        assert [ds.vocab.decode(i) for i in r["change_caption_ids"]] == texts
        if kind != "add":
            assert (r["bbox_before"][2:] > 0).all()
    # The stored features are the extractor's output on the saved images.
    from PIL import Image
    image = np.asarray(Image.open(builder.image_path(raw, "after_semantic", int(r["id"]))))
    np.testing.assert_array_equal(
        grid_features.extract(image[None], SMALL["feature_shape"], version=2)[0],
        r["after_semantic"])


def _record_digests(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.glob("*.array_record-*"))}


def test_same_seed_identical_bytes_other_seed_differs(small_synthetic, tmp_path):
    options = dict(SMALL, num_train=10, num_val=3, num_test=3)
    a = datasets.prepare("synthetic", tmp_path / "a", "moderate", options)
    b = datasets.prepare("synthetic", tmp_path / "b", "moderate", options)
    c = datasets.prepare("synthetic", tmp_path / "c", "moderate", dict(options, seed=1))
    assert _record_digests(a.directory) == _record_digests(b.directory)
    assert len(_record_digests(a.directory)) == 3
    assert _record_digests(a.directory) != _record_digests(c.directory)
    img = lambda d: (d.directory / "raw/images/CLEVR_default_000000.png").read_bytes()  # noqa: E731
    assert img(a) == img(b) and img(a) != img(c)


def test_interrupted_build_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(builder.SyntheticChange, "num_workers", 0)
    calls = {"n": 0}
    real = builder._render_and_extract

    def failing(job):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real(job)

    monkeypatch.setattr(builder, "_render_and_extract", failing)
    with pytest.raises(KeyboardInterrupt):
        datasets.prepare("synthetic", tmp_path, "moderate", dict(SMALL, num_train=8))
    leftovers = [p for p in tmp_path.rglob("*") if p.is_file() and p.name != "metadata.json"]
    assert leftovers == []
    assert not list(tmp_path.rglob("incomplete*"))


def test_wrong_feature_shape_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(builder.SyntheticChange, "num_workers", 0)
    real = grid_features.extract
    monkeypatch.setattr(grid_features, "extract",
                        lambda im, shape, *dtype: real(im, (4, 4, 8), *dtype))
    with pytest.raises(ValueError, match=r"feature 'before' has shape \(4, 4, 8\), expected "
                                         r"\(4, 4, 16\)"):
        datasets.prepare("synthetic", tmp_path, "moderate", dict(SMALL, num_train=8))
    assert not list(tmp_path.rglob("*.array_record*"))


def test_empty_caption_is_named(tmp_path, monkeypatch):
    real = builder.make_example

    def with_empty(config, example_id):
        ex = real(config, example_id)
        if example_id == 3:
            ex = scenes.dataclasses.replace(ex, change_captions=("",) + ex.change_captions[1:])
        return ex

    monkeypatch.setattr(builder, "make_example", with_empty)
    with pytest.raises(CaptionError, match="synthetic example 3: empty caption"):
        datasets.prepare("synthetic", tmp_path, "moderate", dict(SMALL, num_train=8))
    assert not list(tmp_path.rglob("*.array_record*"))


def test_record_check_names_caption_ids():
    record = {"change_caption_ids": np.zeros((0, 16), np.int32)}
    with pytest.raises(ValueError, match=r"'change_caption_ids' has shape \(0, 16\)"):
        schema.check_record(record, (4, 4, 16), 16, "here")


def test_half_precision_builds_read_back_the_float32_features_in_half_the_bytes(tmp_path):
    import ml_dtypes

    # 8x8x64 grids: the features are most of a record, so the file sizes show their dtype.
    options = dict(SMALL, num_train=6, num_val=2, num_test=2, feature_shape=(8, 8, 64))
    built = {dtype: datasets.prepare("synthetic", tmp_path, "moderate",
                                     dict(options, feature_dtype=dtype))
             for dtype in ("float32", "float16", "bfloat16")}
    assert len({d.directory for d in built.values()}) == 3  # one variant per dtype
    # (dtype, relative precision of its 11- or 8-bit significand)
    for name, (dtype, rtol) in {"float16": (np.float16, 2**-11),
                                "bfloat16": (ml_dtypes.bfloat16, 2**-8)}.items():
        half = built[name]
        assert half.meta.feature_dtype == name
        sizes = schema.split_bytes(half.directory, "train")
        full_sizes = schema.split_bytes(built["float32"].directory, "train")
        # The records a reader decodes halve (captions and ids are the rest); on disk
        # array_record's compression shrinks both, the half build still to clearly less.
        assert 0.45 < sizes["record_bytes"] / full_sizes["record_bytes"] < 0.55
        assert sizes["file_bytes"] < 0.8 * full_sizes["file_bytes"]
        full, low = built["float32"].split("train"), half.split("train")
        for i in range(len(full)):
            a, b = full[i], low[i]
            assert b["before"].dtype == dtype and a["before"].dtype == np.float32
            for key in ("before", "after_semantic", "after_distractor"):
                np.testing.assert_allclose(b[key].astype(np.float32), a[key], rtol=rtol,
                                           atol=1e-6, err_msg=key)
            np.testing.assert_array_equal(a["change_caption_ids"], b["change_caption_ids"])
    # The float32 build keeps precision the half ones cannot hold.
    f32 = built["float32"].split("train")[0]["before"]
    assert not np.array_equal(f32, f32.astype(np.float16).astype(np.float32))
    assert built["float32"].meta.feature_dtype == "float32"


def test_unknown_feature_dtype_is_named(tmp_path):
    with pytest.raises(ValueError, match="feature_dtype must be one of .*'float16'.* got 'int8'"):
        datasets.prepare("synthetic", tmp_path, "moderate", dict(SMALL, feature_dtype="int8"))
