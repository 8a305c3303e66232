"""IDC-PCL's cross-task sources (appendix A.3): CUB-200-2011 + text_c10 and NABirds in their
official layouts (tiny fixtures written here), the builder, pairs and batch mixing."""

from __future__ import annotations

import collections
import json
import uuid
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from changecap_jax.data.vocab import Vocabulary
from data_prep import cross_task

CUB_CLASSES = {1: "001.Black_footed_Albatross", 2: "002.Laysan_Albatross",
               3: "003.Sooty_Albatross"}


def _jpeg(path: Path, seed: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (12, 16, 3), np.uint8)).save(path)


def write_cub(root: Path) -> Path:
    raw = root / "CUB_200_2011"
    images, labels, split = [], [], []
    for n in range(1, 9):
        cls = (n - 1) % 3 + 1
        rel = f"{CUB_CLASSES[cls]}/{CUB_CLASSES[cls][4:]}_{n:04d}_{n}.jpg"
        _jpeg(raw / "images" / rel, n)
        images.append(f"{n} {rel}")
        labels.append(f"{n} {cls}")
        split.append(f"{n} {int(n % 4 != 0)}")
        text = raw / "text_c10" / Path(rel).with_suffix(".txt")
        text.parent.mkdir(parents=True, exist_ok=True)
        text.write_text("".join(f"this bird has a {w} beak number {n}\n"
                                for w in ("long", "short")))
    (raw / "images.txt").write_text("\n".join(images) + "\n")
    (raw / "image_class_labels.txt").write_text("\n".join(labels) + "\n")
    (raw / "train_test_split.txt").write_text("\n".join(split) + "\n")
    (raw / "classes.txt").write_text("".join(f"{k} {v}\n" for k, v in CUB_CLASSES.items()))
    return raw


def write_nabirds(root: Path) -> tuple[Path, list[str]]:
    raw = root / "nabirds"
    class_ids = ["295", "1010", "313"]  # not contiguous, not sorted
    ids = [str(uuid.UUID(int=n)) for n in range(1, 9)]
    images, labels, split = [], [], []
    for n, image_id in enumerate(ids):
        cls = class_ids[n % 3]
        rel = f"{int(cls):04d}/{image_id.replace('-', '')}.jpg"
        _jpeg(raw / "images" / rel, 100 + n)
        images.append(f"{image_id} {rel}")
        labels.append(f"{image_id} {cls}")
        split.append(f"{image_id} {int(n < 6)}")
    (raw / "images.txt").write_text("\n".join(images) + "\n")
    (raw / "image_class_labels.txt").write_text("\n".join(labels) + "\n")
    (raw / "train_test_split.txt").write_text("\n".join(split) + "\n")
    (raw / "classes.txt").write_text("0 Birds\n295 Black-footed Albatross\n313 Laysan Albatross"
                                     "\n1010 Sooty Albatross (Adult)\n")
    return raw, ids


def fake_features(paths):
    """A deterministic 2x2x3 grid per image: its mean colour per quadrant."""
    out = []
    for p in paths:
        a = np.asarray(Image.open(p), np.float32)
        out.append(a.reshape(2, 6, 2, 8, 3).mean(axis=(1, 3)))
    return np.stack(out)


def test_cub_parsing(tmp_path):
    examples = cross_task.read_cub(write_cub(tmp_path))
    assert [e.image_id for e in examples] == [str(n) for n in range(1, 9)]
    assert [e.split for e in examples] == ["test" if n % 4 == 0 else "train"
                                           for n in range(1, 9)]
    assert [e.label for e in examples] == [(n - 1) % 3 + 1 for n in range(1, 9)]
    assert examples[4].captions == ("this bird has a long beak number 5",
                                    "this bird has a short beak number 5")
    assert examples[4].image_path.name == "Laysan_Albatross_0005_5.jpg"


def test_nabirds_parsing_maps_sparse_class_ids(tmp_path):
    raw, ids = write_nabirds(tmp_path)
    examples = cross_task.read_nabirds(raw)
    assert [e.image_id for e in examples] == ids
    # Used classes 295, 313, 1010 -> 0, 1, 2 in numeric order (not file order).
    assert {(e.class_id, e.label, e.label_name) for e in examples} == {
        ("295", 0, "Black-footed Albatross"), ("313", 1, "Laysan Albatross"),
        ("1010", 2, "Sooty Albatross (Adult)")}
    assert [e.split for e in examples] == ["train"] * 6 + ["test"] * 2


@pytest.mark.parametrize("damage,match", [
    (lambda raw: (raw / "classes.txt").unlink(), r"classes\.txt is missing"),
    (lambda raw: (raw / "images.txt").write_text("1 a.jpg\n2\n"), r"images\.txt:2: expected 2"),
    (lambda raw: (raw / "train_test_split.txt").write_text("1 1\n"), "different image ids"),
    (lambda raw: (raw / "train_test_split.txt").write_text(
        "".join(f"{n} {2 if n == 3 else 1}\n" for n in range(1, 9))), "split flag '2'"),
    (lambda raw: next((raw / "images").rglob("*_0006_6.jpg")).unlink(), "_0006_6.jpg' is missing"),
    (lambda raw: next((raw / "text_c10").rglob("*_0002_2.txt")).unlink(), r"_0002_2\.txt is "
     "missing"),
])
def test_cub_layout_errors_name_the_file(tmp_path, damage, match):
    raw = write_cub(tmp_path)
    damage(raw)
    with pytest.raises(cross_task.LayoutError, match=match):
        cross_task.read_cub(raw)


def test_nabirds_layout_errors(tmp_path):
    raw, ids = write_nabirds(tmp_path)
    labels = (raw / "image_class_labels.txt").read_text()
    (raw / "image_class_labels.txt").write_text(labels.replace(" 313\n", " 999\n", 1))
    with pytest.raises(cross_task.LayoutError, match="999"):
        cross_task.read_nabirds(raw)
    (raw / "image_class_labels.txt").write_text(labels)
    (raw / "images.txt").write_text((raw / "images.txt").read_text().replace(ids[0], "x1", 1))
    with pytest.raises(cross_task.LayoutError, match=r"images\.txt: entry 1 has id 'x1'"):
        cross_task.read_nabirds(raw)


def test_builders_round_trip(tmp_path):
    cub = cross_task.read_cub(write_cub(tmp_path))
    vocab = Vocabulary.build([c for e in cub if e.split == "train" for c in e.captions])
    out = cross_task.build_source(cub, fake_features, tmp_path / "cub_out", source="cub",
                                  vocab=vocab, batch_size=3)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["splits"] == {"train": 6, "test": 2} and meta["feature_shape"] == [2, 2, 3]
    test = np.load(out / "test.npz")
    chosen = [e for e in cub if e.split == "test"]
    assert list(test["image_ids"]) == [e.image_id for e in chosen]
    np.testing.assert_allclose(test["features"], fake_features([e.image_path for e in chosen]),
                               rtol=1e-3)  # float16
    for row, e in zip(test["caption_ids"], chosen, strict=True):
        for ids, caption in zip(row, e.captions, strict=True):
            np.testing.assert_array_equal(ids, vocab.encode(caption, len(ids), allow_unk=True))
    with pytest.raises(FileExistsError):
        cross_task.build_source(cub, fake_features, out, source="cub", vocab=vocab)

    raw, _ = write_nabirds(tmp_path)
    birds = cross_task.read_nabirds(raw)
    out = cross_task.build_source(birds, fake_features, tmp_path / "nab_out", source="nabirds")
    train = np.load(out / "train.npz")
    assert list(train["labels"]) == [e.label for e in birds if e.split == "train"]
    labels = json.loads((out / "meta.json").read_text())["labels"]
    assert [(x["index"], x["class_id"]) for x in labels] == [(0, "295"), (1, "313"),
                                                             (2, "1010")]


def test_classification_pairs_half_same_class():
    labels = [0, 0, 1, 1, 2, 2, 2]
    pairs = cross_task.classification_pairs(labels, 40, seed=1)
    same = [labels[i] == labels[j] for i, j, _ in pairs]
    assert same == [True] * 20 + [False] * 20
    assert all(i != j for i, j, _ in pairs)
    np.testing.assert_array_equal(pairs[:, 2], same)
    np.testing.assert_array_equal(pairs, cross_task.classification_pairs(labels, 40, seed=1))


def test_batch_mixing_keeps_the_ratio():
    assert cross_task.mixed_batch_rows(20, (4, 1)) == (16, 4)
    with pytest.raises(ValueError, match="multiple of 5"):
        cross_task.mixed_batch_rows(12, (4, 1))
    batches = cross_task.mixed_batches(iter(range(10**6)), iter(range(-1, -10**6, -1)), 10,
                                       (4, 1), seed=3)
    first = [next(batches) for _ in range(50)]
    counts = collections.Counter(source for batch in first for source, _ in batch)
    assert counts == {"pairs": 400, "extra": 100}
    # Every row of each source is used once, in order; the in-batch order is shuffled.
    pair_rows = [row for batch in first for s, row in batch if s == "pairs"]
    assert sorted(pair_rows) == list(range(400))
    assert any([s for s, _ in b] != ["pairs"] * 8 + ["extra"] * 2 for b in first)
    again = cross_task.mixed_batches(iter(range(10**6)), iter(range(-1, -10**6, -1)), 10,
                                     (4, 1), seed=3)
    assert [next(again) for _ in range(50)] == first
