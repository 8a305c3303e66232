"""IDC-PCL's cross-task sources (appendix A.3): CUB-200-2011 + text_c10 and NABirds readers on
tiny fixtures written here in the official layouts, the feature builder, the half-same-class
pairs and the batch mixing.

The fixtures list image_class_labels.txt and train_test_split.txt in another order than
images.txt, so joining by position instead of by id fails; expected values come from the
fixture tables, line numbers from searching the written files."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from changecap_jax.data import extra_source
from changecap_jax.data.vocab import UNK_ID, Vocabulary
from data_prep import cross_task as ct

REPO = Path(__file__).resolve().parents[1]

CUB_CLASSES = {1: "001.Black_footed_Albatross", 2: "002.Laysan_Albatross",
               3: "003.Sooty_Albatross", 4: "004.Groove_billed_Ani"}  # class 4: no image
CUB_IMAGES = {1: (1, 1), 2: (2, 1), 3: (3, 0), 4: (1, 1),  # id -> (class id, 1 train | 0 test)
              5: (2, 0), 6: (3, 1), 7: (1, 1), 8: (2, 1)}
COLOURS = ("red", "brown", "white", "grey")

# NABirds: sparse class ids; classes.txt also lists inner hierarchy nodes (0, 1) and is unsorted.
NAB_CLASSES = "0 Birds\n1 Perching Birds\n1010 Sooty Albatross (Adult)\n295 Black-footed " \
              "Albatross\n313 Laysan  Albatross\n799 Red-tailed Hawk (Dark morph)\n"
NAB_LABELS = [295, 1010, 313, 799, 295, 1010, 799, 313]  # per image, images.txt order
NAB_SPLIT = [1, 1, 0, 1, 1, 0, 1, 1]
NAB_EXPECTED = [(0, 295, "Black-footed Albatross", "black-footed albatross"),
                (1, 313, "Laysan Albatross", "laysan albatross"),
                (2, 799, "Red-tailed Hawk (Dark morph)", "red-tailed hawk dark morph"),
                (3, 1010, "Sooty Albatross (Adult)", "sooty albatross adult")]


# ---------------------------------------------------------------------------------------------
# Fixtures in the official layouts


def _written_split(directory: Path, split: str, *, mmap: bool = True) -> dict[str, np.ndarray]:
    """The files of one split as build_source writes them: the ``.npz`` arrays plus
    ``features`` (the library reads them through extra_source.open_source)."""
    with np.load(directory / f"{split}.npz", allow_pickle=False) as arrays:
        out = {k: arrays[k] for k in arrays.files}
    out["features"] = np.load(directory / f"{split}.features.npy", allow_pickle=False,
                              mmap_mode="r" if mmap else None)
    return out


def _jpeg(path: Path, seed: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (12, 16, 3), np.uint8)).save(path)


def _write_lines(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{line}\n" for line in lines))


def cub_relative(n: int) -> str:
    folder = CUB_CLASSES[CUB_IMAGES[n][0]]
    return f"{folder}/{folder[4:]}_{n:04d}_{700 + n}.jpg"


def cub_captions(n: int) -> list[str]:
    """Ten per image; "imageN" only appears in image N's captions (so test words are unseen)."""
    return [f"image{n} bird has a {COLOURS[(n + k) % 4]} crown, short beak."
            + (" and a long tail" if k % 3 == 0 else "") for k in range(10)]


def write_cub(root: Path) -> Path:
    raw = root / "CUB_200_2011"
    for n in CUB_IMAGES:
        _jpeg(raw / "images" / cub_relative(n), n)
        _write_lines(raw / "text_c10" / Path(cub_relative(n)).with_suffix(".txt"),
                     cub_captions(n))
    order = [3, 8, 1, 6, 2, 7, 4, 5]  # not images.txt's order
    _write_lines(raw / "images.txt", [f"{n} {cub_relative(n)}" for n in CUB_IMAGES])
    _write_lines(raw / "image_class_labels.txt", [f"{n} {CUB_IMAGES[n][0]}" for n in order])
    _write_lines(raw / "train_test_split.txt", [f"{n} {CUB_IMAGES[n][1]}" for n in order[::-1]])
    _write_lines(raw / "classes.txt", [f"{k} {v}" for k, v in CUB_CLASSES.items()])
    _write_lines(raw / "bounding_boxes.txt", [f"{n} 1.0 2.0 8.0 6.0" for n in CUB_IMAGES])
    return raw


def nabirds_ids() -> list[str]:
    return [str(uuid.UUID(int=(n + 1) * 0x1234567890ABCDEF)) for n in range(len(NAB_LABELS))]


def nabirds_relative(image_id: str, class_id: int) -> str:
    return f"{class_id:04d}/{image_id.replace('-', '')}.jpg"


def write_nabirds(root: Path) -> Path:
    raw = root / "nabirds"
    ids = nabirds_ids()
    for n, (image_id, cls) in enumerate(zip(ids, NAB_LABELS, strict=True)):
        _jpeg(raw / "images" / nabirds_relative(image_id, cls), 100 + n)
    order = [5, 2, 7, 0, 3, 6, 1, 4]
    _write_lines(raw / "images.txt", [f"{i} {nabirds_relative(i, c)}"
                                      for i, c in zip(ids, NAB_LABELS, strict=True)])
    _write_lines(raw / "image_class_labels.txt", [f"{ids[n]} {NAB_LABELS[n]}" for n in order])
    _write_lines(raw / "train_test_split.txt", [f"{ids[n]} {NAB_SPLIT[n]}" for n in order[::-1]])
    (raw / "classes.txt").write_text(NAB_CLASSES)
    _write_lines(raw / "hierarchy.txt", ["1 0", "295 1", "313 1", "799 1", "1010 1"])
    _write_lines(raw / "bounding_boxes.txt", [f"{i} 1 2 8 6" for i in ids])
    return raw


def line_of(path: Path, key: str) -> int:
    """The 1-based line of ``path`` whose first field is ``key``."""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.split()[:1] == [key]:
            return number
    raise AssertionError(f"{key} not in {path}")


def fake_features(paths):
    """A deterministic 2x2x3 grid per image: its mean colour per quadrant."""
    return np.stack([np.asarray(Image.open(p), np.float32).reshape(2, 6, 2, 8, 3).mean((1, 3))
                     for p in paths])


# ---------------------------------------------------------------------------------------------
# Readers


def test_cub_reader_joins_the_files_by_id(tmp_path):
    raw = write_cub(tmp_path)
    source = ct.read_cub(raw)
    assert source.task == "caption"
    assert [e.image_id for e in source.examples] == [str(n) for n in CUB_IMAGES]
    for e in source.examples:
        cls, flag = CUB_IMAGES[int(e.image_id)]
        assert e.split == ("train" if flag else "test")
        assert e.label_id == cls - 1
        assert e.image_path == raw / "images" / cub_relative(int(e.image_id))
        assert e.captions == cub_captions(int(e.image_id))
    # Labels cover the classes images use (not class 4), names cleaned for people and text.
    assert [(x.label_id, x.class_id, x.name, x.text) for x in source.labels] == [
        (0, 1, "Black footed Albatross", "black footed albatross"),
        (1, 2, "Laysan Albatross", "laysan albatross"),
        (2, 3, "Sooty Albatross", "sooty albatross")]
    assert [e.image_id for e in source.split("test")] == ["3", "5"]


def test_cub_other_split_file(tmp_path):
    raw = write_cub(tmp_path)
    _write_lines(tmp_path / "yan_split.txt", [f"{n} {int(n > 2)}" for n in CUB_IMAGES])
    source = ct.read_cub(raw, split_file=tmp_path / "yan_split.txt")
    assert [e.image_id for e in source.split("test")] == ["1", "2"]


def test_nabirds_reader_maps_sparse_class_ids(tmp_path):
    raw = write_nabirds(tmp_path)
    source = ct.read_nabirds(raw)
    ids = nabirds_ids()
    assert source.task == "classify"
    assert [e.image_id for e in source.examples] == ids
    assert [(x.label_id, x.class_id, x.name, x.text) for x in source.labels] == NAB_EXPECTED
    assert source.label_map == {295: 0, 313: 1, 799: 2, 1010: 3}
    names = {c: name for _, c, name, _ in NAB_EXPECTED}
    for e, cls, flag, image_id in zip(source.examples, NAB_LABELS, NAB_SPLIT, ids, strict=True):
        assert (e.class_id, e.label_name, e.split) == (cls, names[cls],
                                                       "train" if flag else "test")
        assert e.label_id == source.label_map[cls]
        assert e.image_path == raw / "images" / nabirds_relative(image_id, cls)


# ---------------------------------------------------------------------------------------------
# Layout errors: every one names the file and the line


def _edit(path: Path, key: str, new_line: str | None) -> int:
    """Replaces (or, with None, removes) the line of ``key``; returns its line number."""
    lines = path.read_text().splitlines()
    number = line_of(path, key)
    lines[number - 1: number] = [] if new_line is None else [new_line]
    _write_lines(path, lines)
    return number


def _append(path: Path, line: str) -> int:
    _write_lines(path, [*path.read_text().splitlines(), line])
    return len(path.read_text().splitlines())


def _remove(path: Path, reported: Path) -> Path:
    """Deletes ``path``; returns the file the error should name."""
    path.unlink()
    return reported


def _remove_line(path: Path, key: str, reported: Path) -> Path:
    _edit(path, key, None)
    return reported


def _cub_moved_folder(raw: Path) -> tuple[Path, int, str]:
    other = f"{CUB_CLASSES[3]}/moved.jpg"
    (raw / "images" / cub_relative(8)).rename(raw / "images" / other)
    return raw / "images.txt", _edit(raw / "images.txt", "8", f"8 {other}"), \
        "not in its class folder, expected '002.Laysan_Albatross/<file>'"


def _cub_short_text(raw: Path) -> tuple[Path, int, str]:
    text = raw / "text_c10" / Path(cub_relative(7)).with_suffix(".txt")
    _write_lines(text, cub_captions(7)[:9])
    return text, 9, "9 captions, expected 10"


def _cub_empty_text(raw: Path) -> tuple[Path, int, str]:
    text = raw / "text_c10" / Path(cub_relative(4)).with_suffix(".txt")
    text.write_text("\n\n")
    return text, 1, "no caption"


def _cub_text_id(raw: Path) -> tuple[Path, int, str]:
    for name in ("images", "image_class_labels", "train_test_split"):
        path = raw / f"{name}.txt"
        _edit(path, "6", path.read_text().splitlines()[line_of(path, "6") - 1]
              .replace("6", "six", 1))
    return raw / "images.txt", 6, "image id 'six', expected an integer"


CUB_DAMAGE = {
    "missing file": lambda raw: (_remove(raw / "classes.txt", raw / "classes.txt"), None,
                                 "missing"),
    "malformed line": lambda raw: (raw / "images.txt", _edit(raw / "images.txt", "3", "3"),
                                   "expected '<image id> <path under images/>'"),
    "id without class": lambda raw: (
        _remove_line(raw / "image_class_labels.txt", "5", raw / "images.txt"), 5,
        r"image id '5' has no line in .*image_class_labels\.txt"),
    "id only in split file": lambda raw: (raw / "train_test_split.txt", _append(
        raw / "train_test_split.txt", "99 1"), "image id '99' is not in .*images.txt"),
    "bad split flag": lambda raw: (raw / "train_test_split.txt", _edit(
        raw / "train_test_split.txt", "3", "3 2"), "split flag '2' of image '3', expected 1"),
    "unknown class": lambda raw: (raw / "image_class_labels.txt", _edit(
        raw / "image_class_labels.txt", "4", "4 7"), r"class id '7' .* not in .*classes\.txt"),
    "non-integer class id": lambda raw: (raw / "classes.txt", _edit(
        raw / "classes.txt", "2", "x2 002.Laysan_Albatross"), "class id 'x2', expected an int"),
    "repeated id": lambda raw: (raw / "images.txt", _append(raw / "images.txt", "2 a/b.jpg"),
                                "id '2' already on line 2"),
    "missing image": lambda raw: (_remove(raw / "images" / cub_relative(6), raw / "images.txt"),
                                  6, "image file .* does not exist"),
    "missing captions": lambda raw: (
        _remove(raw / "text_c10" / Path(cub_relative(2)).with_suffix(".txt"),
                raw / "images.txt"), 2, r"captions file .*_0002_702\.txt does not exist"),
    "image in another class folder": _cub_moved_folder,
    "nine captions": _cub_short_text,
    "empty captions file": _cub_empty_text,
    "non-integer image id": _cub_text_id,
}


@pytest.mark.parametrize("case", CUB_DAMAGE)
def test_cub_layout_errors_name_file_and_line(tmp_path, case):
    raw = write_cub(tmp_path)
    path, line, message = CUB_DAMAGE[case](raw)
    where = re.escape(f"{path}:{line}:" if line else f"{path}:")
    with pytest.raises(ct.LayoutError, match=f"^{where} .*{message}"):
        ct.read_cub(raw)


def _nab_bad_id(raw: Path) -> tuple[Path, int, str]:
    first = nabirds_ids()[0]
    for name in ("images", "image_class_labels", "train_test_split"):
        path = raw / f"{name}.txt"
        path.write_text(path.read_text().replace(first, "x1"))
    return raw / "images.txt", 1, "image id 'x1', expected 32 hex digits"


NAB_DAMAGE = {
    "bad image id": _nab_bad_id,
    "unknown class": lambda raw: (raw / "image_class_labels.txt", _edit(
        raw / "image_class_labels.txt", nabirds_ids()[2], f"{nabirds_ids()[2]} 999"),
        "class id '999'"),
    "malformed classes line": lambda raw: (raw / "classes.txt", _append(
        raw / "classes.txt", "42"), "expected '<class id> <class name>', got '42'"),
    "missing image": lambda raw: (_remove(raw / "images" / nabirds_relative(
        nabirds_ids()[4], NAB_LABELS[4]), raw / "images.txt"), 5, "does not exist"),
    "id only in labels": lambda raw: (raw / "image_class_labels.txt", _append(
        raw / "image_class_labels.txt", f"{uuid.UUID(int=7)} 295"), "is not in"),
}


@pytest.mark.parametrize("case", NAB_DAMAGE)
def test_nabirds_layout_errors_name_file_and_line(tmp_path, case):
    raw = write_nabirds(tmp_path)
    path, line, message = NAB_DAMAGE[case](raw)
    with pytest.raises(ct.LayoutError, match=f"^{re.escape(f'{path}:{line}:')} .*{message}"):
        ct.read_nabirds(raw)


# ---------------------------------------------------------------------------------------------
# Builder


def test_cub_build_round_trip(tmp_path):
    source = ct.read_cub(write_cub(tmp_path))
    train_captions = [c for n, (_, flag) in CUB_IMAGES.items() if flag for c in cub_captions(n)]
    vocab = Vocabulary.build(train_captions)
    out = ct.build_source(source, fake_features, tmp_path / "cub_out", vocab=vocab,
                          batch_size=3, progress=False)
    meta = json.loads((out / "meta.json").read_text())
    test_ids = [n for n, (_, flag) in CUB_IMAGES.items() if not flag]
    longest = max(len(vocab.tokenize(c)) for n in CUB_IMAGES for c in cub_captions(n))
    assert meta["splits"] == {"train": 6, "test": 2}
    assert (meta["task"], meta["feature_shape"], meta["text_length"]) == ("caption", [2, 2, 3],
                                                                          longest)
    assert meta["unknown_words"] == 10 * len(test_ids)  # "imageN" in every test caption
    for split in ("train", "test"):
        ids = [n for n, (_, flag) in CUB_IMAGES.items() if flag == (split == "train")]
        arrays = _written_split(out, split)
        assert list(arrays["image_ids"]) == [str(n) for n in ids]
        assert list(arrays["task"]) == ["caption"] * len(ids)
        assert list(arrays["labels"]) == [CUB_IMAGES[n][0] - 1 for n in ids]
        expected = fake_features([out.parent / "CUB_200_2011" / "images" / cub_relative(n)
                                  for n in ids])
        assert arrays["features"].dtype == np.float16
        np.testing.assert_allclose(arrays["features"], expected, rtol=2e-3)
        assert arrays["caption_ids"].shape == (len(ids), 10, longest)
        assert list(arrays["num_captions"]) == [10] * len(ids)
        for row, n in zip(arrays["caption_ids"], ids, strict=True):
            for got, caption in zip(row, cub_captions(n), strict=True):
                np.testing.assert_array_equal(got, vocab.encode(caption, longest,
                                                                allow_unk=True))
    assert _written_split(out, "test")["caption_ids"][0, 0, 1] == UNK_ID


def test_cub_build_caps_caption_length(tmp_path):
    source = ct.read_cub(write_cub(tmp_path))
    vocab = Vocabulary.build(c for n in CUB_IMAGES for c in cub_captions(n))
    out = ct.build_source(source, fake_features, tmp_path / "capped", vocab=vocab, max_len=6,
                          progress=False)
    ids = _written_split(out, "train")["caption_ids"]
    assert ids.shape[-1] == 6 == json.loads((out / "meta.json").read_text())["text_length"]
    np.testing.assert_array_equal(ids[0, 0], vocab.encode(cub_captions(1)[0], 6,
                                                          truncate=True))
    assert vocab.decode(ids[0, 0]) == "image1 bird has a"


def test_nabirds_build_round_trip_with_label_text(tmp_path):
    source = ct.read_nabirds(write_nabirds(tmp_path))
    vocab = Vocabulary.build(["black-footed albatross", "laysan albatross", "hawk"])
    out = ct.build_source(source, fake_features, tmp_path / "nab_out", vocab=vocab,
                          batch_size=4, feature_dtype="float32", progress=False)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["splits"] == {"train": 6, "test": 2} and meta["task"] == "classify"
    assert [tuple(x.values()) for x in meta["labels"]] == NAB_EXPECTED
    texts = {c: text for _, c, _, text in NAB_EXPECTED}
    ids, paths = nabirds_ids(), [e.image_path for e in source.examples]
    for split, flag in (("train", 1), ("test", 0)):
        rows = [n for n, f in enumerate(NAB_SPLIT) if f == flag]
        arrays = _written_split(out, split, mmap=False)
        assert list(arrays["image_ids"]) == [ids[n] for n in rows]
        assert list(arrays["task"]) == ["classify"] * len(rows)
        assert list(arrays["labels"]) == [source.label_map[NAB_LABELS[n]] for n in rows]
        np.testing.assert_array_equal(arrays["features"], fake_features([paths[n] for n in rows]))
        length = arrays["label_text_ids"].shape[1]
        for got, n in zip(arrays["label_text_ids"], rows, strict=True):
            np.testing.assert_array_equal(got, vocab.encode(texts[NAB_LABELS[n]], length,
                                                            allow_unk=True))
    assert meta["text_length"] == length == 6  # <START> red-tailed hawk dark morph <END>


def test_build_is_atomic_and_checks_its_inputs(tmp_path):
    source = ct.read_nabirds(write_nabirds(tmp_path))
    calls = []

    def failing(paths):
        calls.append(len(paths))
        if len(calls) == 2:
            raise RuntimeError("extractor died")
        return fake_features(paths)

    with pytest.raises(RuntimeError, match="extractor died"):
        ct.build_source(source, failing, tmp_path / "out", batch_size=4, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nabirds"]  # no partial output
    with pytest.raises(ValueError, match=r"shape \(2, 2, 2, 3\) for 3 images"):
        ct.build_source(source, lambda p: fake_features(p)[:2], tmp_path / "out", batch_size=3,
                        progress=False)
    out = ct.build_source(source, fake_features, tmp_path / "out", progress=False)
    assert "label_text_ids" not in _written_split(out, "train")  # no vocabulary given
    with pytest.raises(FileExistsError, match="not an empty directory"):
        ct.build_source(source, fake_features, out, progress=False)
    with pytest.raises(ValueError, match="needs a vocabulary"):
        ct.build_source(ct.read_cub(write_cub(tmp_path)), fake_features, tmp_path / "c",
                        progress=False)


def test_resnet_feature_fn_loads_the_weights_once(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    from changecap_jax.features import extract, resnet

    class Tiny(torch.nn.Module):
        layer = 4

        def forward(self, x):
            return torch.nn.functional.adaptive_avg_pool2d(x, (2, 3)) * 2

    loads = []
    monkeypatch.setattr(resnet, "load_resnet101",
                        lambda w, layer, device=None: loads.append((w, layer)) or Tiny())
    source = ct.read_nabirds(write_nabirds(tmp_path))
    fn = ct.resnet_feature_fn(tmp_path / "r101.pth")
    out = ct.build_source(source, fn, tmp_path / "out", batch_size=3, feature_dtype="float32",
                          progress=False)
    assert loads == [(tmp_path / "r101.pth", 4)]
    train = [e.image_path for e in source.split("train")]
    direct = np.stack([f for _, f in extract.extract_features(train, Tiny(), 4)])  # (N, C, H, W)
    got = _written_split(out, "train")["features"]
    assert got.shape == (6, 2, 3, 3)
    np.testing.assert_allclose(got, direct.transpose(0, 2, 3, 1), rtol=1e-6)


def test_cli_with_precomputed_features(tmp_path):
    raw = write_nabirds(tmp_path)
    source = ct.read_nabirds(raw)
    features = tmp_path / "features"
    for n, e in enumerate(source.examples):  # the nested and the flat official naming
        rel = e.image_path.relative_to(raw / "images")
        path = features / (f"{rel}.npy" if n % 2 else f"{rel.name}.npy")
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, fake_features([e.image_path])[0].transpose(2, 0, 1))
    Vocabulary.build(["laysan albatross"]).save(tmp_path / "vocab.json")
    command = [sys.executable, "-m", "data_prep.cross_task", "--source=nabirds",
               f"--raw_dir={raw}", f"--features_dir={features}",
               f"--vocab={tmp_path / 'vocab.json'}"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([*command, f"--out={tmp_path / 'out'}"], capture_output=True,
                          text=True, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert "8 images (6 train, 2 test), 4 classes" in done.stdout
    test = _written_split(tmp_path / "out", "test")
    np.testing.assert_allclose(test["features"],
                               fake_features([e.image_path for e in source.split("test")]),
                               rtol=2e-3)
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["tokenizer"] == "clevr"

    source.examples[4].image_path.unlink()
    failed = subprocess.run([*command, f"--out={tmp_path / 'out2'}"], capture_output=True,
                            text=True, env=env, cwd=REPO)
    assert failed.returncode != 0
    assert f"error: {raw / 'images.txt'}:5: image file" in failed.stderr
    assert not (tmp_path / "out2").exists()


# ---------------------------------------------------------------------------------------------
# Pairs and batch mixing


def test_classification_pairs_half_same_class():
    labels = [0, 0, 1, 1, 2, 2, 2]
    pairs = extra_source.classification_pairs(labels, 40, seed=1)
    same = [labels[i] == labels[j] for i, j, _ in pairs]
    assert same == [True] * 20 + [False] * 20
    assert all(i != j for i, j, _ in pairs)
    np.testing.assert_array_equal(pairs[:, 2], same)
    np.testing.assert_array_equal(pairs, extra_source.classification_pairs(labels, 40, seed=1))
