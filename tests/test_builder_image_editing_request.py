"""Image Editing Request builder: official raw layout -> ArrayRecord -> grain, its error cases,
the ResNet extraction path (gif included) and the rules checked against the real annotation
files (datasets.md §4, §7.2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from builder_helpers import build, records, texts, write_feature, write_image, write_json
from conftest import shared_file

from changecap_jax.data.vocab import END_ID, UNK_ID, Vocabulary, tokenize_ier
from data_prep.builders.base import BuildError
from data_prep.builders.image_editing_request import (
    ImageEditingRequest,
    read_entries,
    specs_from_entries,
)

FILES = {"train": "train", "valid": "val", "test": "test"}  # official file -> stored split


# ---------------------------------------------------------------------------------------------
# Fixture writers: the official layout with images (and features) for the given entries only


def write_raw(root: Path, entries: dict[str, list[dict[str, Any]]], *, layout: str = "repo",
              features: Path | None = None) -> Path:
    """``layout`` "repo": jsons in ``root/dataset/adobe/`` and images in ``root/images/``;
    "flat": both directly in ``root``. Returns the raw_dir to build from."""
    ann_dir = root / "dataset" / "adobe" if layout == "repo" else root
    image_dir = root / "images" if layout == "repo" else root
    for name, split_entries in entries.items():
        write_json(ann_dir / f"{name}.json", split_entries)
    names = dict.fromkeys(e[k] for es in entries.values() for e in es for k in ("img0", "img1"))
    for seed, name in enumerate(names):
        write_image(image_dir / name, seed=seed)
        if features is not None:
            write_feature(features, name, seed=seed)
    return root


REAL_UIDS = {  # datasets.md §7.2: gif, JPG, jpeg; over-long requests; a valid/test shared pair
    "train": ["Reddit_175", "Reddit_2222", "Zhopped_920"],
    "valid": ["Reddit_271", "Reddit_1255"],
    "test": ["Reddit_5232", "Reddit_948"],
}


def real_slice() -> dict[str, list[dict[str, Any]]]:
    """The entries of REAL_UIDS, plus in train a pair that recurs in two entries (both) and the
    first entry with a png; file order kept."""
    out = {}
    for name, uids in REAL_UIDS.items():
        entries = json.loads(shared_file("image_editing_request", f"{name}.json").read_text())
        keep = set(uids)
        if name == "train":
            pairs: dict[tuple[str, str], list[str]] = {}
            for e in entries:
                pairs.setdefault((e["img0"], e["img1"]), []).append(e["uid"])
            keep |= set(next(u for u in pairs.values() if len(u) == 2))
            keep.add(next(e["uid"] for e in entries
                          if e["img0"].endswith(".png") or e["img1"].endswith(".png")))
        out[name] = [e for e in entries if e["uid"] in keep]
    return out


@pytest.fixture(scope="module")
def real_built(tmp_path_factory):
    entries = real_slice()
    root = tmp_path_factory.mktemp("raw")
    features = root / "features"
    write_raw(root, entries, features=features)
    prepared = build("image_editing_request", root, tmp_path_factory.mktemp("data"),
                     features_dir=features)
    return entries, features, prepared


def test_fixture_covers_the_mixed_formats_and_repeats(real_built):
    entries, _, _ = real_built
    names = [e[k] for es in entries.values() for e in es for k in ("img0", "img1")]
    assert {Path(n).suffix for n in names} >= {".jpg", ".png", ".JPG", ".jpeg", ".gif"}
    pairs = [(e["img0"], e["img1"]) for e in entries["train"]]
    assert len(set(pairs)) < len(pairs)
    shared = {(e["img0"], e["img1"]) for e in entries["valid"]} & {
        (e["img0"], e["img1"]) for e in entries["test"]}
    assert len(shared) == 1  # official splits overlap; kept as distributed


def test_round_trip_ids_captions_features(real_built):
    entries, features, prepared = real_built
    assert prepared.meta.split_sizes == {FILES[n]: len(es) for n, es in entries.items()}
    assert prepared.meta.feature_shape == (14, 14, 1024)
    assert prepared.meta.max_caption_len == 40
    assert prepared.meta.tokenizer == "ier"
    assert prepared.meta.skipped == {}
    next_id = 0
    for name, split_entries in entries.items():
        recs = records(prepared, FILES[name])
        assert list(recs) == [e["uid"] for e in split_entries]
        for e in split_entries:
            rec = recs[e["uid"]]
            assert int(rec["id"]) == next_id  # train, then valid, then test, in file order
            next_id += 1
            assert texts(rec["change_captions"]) == e["sents"]
            expected = prepared.vocab.encode_many(e["sents"], 40, allow_unk=True, truncate=True)
            np.testing.assert_array_equal(rec["change_caption_ids"], expected)
            for key, image in (("before", e["img0"]), ("after_semantic", e["img1"])):
                chw = np.load(features / f"{image}.npy")
                assert rec[key].dtype == np.float32
                np.testing.assert_array_equal(rec[key], chw.transpose(1, 2, 0))


def test_vocabulary_rules_and_the_forced_end(real_built):
    entries, _, prepared = real_built
    sents = [s for n in ("train", "valid") for e in entries[n] for s in e["sents"]]
    assert prepared.vocab == Vocabulary.build(sents, "ier", min_count=3, order="frequency")
    counts = [sum(t == w for s in sents for t in tokenize_ier(s)) for w in
              list(prepared.vocab.word_to_id)[4:]]
    assert counts == sorted(counts, reverse=True) and min(counts) >= 3
    # Zhopped_920 (train) has 42 tokens: cut to 40 with <END> last; rare words are <UNK>.
    rec = records(prepared, "train")["Zhopped_920"]
    ids = np.asarray(rec["change_caption_ids"])[0]
    assert len(tokenize_ier(texts(rec["change_captions"])[0])) == 42
    assert ids.shape == (40,) and ids[-1] == END_ID and UNK_ID in ids


# ---------------------------------------------------------------------------------------------
# Error cases, on hand-written entries (they run without the real files)

HAND = {
    "train": [
        {"img0": "Reddit.com_aa_aa.jpg", "img1": "Reddit.com_aa_bb.png",
         "sents": ["remove the man"], "uid": "Reddit_1"},
        {"img0": "Reddit.com_aa_aa.jpg", "img1": "Reddit.com_aa_bb.png",
         "sents": ["remove the man on the left"], "uid": "Reddit_2"},
    ],
    "valid": [
        {"img0": "Zhopped.com_cc_cc.gif", "img1": "Zhopped.com_cc_dd.JPG",
         "sents": ["Make the man happier. ", "remove the man", "add a hat"], "uid": "Zhopped_3"},
    ],
    "test": [
        {"img0": "Reddit.com_ee_ee.jpeg", "img1": "Reddit.com_ee_ff.jpg",
         "sents": ["remove the cat", "add a dog", "change the sky"], "uid": "Reddit_4"},
    ],
}


def _edit_json(path: Path, fn) -> None:
    path.write_text(json.dumps(fn(json.loads(path.read_text()))))


def _set(entries: list, i: int, **changes) -> list:
    entries[i] = {**entries[i], **changes}
    return entries


@pytest.mark.parametrize("edit, message", [
    (lambda r: (r / "valid.json").unlink(), r"valid\.json"),
    (lambda r: (r / "Zhopped.com_cc_dd.JPG").unlink(),
     r"valid\.json: entry 0 \(uid 'Zhopped_3'\): key 'img1' names image "
     r"'Zhopped\.com_cc_dd\.JPG'"),
    (lambda r: _edit_json(r / "train.json", lambda d: [d[0], {"img0": "a.jpg", "img1": "b.jpg",
                                                              "sents": ["x"]}]),
     r"train\.json: entry 1: missing key 'uid'"),
    (lambda r: _edit_json(r / "test.json", lambda d: _set(d, 0, sents="remove the cat")),
     r"test\.json: entry 0 \(uid 'Reddit_4'\): key 'sents'.*'remove the cat'"),
    (lambda r: _edit_json(r / "test.json", lambda d: _set(d, 0, img0="../x.jpg")),
     r"test\.json: entry 0: key 'img0'.*'\.\./x\.jpg'"),
    (lambda r: _edit_json(r / "train.json", lambda d: {"data": d}),
     r"train\.json: expected a list"),
    (lambda r: _edit_json(r / "test.json", lambda d: _set(d, 0, uid="Reddit_2")),
     r"uid 'Reddit_2' is in both .*train\.json entry 1 and .*test\.json entry 0"),
    (lambda r: _edit_json(r / "valid.json", lambda d: _set(d, 0, uid="Zhopped_3", sents=[
        "make it brighter", " ", "add a hat"])), r"Zhopped_3.*empty caption"),
    (lambda r: [p.unlink() for p in r.glob("*.json")], r"none in .*dataset/adobe"),
])
def test_bad_raw_data_stops_with_a_message_and_leaves_nothing(tmp_path, edit, message):
    raw = write_raw(tmp_path / "raw", HAND, layout="flat")
    edit(raw)
    features = tmp_path / "features"
    features.mkdir()
    with pytest.raises(ValueError, match=message):  # BuildError, or CaptionError (empty)
        build("image_editing_request", raw, tmp_path / "out", features_dir=features)
    assert not list((tmp_path / "out").rglob("dataset_info.json"))
    assert not list((tmp_path / "out").rglob("*.array_record*"))


def test_flat_layout_builds_and_a_wrong_feature_shape_is_named(tmp_path):
    features = tmp_path / "features"
    raw = write_raw(tmp_path / "raw", HAND, layout="flat", features=features)
    prepared = build("image_editing_request", raw, tmp_path / "ok", features_dir=features)
    assert prepared.meta.split_sizes == {"train": 2, "val": 1, "test": 1}
    # the, man, remove: the train + valid words seen at least 3 times, most frequent first
    assert list(prepared.vocab.word_to_id)[4:] == ["the", "man", "remove"]
    rec = records(prepared, "train")["Reddit_2"]
    assert prepared.vocab.decode(rec["change_caption_ids"][0]) == "remove the man <UNK> the <UNK>"

    np.save(features / "Reddit.com_ee_ff.jpg.npy", np.zeros((2048, 7, 7), np.float32))
    with pytest.raises(BuildError, match=r"Reddit\.com_ee_ff\.jpg\.npy.*\(2048, 7, 7\).*"
                                         r"\(1024, 14, 14\)"):
        build("image_editing_request", raw, tmp_path / "bad", features_dir=features)
    assert not list((tmp_path / "bad").rglob("dataset_info.json"))


def test_builder_rules():
    cls = ImageEditingRequest
    assert (cls.DEFAULT_LAYER, cls.TOKENIZER, cls.VOCAB_SPLITS) == (3, "ier", ("train", "val"))
    assert (cls.VOCAB_MIN_COUNT, cls.VOCAB_ORDER, cls.DEFAULT_MAX_CAPTION_LEN) == (
        3, "frequency", 40)
    assert cls.MAIN_METRICS == ("CIDEr",)


# ---------------------------------------------------------------------------------------------
# The ResNet extraction path (random weights), with a gif


@pytest.mark.torch
def test_extraction_path_reads_a_gifs_first_frame(tmp_path):
    torch = pytest.importorskip("torch")
    from PIL import Image

    from changecap_jax.features.extract import extract_features
    from changecap_jax.features.preprocess import read_rgb
    from changecap_jax.features.resnet import ResNet

    torch.manual_seed(0)
    weights = tmp_path / "resnet101.pth"
    torch.save(ResNet().state_dict(), weights)
    # Train and test name one image twice: one forward pass each keeps the test short.
    entries = {"train": [_set(HAND["train"][:1], 0, img1=HAND["train"][0]["img0"])[0]],
               "valid": HAND["valid"],
               "test": [_set(HAND["test"][:1], 0, img1=HAND["test"][0]["img0"])[0]]}
    raw = write_raw(tmp_path / "raw", entries, layout="flat")
    gif = raw / "Zhopped.com_cc_cc.gif"
    with Image.open(gif) as im:
        frames = []
        for k in range(2):
            im.seek(k)
            frames.append(np.asarray(im.convert("RGB")))
    np.testing.assert_array_equal(read_rgb(gif), frames[0])  # the first frame, as RGB
    assert not np.array_equal(frames[0], frames[1])

    prepared = build("image_editing_request", raw, tmp_path / "out", weights=weights)
    rec = records(prepared, "val")["Zhopped_3"]
    assert rec["before"].shape == (14, 14, 1024)
    assert prepared.meta.extractor == "resnet101_layer3"
    [(_, direct)] = list(extract_features([gif], weights, layer=3))
    np.testing.assert_allclose(rec["before"], direct.transpose(1, 2, 0), rtol=1e-5, atol=1e-5)
    for split in ("train", "test"):
        for r in records(prepared, split).values():
            assert np.isfinite(r["before"]).all() and np.isfinite(r["after_semantic"]).all()


# ---------------------------------------------------------------------------------------------
# The real annotation files of ../shared/data


def _real_entries() -> dict[str, list[dict[str, Any]]]:
    return {n: read_entries(shared_file("image_editing_request", f"{n}.json")) for n in FILES}


def test_real_split_sizes_references_and_uids():
    entries = _real_entries()
    specs = specs_from_entries(entries)  # raises on a repeated uid
    assert {s: len(v) for s, v in specs.items()} == {"train": 3061, "val": 383, "test": 495}
    assert {len(s.change_captions) for s in specs["train"]} == {1}
    assert {len(s.change_captions) for s in specs["val"] + specs["test"]} == {3}
    every = [s for v in specs.values() for s in v]
    assert len({s.image_id for s in every}) == 3939
    assert [s.id for s in every] == list(range(3939))
    assert all(c.strip() for s in every for c in s.change_captions)  # no empty request
    exts = {Path(s.images[k]).suffix for s in every for k in s.images}
    assert exts == {".jpg", ".png", ".JPG", ".jpeg", ".gif"}


def test_real_vocabulary_has_808_entries():
    specs = specs_from_entries(_real_entries())
    cls = ImageEditingRequest
    sents = [c for split in cls.VOCAB_SPLITS for s in specs[split] for c in s.change_captions]
    vocab = Vocabulary.build(sents, cls.TOKENIZER, min_count=cls.VOCAB_MIN_COUNT,
                             order=cls.VOCAB_ORDER)
    assert len(vocab) == 808  # datasets.md §4, the 4 specials included
    assert sum(len(tokenize_ier(c)) > 40 for c in sents) == 7  # cut with a forced <END>
