"""Birds-to-Words builder: official TSV + downloaded photos -> ArrayRecord -> grain, errors."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from builder_helpers import build, records, texts, write_feature, write_image

from changecap_jax.data.vocab import END_ID, Vocabulary
from data_prep.builders.base import BuildError
from data_prep.builders.birds_to_words import HEADER, group_pairs, photo_id, read_tsv

LONG = " ".join(["animal1 is smaller than animal2 ."] * 20)  # 120 words: cut at 80 tokens
# (photo1, photo2, split, annN, description, img1 URL override): 8 rows over 4 pairs, the
# rows of a pair spread over the file; pair 647514_9999 has no image file for 9999.
ROWS = [
    ("647514", "5595152", "train", 2, "animal1 has a darker beak than animal2 .", None),
    ("1111", "2222", "val", 1, "animal2 has a longer tail .", None),
    ("647514", "5595152", "train", 1,
     "animal1 is larger than animal2 . animal1 ' s legs appear to be longer .", None),
    ("647514", "9999", "train", 1, "animal1 and animal2 look the same .", None),
    # img1ImgURL without /photos/<id>/: the id comes from the observation URL
    ("3333", "4444", "test", 1, "animal1 is smaller .", "https://example.org/medium.jpg"),
    ("647514", "5595152", "train", 3,
     "animal2 has a white belly while animal1 has a brown belly .", None),
    ("1111", "2222", "val", 2, "animal1 ' s wings are more spotted .", None),
    ("3333", "4444", "test", 2, LONG, None),
]
# photo id -> image file written (9999 is the dead URL: no file)
IMAGES = {"647514": "647514.jpg", "5595152": "5595152.jpg", "1111": "1111.jpg",
          "2222": "2222.png", "3333": "3333.JPG", "4444": "4444.jpeg"}
PAIRS = {  # image_id -> (id, split, descriptions in annN order)
    "647514_5595152": (0, "train", [ROWS[2][4], ROWS[0][4], ROWS[5][4]]),
    "1111_2222": (1, "val", [ROWS[1][4], ROWS[6][4]]),
    "3333_4444": (3, "test", [ROWS[4][4], LONG]),
}
MISSING_REASON = "train pairs with an image missing from images/ (no <photo_id>.jpg/.jpeg/.png)"


def tsv_lines() -> list[list[str]]:
    """The header and one 11-column row per entry of ROWS."""
    lines = [list(HEADER)]
    for k, (p1, p2, split, ann, text, img1_url) in enumerate(ROWS):
        cells = []
        for photo, url, selection in ((p1, img1_url, "base"),
                                      (p2, None, ("visual", "sameGenus", "sameFamily")[k % 3])):
            cells += [f"https://www.inaturalist.org/photos/{photo}",
                      url or f"https://static.inaturalist.org/photos/{photo}/medium.jpg"
                             "?1387577400",
                      "Cardinalis cardinalis", selection]
        lines.append([*cells, split, str(ann), text])
    return lines


def birds_raw(root: Path, edit: Callable[[list[list[str]]], None] | None = None) -> Path:
    """``birds-to-words-v1.0.tsv`` (after ``edit`` of its lines, header at index 0) and
    ``images/<photo_id>.<ext>``."""
    lines = tsv_lines()
    if edit is not None:
        edit(lines)
    root.mkdir(parents=True, exist_ok=True)
    (root / "birds-to-words-v1.0.tsv").write_text(
        "".join("\t".join(cells) + "\n" for cells in lines), encoding="utf-8")
    for k, name in enumerate(IMAGES.values()):
        write_image(root / "images" / name, seed=k)
    return root


def birds_features(features_dir: Path) -> Path:
    """Flat ``<image file name>.npy`` (2048, 7, 7), as data_prep.extract_features writes."""
    for k, name in enumerate(IMAGES.values()):
        write_feature(features_dir, name, seed=k, layer=4)
    return features_dir


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = birds_raw(tmp_path_factory.mktemp("raw"))
    features = birds_features(tmp_path_factory.mktemp("features"))
    return features, build("birds_to_words", root, tmp_path_factory.mktemp("data"),
                           features_dir=features, layer=4)


def test_round_trip_ids_captions_features(built):
    features, prepared = built
    meta = prepared.meta
    assert meta.split_sizes == {"train": 1, "val": 1, "test": 1}
    assert meta.skipped == {MISSING_REASON: 1}  # 647514_9999
    assert meta.feature_shape == (7, 7, 2048)
    assert not meta.has_distractor and meta.change_types == []
    assert meta.tokenizer == "whitespace"
    assert meta.main_metrics == ["CIDEr", "ROUGE_L"]
    for image_id, (i, split, descriptions) in PAIRS.items():
        rec = records(prepared, split)[image_id]
        assert int(rec["id"]) == i
        assert int(rec["change_type"]) == -1
        assert texts(rec["change_captions"]) == descriptions
        for key, photo in zip(("before", "after_semantic"), image_id.split("_"), strict=True):
            chw = np.load(features / f"{IMAGES[photo]}.npy")
            np.testing.assert_array_equal(rec[key], chw.transpose(1, 2, 0))
    for split in ("train", "val", "test"):
        assert len(records(prepared, split)) == 1


def test_vocabulary_from_kept_train_pairs_and_80_token_cap(built):
    _, prepared = built
    assert prepared.vocab == Vocabulary.build(PAIRS["647514_5595152"][2], "whitespace")
    assert "'" in prepared.vocab.word_to_id  # tokens as written, split on whitespace only
    assert "look" not in prepared.vocab.word_to_id  # the dropped pair's words
    assert prepared.meta.max_caption_len == 80
    train = records(prepared, "train")["647514_5595152"]["change_caption_ids"]
    assert [prepared.vocab.decode(r) for r in train] == PAIRS["647514_5595152"][2]
    long_ids = records(prepared, "test")["3333_4444"]["change_caption_ids"][1]
    assert long_ids.shape == (80,) and long_ids[-1] == END_ID and 0 not in long_ids


def test_reader_units(tmp_path):
    assert photo_id("https://static.inaturalist.org/photos/647514/medium.jpg?1387577400",
                    "https://www.inaturalist.org/observations/1") == "647514"
    assert photo_id("https://example.org/x.jpg", "https://www.inaturalist.org/photos/5595152") \
        == "5595152"
    assert photo_id("https://example.org/x.jpg", "https://www.inaturalist.org/photos/") is None
    path = birds_raw(tmp_path) / "birds-to-words-v1.0.tsv"
    rows = read_tsv(path)
    assert [r.line for r in rows] == list(range(2, 10))
    pairs = group_pairs(rows, path)
    assert ["_".join(p.photos) for p in pairs] == \
        ["647514_5595152", "1111_2222", "647514_9999", "3333_4444"]
    assert [p.id for p in pairs] == [0, 1, 2, 3]


def _set(line: int, column: str, value: str) -> Callable[[list[list[str]]], None]:
    def edit(lines: list[list[str]]) -> None:
        lines[line - 1][HEADER.index(column)] = value
    return edit


def _swap_header(lines: list[list[str]]) -> None:
    lines[0][2], lines[0][3] = lines[0][3], lines[0][2]


def _drop_images(*names: str) -> Callable[[Path], None]:
    return lambda root: [(root / "images" / n).unlink() for n in names]


@pytest.mark.parametrize("edit, after, message", [
    (None, lambda root: (root / "birds-to-words-v1.0.tsv").unlink(),
     r"missing annotation file .*birds-to-words-v1\.0\.tsv"),
    (_swap_header, None,
     r"birds-to-words-v1\.0\.tsv: line 1: expected the header \[.*'img1Species', "
     r"'img1Selection'.*found \[.*'img1Selection', 'img1Species'"),
    (lambda lines: lines[3].pop(), None,
     r"birds-to-words-v1\.0\.tsv: line 4: expected 11 tab-separated columns, found 10"),
    (_set(8, "split", "test"), None,
     r"pair 1111_2222 is 'val' at line 3 but 'test' at line 8"),
    (_set(5, "annN", "6"), None, r"line 5: column annN is '6', expected an integer 1\.\.5"),
    (_set(5, "annN", "two"), None, r"line 5: column annN is 'two'"),
    (_set(6, "img2Selection", "sameKingdom"), None,
     r"line 6: column img2Selection is 'sameKingdom', expected one of"),
    (_set(7, "split", "dev"), None, r"line 7: column split is 'dev'"),
    (_set(9, "description", "  "), None, r"line 9: column description is empty"),
    (_set(4, "description", '" animal1 " is big .'), None,
     r"line 4: cannot be parsed as TSV"),
    (lambda lines: (_set(2, "img1ImgURL", "https://example.org/a.jpg")(lines),
                    _set(2, "img1ObservationURL", "https://example.org/obs")(lines)), None,
     r"line 2: column img1ImgURL 'https://example\.org/a\.jpg' has no /photos/<id>/"),
    (None, _drop_images("4444.jpeg"),
     r"every test pair lacks an image in .*images \(1 pair\(s\), e\.g\. '3333_4444'\)"),
    (lambda lines: [r.__setitem__(8, "train") for r in lines[1:] if r[8] == "val"], None,
     r"no row has split 'val'"),
    (None, lambda root: shutil.rmtree(root / "images"), r"missing image folder .*images"),
])
def test_bad_raw_data_stops_with_a_message_and_leaves_nothing(tmp_path, edit, after, message):
    root = birds_raw(tmp_path / "raw", edit)
    if after is not None:
        after(root)
    features = tmp_path / "features"
    features.mkdir()
    with pytest.raises(BuildError, match=message):
        build("birds_to_words", root, tmp_path / "out", features_dir=features, layer=4)
    assert not list((tmp_path / "out").rglob("dataset_info.json"))
    assert not list((tmp_path / "out").rglob("*.array_record*"))


def test_feature_of_the_wrong_shape_names_file_and_shapes(tmp_path):
    root = birds_raw(tmp_path / "raw")
    features = birds_features(tmp_path / "features")
    write_feature(features, "2222.png", seed=0, layer=3)
    with pytest.raises(BuildError, match=r"2222\.png\.npy.*\(1024, 14, 14\).*\(2048, 7, 7\)"):
        build("birds_to_words", root, tmp_path / "out", features_dir=features, layer=4)
    assert not list((tmp_path / "out").rglob("dataset_info.json"))
