"""CLEVR-DC builder: both official raw layouts -> ArrayRecord -> grain, and its error cases."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from builder_helpers import build, records, texts, write_feature, write_image, write_json
from conftest import shared_file

from changecap_jax.data.vocab import Vocabulary
from data_prep.builders.base import BuildError
from data_prep.builders.clevr_change import read_splits
from data_prep.builders.clevr_dc import DC_CHANGE_TYPES, change_type_of

# One or two ids per 8,000-id block, so every (inferred) change type occurs.
DC_CAPTIONS = {
    0: ["the red cube changed to blue", "the red metal cube turned blue"],
    7: ["the small cylinder changed to yellow"],
    8000: ["the small sphere became metal", "the sphere became shiny"],
    16000: ["someone added a cylinder", "a gray cylinder has appeared"],
    24000: ["the large cube is missing", "the brown cube has disappeared"],
    32000: ["the cylinder changed its location", "the cylinder moved"],
    40000: ["no change was made", "the scene remains the same"],
}
DC_TYPES = {0: "color", 7: "color", 8000: "material", 16000: "add", 24000: "drop",
            32000: "move", 40000: "no_change"}
DC_SPLITS = {"train": [0, 8000, 16000, 24000], "val": [32000], "test": [7, 40000]}


def clevr_dc_raw(root: Path, layout: str = "upstream", *, split_name: str = "") -> Path:
    """Writes the upstream (bef/aft, captions.json, split.json) or the DIRL-renamed (images/,
    sc_images/, change_captions.json, splits.json) layout into ``root``."""
    if layout == "upstream":
        before, after, caption_file, name = "bef", "aft", "captions.json", "{}"
        split_name = split_name or "split.json"
    else:
        before, after, caption_file, name = "images", "sc_images", "change_captions.json", \
            "{:06d}"
        split_name = split_name or "splits.json"
    for i in DC_CAPTIONS:
        write_image(root / before / f"{name.format(i)}.png", seed=2 * i)
        write_image(root / after / f"{name.format(i)}.png", seed=2 * i + 1)
    key = name if layout == "upstream" else name + ".png"
    write_json(root / caption_file, {key.format(i): caps for i, caps in DC_CAPTIONS.items()})
    write_json(root / split_name, DC_SPLITS)
    return root


def dc_features(features_dir: Path, naming: str) -> Path:
    """``features/<name>.npy`` (before) and ``sc_features/<name>.npy`` (after), the same
    arrays whichever naming (``12.png`` upstream, ``000012.png`` DIRL)."""
    for i in DC_CAPTIONS:
        name = f"{i}.png" if naming == "upstream" else f"{i:06d}.png"
        write_feature(features_dir, f"features/{name}", seed=2 * i)
        write_feature(features_dir, f"sc_features/{name}", seed=2 * i + 1)
    return features_dir


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = clevr_dc_raw(tmp_path_factory.mktemp("raw"))
    features = dc_features(tmp_path_factory.mktemp("features"), "upstream")
    return features, build("clevr_dc", root, tmp_path_factory.mktemp("data"),
                           features_dir=features, layer=3)


def test_round_trip_ids_captions_types_features(built):
    features, prepared = built
    meta = prepared.meta
    assert meta.split_sizes == {"train": 4, "val": 1, "test": 2}
    assert meta.feature_shape == (14, 14, 1024)
    assert not meta.has_distractor
    assert meta.change_types == ["color", "material", "add", "drop", "move", "no_change"]
    assert meta.tokenizer == "clevr" and meta.skipped == {}
    for split, ids in DC_SPLITS.items():
        recs = records(prepared, split)
        assert sorted(recs) == sorted(f"{i:06d}.png" for i in ids)
        for i in ids:
            rec = recs[f"{i:06d}.png"]
            assert int(rec["id"]) == i
            assert texts(rec["change_captions"]) == DC_CAPTIONS[i]
            assert meta.change_types[int(rec["change_type"])] == DC_TYPES[i]
            assert "after_distractor" not in rec and "no_change_captions" not in rec
            np.testing.assert_array_equal(rec["change_caption_ids"], prepared.vocab.encode_many(
                DC_CAPTIONS[i], meta.max_caption_len, allow_unk=split != "train"))
            if split == "train":
                assert [prepared.vocab.decode(r) for r in rec["change_caption_ids"]] == \
                    DC_CAPTIONS[i]
            for key, sub in (("before", "features"), ("after_semantic", "sc_features")):
                chw = np.load(features / sub / f"{i}.png.npy")
                assert rec[key].dtype == np.float32
                np.testing.assert_array_equal(rec[key], chw.transpose(1, 2, 0))


def test_vocabulary_from_train_only_and_longest_caption(built):
    _, prepared = built
    train = [c for i in DC_SPLITS["train"] for c in DC_CAPTIONS[i]]
    assert prepared.vocab == Vocabulary.build(train, "clevr")
    assert "moved" not in prepared.vocab.word_to_id  # a val-only word
    longest = max(len(c.split()) for caps in DC_CAPTIONS.values() for c in caps)
    assert prepared.meta.max_caption_len == longest + 2  # <START> ... <END>
    val = records(prepared, "val")["032000.png"]
    assert 1 in val["change_caption_ids"][1]  # "moved" -> <UNK>


@pytest.mark.parametrize("layout, sub, split_name, naming", [
    ("dirl", "data", "splits.json", "dirl"),   # DIRL layout in data/, its own names
    ("dirl", "", "split.json", "dirl"),        # DIRL layout keeping the upstream split name
    ("upstream", "data", "", "dirl"),          # upstream images, the authors' padded features
])
def test_both_layouts_build_identical_records(built, tmp_path, layout, sub, split_name, naming):
    _, reference = built
    raw = tmp_path / "raw"
    clevr_dc_raw(raw / sub if sub else raw, layout, split_name=split_name)
    features = dc_features(tmp_path / "features", naming)
    prepared = build("clevr_dc", raw, tmp_path / "data", features_dir=features, layer=3)
    assert prepared.vocab == reference.vocab
    assert prepared.meta.max_caption_len == reference.meta.max_caption_len
    for split in DC_SPLITS:
        got, want = records(prepared, split), records(reference, split)
        assert sorted(got) == sorted(want)
        for image_id, rec in want.items():
            assert set(got[image_id]) == set(rec)
            for key, value in rec.items():
                np.testing.assert_array_equal(got[image_id][key], value, err_msg=key)


def _rewrite(path: Path, fn) -> None:
    path.write_text(json.dumps(fn(json.loads(path.read_text()))))


def _drop_key(key: str):
    return lambda c: {k: v for k, v in c.items() if k != key}


@pytest.mark.parametrize("layout, edit, message", [
    ("upstream", lambda d: (d / "captions.json").unlink(),
     r"upstream hsgkim/clevr-dc layout lacks captions\.json.*DIRL-renamed layout lacks "
     r"images/, sc_images/"),
    ("upstream", lambda d: _rewrite(d / "captions.json", lambda c: {**c, "5": ["a cube"]}),
     r"captions\.json: 1 caption key\(s\) are in no split of split\.json, e\.g\. key '5'"),
    ("dirl", lambda d: _rewrite(d / "change_captions.json",
                                lambda c: {**c, "000005.png": ["a cube"]}),
     r"change_captions\.json: .* no split of splits\.json, e\.g\. key '000005\.png'"),
    ("upstream", lambda d: _rewrite(d / "captions.json", _drop_key("8000")),
     r"captions\.json: no captions for train id 8000 \(key '8000'\)"),
    ("upstream", lambda d: _rewrite(d / "split.json", lambda s: {**s, "test": [7, 48000]}),
     r"split\.json: test id 48000 is outside 0\.\.47999"),
    ("upstream", lambda d: _rewrite(d / "split.json", lambda s: {**s, "test": [7, -1]}),
     r"split\.json: test id -1 is outside"),
    ("upstream", lambda d: _rewrite(d / "split.json", lambda s: {**s, "val": [32000, 0]}),
     r"split\.json: id 0 is in both 'train' and 'val'"),
    ("upstream", lambda d: (d / "aft" / "16000.png").unlink(), r"aft/16000\.png"),
    ("dirl", lambda d: (d / "images" / "040000.png").unlink(), r"images/040000\.png"),
    ("upstream", lambda d: _rewrite(d / "captions.json",
                                    lambda c: {**_drop_key("7")(c), "0007": ["a cube"]}),
     r"captions\.json: key '0007' is not of the upstream hsgkim/clevr-dc form '<id>'"),
    ("dirl", lambda d: _rewrite(d / "change_captions.json",
                                lambda c: {**_drop_key("000007.png")(c), "7.png": ["a"]}),
     r"change_captions\.json: key '7\.png' is not of the DIRL-renamed form '%06d\.png'"),
    ("upstream", lambda d: _rewrite(d / "captions.json", lambda c: {**c, "0": []}),
     r"captions\.json: key '0' must map to a non-empty list"),
    ("upstream", lambda d: _rewrite(d / "captions.json", lambda c: {**c, "0": [" "]}),
     "empty caption"),
])
def test_bad_raw_data_stops_with_a_message_and_leaves_nothing(tmp_path, layout, edit, message):
    raw = clevr_dc_raw(tmp_path / "raw", layout)
    edit(raw)
    features = tmp_path / "features"
    features.mkdir()
    with pytest.raises(ValueError, match=message) as info:
        build("clevr_dc", raw, tmp_path / "out", features_dir=features, layer=3)
    assert isinstance(info.value, BuildError) or "empty caption" in message
    assert not list((tmp_path / "out").rglob("dataset_info.json"))
    assert not list((tmp_path / "out").rglob("*.array_record*"))


def test_empty_raw_dir_names_both_layouts(tmp_path):
    (tmp_path / "raw").mkdir()
    (tmp_path / "features").mkdir()
    with pytest.raises(BuildError, match=r"upstream hsgkim/clevr-dc layout lacks bef/, aft/, "
                                         r"captions\.json, split\.json.*DIRL-renamed layout "
                                         r"lacks images/, sc_images/, change_captions\.json, "
                                         r"splits\.json or split\.json"):
        build("clevr_dc", tmp_path / "raw", tmp_path / "out", features_dir=tmp_path / "features")


def test_feature_of_the_wrong_shape_names_file_and_shapes(tmp_path):
    raw = clevr_dc_raw(tmp_path / "raw")
    features = dc_features(tmp_path / "features", "upstream")
    np.save(features / "sc_features" / "24000.png.npy", np.zeros((2048, 7, 7), np.float32))
    with pytest.raises(BuildError, match=r"sc_features/24000\.png\.npy.*\(2048, 7, 7\).*"
                                         r"\(1024, 14, 14\)"):
        build("clevr_dc", raw, tmp_path / "out", features_dir=features, layer=3)
    assert not list((tmp_path / "out").rglob("dataset_info.json"))


def test_change_type_blocks():
    assert [change_type_of(i) for i in (0, 7999, 8000, 39999, 40000, 47999)] == \
        [0, 0, 1, 4, 5, 5]
    assert DC_CHANGE_TYPES[change_type_of(47999)] == "no_change"
    for bad in (-1, 48000):
        with pytest.raises(ValueError, match=str(bad)):
            change_type_of(bad)


# ---------------------------------------------------------------------------------------------
# The real split file of ../shared/data


def test_real_split_sizes_and_contiguous_blocks():
    splits = read_splits(shared_file("clevr_dc", "split.json"))
    assert {k: len(v) for k, v in splits.items()} == {"train": 40800, "val": 2400, "test": 4800}
    for ids in splits.values():
        assert ids == sorted(ids)
        assert {change_type_of(i) for i in ids} == set(range(6))  # every id in a block
    for block in range(6):
        base = block * 8000
        assert [i for i in splits["train"] if i // 8000 == block] == \
            list(range(base, base + 6800))
        assert [i for i in splits["val"] if i // 8000 == block] == \
            list(range(base + 6800, base + 7200))
        assert [i for i in splits["test"] if i // 8000 == block] == \
            list(range(base + 7200, base + 8000))
