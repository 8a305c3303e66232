"""Spot-the-Diff builder: official raw layout -> ArrayRecord -> grain, its error cases, and the
rules checked against the real annotation files (datasets.md §3, §7.2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from builder_helpers import build, records, texts, write_feature, write_image, write_json
from conftest import shared_file

from changecap_jax.data.vocab import END_ID, START_ID, UNK_ID, Vocabulary
from changecap_jax.evaluators.results import references_from_coco
from data_prep.builders.base import BuildError
from data_prep.builders.spot_the_diff import (
    NO_SENTENCE_TARGET,
    SpotTheDiff,
    find_annotation_dir,
    find_image_root,
    official_references,
    read_entries,
    specs_from_entries,
)

SPLITS = ("train", "val", "test")


# ---------------------------------------------------------------------------------------------
# Fixture writers: the official layout, images and features for the given entries only


def write_raw(root: Path, entries: dict[str, list[dict[str, Any]]], *, layout: str = "repo",
              jpg_ids: tuple[str, ...] = (), features: Path | None = None) -> Path:
    """``layout`` "repo": ``root/data/annotations/`` + ``root/data/resized_images/`` (the
    repository); "flat": both directly in ``root``. Ids in ``jpg_ids`` get a ``.jpg`` after
    image (airsplay's loader accepts either). Returns the raw_dir to build from."""
    data = root / "data" if layout == "repo" else root
    ann_dir = data / "annotations" if layout == "repo" else root
    for split, split_entries in entries.items():
        write_json(ann_dir / f"{split}.json", split_entries)
    ids = dict.fromkeys(e["img_id"] for es in entries.values() for e in es)
    for n, img_id in enumerate(ids):
        after_ext = ".jpg" if img_id in jpg_ids else ".png"
        for name, seed in ((f"{img_id}.png", 2 * n), (f"{img_id}_2{after_ext}", 2 * n + 1)):
            write_image(data / "resized_images" / name, seed=seed, size=(224, 224))
            if features is not None:
                write_feature(features, name, seed=seed)
        write_image(data / "resized_images" / f"{img_id}_diff.jpg", seed=1000 + n)
    return root


def _groups(entries: list[dict[str, Any]]) -> dict[str, list[list[str]]]:
    out: dict[str, list[list[str]]] = {}
    for e in entries:
        out.setdefault(e["img_id"], []).append(e["sentences"])
    return out


def real_slice() -> dict[str, list[dict[str, Any]]]:
    """A few real entries per split (file order kept): a 3-entry id, an entry mixing an empty
    and a real sentence, "there are no differences", an id whose sentences are all empty (train:
    skipped; test: kept), a 2-entry id in val and test, and an ordinary id."""
    out = {}
    for split in SPLITS:
        entries = json.loads(shared_file("spot_the_diff", f"{split}.json").read_text())
        groups = _groups(entries)
        chosen: list[str] = []

        def pick(test, chosen=chosen, groups=groups) -> None:
            chosen.append(next(i for i, g in groups.items() if i not in chosen and test(g)))

        if split == "train":
            pick(lambda g: len(g) == 3)
            pick(lambda g: any("" in s and any(x.strip() for x in s) for s in g))
            pick(lambda g: g == [["there are no differences"]])
        else:
            pick(lambda g: len(g) == 2)
        if split != "val":
            pick(lambda g: not any(x.strip() for s in g for x in s))
        pick(lambda g: len(g) == 1 and len(g[0]) >= 2 and all(x.strip() for x in g[0]))
        out[split] = [e for e in entries if e["img_id"] in chosen]
    return out


@pytest.fixture(scope="module")
def real_built(tmp_path_factory):
    entries = real_slice()
    root = tmp_path_factory.mktemp("raw")
    features = root / "features"
    jpg = (entries["train"][-1]["img_id"],)
    write_raw(root, entries, jpg_ids=jpg, features=features)
    prepared = build("spot_the_diff", root, tmp_path_factory.mktemp("data"),
                     features_dir=features)
    return entries, features, jpg, prepared


def test_round_trip_ids_references_targets_annotators_features(real_built):
    entries, features, jpg, prepared = real_built
    empty_train = [i for i, g in _groups(entries["train"]).items()
                   if not any(x.strip() for s in g for x in s)]
    assert len(empty_train) == 1
    assert prepared.meta.skipped == {"train img_ids whose sentences are all empty": 1}
    assert prepared.meta.feature_shape == (14, 14, 1024)
    assert not prepared.meta.has_distractor
    assert prepared.meta.tokenizer == "clevr"
    seen_placeholder = False
    for split in SPLITS:
        groups = {i: g for i, g in _groups(entries[split]).items() if i not in empty_train}
        recs = records(prepared, split)
        assert prepared.meta.split_sizes[split] == len(groups)
        assert list(recs) == list(groups)  # order of first appearance
        for img_id, g in groups.items():
            rec = recs[img_id]
            assert int(rec["id"]) == int(img_id)
            refs = [x for s in g for x in s]
            assert texts(rec["change_captions"]) == refs  # empty sentences kept
            assert rec["annotation_index"].tolist() == [k for k, s in enumerate(g) for _ in s]
            targets = [x for x in refs if x.strip()]
            ids = np.asarray(rec["change_caption_ids"])
            if targets:
                expected = prepared.vocab.encode_many(
                    targets, prepared.meta.max_caption_len, allow_unk=split != "train")
                np.testing.assert_array_equal(ids, expected)
            else:  # a test id with only empty sentences: kept, placeholder target
                assert split == "test" and refs == [""]
                assert ids[:, :4].tolist() == [[START_ID, UNK_ID, END_ID, 0]]
                seen_placeholder = True
            after = f"{img_id}_2.jpg" if img_id in jpg else f"{img_id}_2.png"
            for key, name in (("before", f"{img_id}.png"), ("after_semantic", after)):
                chw = np.load(features / f"{name}.npy")
                assert rec[key].dtype == np.float32
                np.testing.assert_array_equal(rec[key], chw.transpose(1, 2, 0))
    assert seen_placeholder


def test_vocabulary_is_every_train_target_word_sorted(real_built):
    entries, _, _, prepared = real_built
    targets = [x for e in entries["train"] for x in e["sentences"] if x.strip()]
    assert prepared.vocab == Vocabulary.build(targets, "clevr")
    assert list(prepared.vocab.word_to_id)[4:] == sorted(list(prepared.vocab.word_to_id)[4:])
    every = [x for es in entries.values() for e in es for x in e["sentences"] if x.strip()]
    longest = max(len(x.split(" ")) for x in every) + 2
    assert prepared.meta.max_caption_len == longest


def _broken(tmp_path: Path, edit) -> Path:
    raw = write_raw(tmp_path / "raw", json.loads(json.dumps(HAND)), layout="flat",
                    jpg_ids=("7",))
    edit(raw)
    return raw


HAND = {  # hand-written entries, so the error cases run without the real files
    "train": [{"img_id": "5", "sentences": ["the white car is gone", ""]},
              {"img_id": "7", "sentences": ["there are no differences"]},
              {"img_id": "5", "sentences": ["a person walked into the lot"]}],
    "val": [{"img_id": "12", "sentences": ["the truck has moved"]}],
    "test": [{"img_id": "400", "sentences": ["two people have moved", "a car is parked"]}],
}


def _edit_json(path: Path, fn) -> None:
    path.write_text(json.dumps(fn(json.loads(path.read_text()))))


@pytest.mark.parametrize("edit, message", [
    (lambda r: (r / "val.json").unlink(), r"val\.json"),
    (lambda r: (r / "resized_images" / "7_2.jpg").unlink(), r"7_2\.png or .*7_2\.jpg"),
    (lambda r: (r / "resized_images" / "400.png").unlink(), r"test img_id '400'.*400\.png"),
    (lambda r: _edit_json(r / "train.json", lambda d: [*d, {"img_id": 9, "sentences": ["x"]}]),
     r"train\.json: entry 3: key 'img_id'.*found 9"),
    (lambda r: _edit_json(r / "val.json", lambda d: [{"img_id": "12", "sentence": ["x"]}]),
     r"val\.json: entry 0: missing key 'sentences'"),
    (lambda r: _edit_json(r / "test.json", lambda d: [{"img_id": "4", "sentences": "a cat"}]),
     r"test\.json: entry 0 \(img_id 4\): key 'sentences'.*'a cat'"),
    (lambda r: _edit_json(r / "test.json", lambda d: {"400": d}), r"test\.json: expected a list"),
    (lambda r: _edit_json(r / "test.json", lambda d: [*d, {"img_id": "7", "sentences": ["x"]}]),
     r"img_id '7' is in both .*train\.json and .*test\.json"),
    (lambda r: (r / "train.json").write_text("[{"), r"train\.json is not valid JSON"),
    (lambda r: [p.unlink() for p in r.glob("*.json")], r"none in .*annotations"),
])
def test_bad_raw_data_stops_with_a_message_and_leaves_nothing(tmp_path, edit, message):
    raw = _broken(tmp_path, edit)
    features = tmp_path / "features"
    features.mkdir()
    with pytest.raises(BuildError, match=message):
        build("spot_the_diff", raw, tmp_path / "out", features_dir=features)
    assert not list((tmp_path / "out").rglob("dataset_info.json"))
    assert not list((tmp_path / "out").rglob("*.array_record*"))


def test_flat_layout_builds_and_a_wrong_feature_shape_is_named(tmp_path):
    features = tmp_path / "features"
    raw = write_raw(tmp_path / "raw", HAND, layout="flat", jpg_ids=("7",), features=features)
    prepared = build("spot_the_diff", raw, tmp_path / "ok", features_dir=features)
    assert prepared.meta.split_sizes == {"train": 2, "val": 1, "test": 1}
    rec = records(prepared, "train")["5"]
    assert texts(rec["change_captions"]) == ["the white car is gone", "",
                                             "a person walked into the lot"]
    assert rec["annotation_index"].tolist() == [0, 0, 1]
    assert [prepared.vocab.decode(r) for r in rec["change_caption_ids"]] == [
        "the white car is gone", "a person walked into the lot"]

    np.save(features / "400.png.npy", np.zeros((2048, 7, 7), np.float32))
    with pytest.raises(BuildError, match=r"400\.png\.npy.*\(2048, 7, 7\).*\(1024, 14, 14\)"):
        build("spot_the_diff", raw, tmp_path / "bad", features_dir=features)
    assert not list((tmp_path / "bad").rglob("dataset_info.json"))


def test_annotation_and_image_folders_are_found_in_each_layout(tmp_path):
    for n, sub in enumerate(("annotations", "data/annotations", ".")):
        root = tmp_path / f"layout{n}"
        write_json(root / sub / "test.json", [])
        assert find_annotation_dir(root) == root / sub
    (tmp_path / "x" / "data" / "resized_images").mkdir(parents=True)
    assert find_image_root(tmp_path / "x") == tmp_path / "x" / "data"
    with pytest.raises(BuildError, match="resized_images"):
        find_image_root(tmp_path / "y")


def test_builder_rules():
    assert SpotTheDiff.DEFAULT_LAYER == 3
    assert (SpotTheDiff.TOKENIZER, SpotTheDiff.VOCAB_SPLITS) == ("clevr", ("train",))
    assert (SpotTheDiff.VOCAB_MIN_COUNT, SpotTheDiff.VOCAB_ORDER) == (1, "sorted")
    assert SpotTheDiff.DEFAULT_MAX_CAPTION_LEN == 0
    assert SpotTheDiff.MAIN_METRICS == ("CIDEr",)
    assert "ddla_rerun_gtfile.json" in SpotTheDiff.PROTOCOL


# ---------------------------------------------------------------------------------------------
# The real annotation files of ../shared/data


def _real_entries() -> dict[str, list[dict[str, Any]]]:
    return {s: read_entries(shared_file("spot_the_diff", f"{s}.json")) for s in SPLITS}


def test_real_files_counts():
    entries = _real_entries()
    counts = {s: (len(es), len({e["img_id"] for e in es}),
                  sum(len(e["sentences"]) for e in es),
                  sum(x == "" for e in es for x in e["sentences"]),
                  sum(not x.strip() for e in es for x in e["sentences"]))
              for s, es in entries.items()}
    assert counts == {"train": (9524, 8566, 17676, 53, 53), "val": (1634, 1493, 3310, 6, 6),
                      "test": (1404, 1270, 2107, 7, 7)}


def test_real_references_equal_the_official_ground_truth_file():
    gt = json.loads(shared_file("spot_the_diff", "ddla_rerun_gtfile.json").read_text())
    official = references_from_coco(gt)
    refs = official_references(read_entries(shared_file("spot_the_diff", "test.json")))
    assert list(refs) == list(official)  # same ids, same order
    assert refs == official
    assert len(refs) == 1270 and sum(map(len, refs.values())) == 2107
    # The official file keeps the empty sentences: 7 ids whose only reference is "".
    assert sorted(i for i, r in refs.items() if "" in r) == sorted(
        i for i, r in refs.items() if r == [""])
    assert sum(r == [""] for r in refs.values()) == 7


def test_real_records_skips_placeholders_and_vocabulary():
    specs, skipped = specs_from_entries(_real_entries())  # also checks split disjointness
    assert {s: len(v) for s, v in specs.items()} == {"train": 8529, "val": 1489, "test": 1270}
    assert skipped == {"train img_ids whose sentences are all empty": 37,
                       "val img_ids whose sentences are all empty": 4}
    assert sum(s.change_captions == [NO_SENTENCE_TARGET] for s in specs["test"]) == 7
    for split_specs in specs.values():
        for s in split_specs:
            assert len(s.extra["annotation_index"]) == len(s.references)
    vocab = Vocabulary.build([c for s in specs["train"] for c in s.change_captions], "clevr")
    assert len(vocab) == 2054 + 4  # datasets.md §3: 2,054 words at threshold 1


def test_real_references_give_cards_paragraphs():
    """The multi-change setting (tuyunbin/CARD): all sentences of all entries joined with ". "
    and cut to 60 words, derivable from the stored references."""
    card = json.loads(
        shared_file("spot_the_diff", "tuyunbin_CARD", "change_multi_captions.json").read_text())
    specs, _ = specs_from_entries(_real_entries())
    n = 0
    for split_specs in specs.values():
        for s in split_specs:
            paragraph = " ".join(". ".join(s.references).split(" ")[:60])
            assert card[f"{s.id:06d}.png"] == [paragraph]
            n += 1
    assert n == 11288  # 11,329 CARD ids less the 41 train / val ids without any sentence
