"""Cross-task pretraining sources of IDC-PCL (paper §2.4 and appendix A.3).

IDC-PCL pretrains on more than difference captions: single-image captions of CUB-200-2011
("general image captioning", GIC) and fine-grained class labels of NABirds ("fine-grained
visual classification", FGVC). A.3: each CUB image becomes a pseudo pair (the image, an empty
second image) with its captions; NABirds images are paired at random, half of the pairs from
the same class and half not, for a classification, a contrastive and a same-class matching
loss; NABirds is mixed into Birds-to-Words batches at a 1:4 ratio.

    python -m data_prep.cross_task --source=cub --raw_dir=CUB_200_2011 [--text_dir=text_c10] \\
        --vocab=vocab.json --out=DIR --weights=resnet101.pth [--layer=4]
    python -m data_prep.cross_task --source=nabirds --raw_dir=nabirds --out=DIR \\
        --weights=resnet101.pth [--layer=4] [--vocab=vocab.json]

Official layouts read (every file is checked: a missing file, a malformed line, an id found in
one file but not another, or a missing image raises :class:`LayoutError` naming the file and
line):

* CUB-200-2011: ``images.txt`` ("<id> <class dir>/<file>.jpg"), ``image_class_labels.txt``
  ("<id> <class id>"), ``classes.txt`` ("<class id> <class dir>"), ``train_test_split.txt``
  ("<id> <1 train | 0 test>"), ``images/``; captions from the 10-per-image text of Reed et al.
  (``text_c10/<class dir>/<file stem>.txt``, one caption per line; default
  ``<raw_dir>/text_c10``). The paper trains on 8,855 / 2,933 images after Yan et al.; that
  split is not in the official files, so ``train_test_split.txt`` is used unless
  ``--split_file`` names another file of the same form.
* NABirds: the same file names with 32-hex-digit image ids (dashes allowed), class ids that are
  not contiguous (a 0-based label index is assigned in sorted id order, and the mapping is
  saved), ``classes.txt`` names with spaces.

Output (``--out``, written atomically): ``meta.json`` (source, layout counts, label names,
feature shape, vocabulary size) and per split ``<split>.npz`` with ``features`` (N, H, W, C)
float16 grids from the project's ResNet-101 extractor (a local weights path; tests pass their
own feature function), ``image_ids``, and ``caption_ids`` (N, 10, L) int32 zero-padded
(CUB) or ``labels`` (N,) int32 (NABirds).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

FeatureFn = Callable[[Sequence[Path]], np.ndarray]  # image paths -> (N, H, W, C) grids
SPLITS = {1: "train", 0: "test"}


class LayoutError(ValueError):
    """A raw dataset that does not follow its official layout."""


@dataclasses.dataclass(frozen=True)
class CaptionExample:
    image_id: str
    image_path: Path
    captions: tuple[str, ...]
    split: str
    label: int


@dataclasses.dataclass(frozen=True)
class ClassificationExample:
    image_id: str
    image_path: Path
    label: int  # 0-based index in sorted class-id order
    class_id: str  # the dataset's own class id
    label_name: str
    split: str


# ---------------------------------------------------------------------------------------------
# Reading the official files
# ---------------------------------------------------------------------------------------------


def _read_table(path: Path, fields: int, *, rest: bool = False) -> dict[str, list[str]]:
    """``<key> <value> ...`` lines -> key -> values; ``rest`` keeps the remainder of the line
    as the last value (names with spaces). Errors name the file and the line."""
    if not path.is_file():
        raise LayoutError(f"{path} is missing")
    table: dict[str, list[str]] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split(maxsplit=fields - 1) if rest else line.split()
        if len(parts) != fields:
            raise LayoutError(f"{path}:{number}: expected {fields} fields, got {line!r}")
        if parts[0] in table:
            raise LayoutError(f"{path}:{number}: id {parts[0]!r} appears twice")
        table[parts[0]] = parts[1:]
    if not table:
        raise LayoutError(f"{path} is empty")
    return table


def _same_ids(tables: Mapping[Path, Mapping[str, Any]]) -> None:
    (first_path, first), *others = tables.items()
    for path, table in others:
        extra = sorted(set(table) - set(first))
        missing = sorted(set(first) - set(table))
        if extra or missing:
            raise LayoutError(f"{path} and {first_path} list different image ids: "
                              f"{len(missing)} only in {first_path.name} (e.g. {missing[:3]}), "
                              f"{len(extra)} only in {path.name} (e.g. {extra[:3]})")


def _split_of(path: Path, table: Mapping[str, list[str]]) -> dict[str, str]:
    out = {}
    for image_id, (flag,) in table.items():
        if flag not in ("0", "1"):
            raise LayoutError(f"{path}: image {image_id!r} has split flag {flag!r}, "
                              "expected 1 (train) or 0 (test)")
        out[image_id] = SPLITS[int(flag)]
    return out


def _image(raw_dir: Path, images_file: Path, relative: str) -> Path:
    path = raw_dir / "images" / relative
    if not path.is_file():
        raise LayoutError(f"{images_file}: image {relative!r} is missing ({path})")
    return path


def read_cub(raw_dir: str | Path, text_dir: str | Path | None = None,
             split_file: str | Path | None = None) -> list[CaptionExample]:
    """CUB-200-2011 images with their text_c10 captions, in images.txt order."""
    raw_dir = Path(raw_dir)
    text_dir = Path(text_dir) if text_dir else raw_dir / "text_c10"
    paths = {name: raw_dir / f"{name}.txt" for name in
             ("images", "image_class_labels", "classes", "train_test_split")}
    if split_file:
        paths["train_test_split"] = Path(split_file)
    images = _read_table(paths["images"], 2)
    labels = _read_table(paths["image_class_labels"], 2)
    classes = _read_table(paths["classes"], 2)
    splits = _read_table(paths["train_test_split"], 2)
    _same_ids({paths["images"]: images, paths["image_class_labels"]: labels,
               paths["train_test_split"]: splits})
    split_of = _split_of(paths["train_test_split"], splits)
    out = []
    for image_id, (relative,) in images.items():
        (class_id,) = labels[image_id]
        if class_id not in classes:
            raise LayoutError(f"{paths['image_class_labels']}: image {image_id!r} has class "
                              f"{class_id!r}, which {paths['classes']} does not list")
        image_path = _image(raw_dir, paths["images"], relative)
        text_path = text_dir / Path(relative).with_suffix(".txt")
        if not text_path.is_file():
            raise LayoutError(f"{text_path} is missing: captions of image {image_id!r} "
                              f"({relative}) in the text_c10 layout")
        captions = tuple(c.strip() for c in text_path.read_text().splitlines() if c.strip())
        if not captions:
            raise LayoutError(f"{text_path} holds no caption")
        out.append(CaptionExample(image_id, image_path, captions, split_of[image_id],
                                  int(class_id)))
    return out


_NABIRDS_ID = re.compile(r"^[0-9a-f]{32}$")


def read_nabirds(raw_dir: str | Path) -> list[ClassificationExample]:
    """NABirds images with their class, in images.txt order."""
    raw_dir = Path(raw_dir)
    paths = {name: raw_dir / f"{name}.txt" for name in
             ("images", "image_class_labels", "classes", "train_test_split")}
    images = _read_table(paths["images"], 2)
    labels = _read_table(paths["image_class_labels"], 2)
    classes = _read_table(paths["classes"], 2, rest=True)
    splits = _read_table(paths["train_test_split"], 2)
    for number, image_id in enumerate(images, 1):
        if not _NABIRDS_ID.match(image_id.replace("-", "")):
            raise LayoutError(f"{paths['images']}: entry {number} has id {image_id!r}, expected "
                              "a 32-hex-digit image id")
    _same_ids({paths["images"]: images, paths["image_class_labels"]: labels,
               paths["train_test_split"]: splits})
    split_of = _split_of(paths["train_test_split"], splits)
    used = sorted({labels[i][0] for i in images}, key=int)
    unknown = [c for c in used if c not in classes]
    if unknown:
        raise LayoutError(f"{paths['image_class_labels']} uses classes {unknown[:5]} that "
                          f"{paths['classes']} does not list")
    index = {c: n for n, c in enumerate(used)}
    return [ClassificationExample(image_id, _image(raw_dir, paths["images"], relative),
                                  index[labels[image_id][0]], labels[image_id][0],
                                  classes[labels[image_id][0]][0], split_of[image_id])
            for image_id, (relative,) in images.items()]


# ---------------------------------------------------------------------------------------------
# Pairs and batch mixing
# ---------------------------------------------------------------------------------------------


def classification_pairs(labels: Sequence[int], num_pairs: int,
                         seed: int = 0) -> np.ndarray:
    """(num_pairs, 3) rows (i, j, same) of random image pairs, the first half from the same
    class and the rest from different classes (A.3), seeded. Classes with one image cannot
    give a same-class pair of two different images."""
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    by_class = {c: np.flatnonzero(labels == c) for c in np.unique(labels)}
    pairable = [c for c, idx in by_class.items() if len(idx) > 1]
    if not pairable or len(by_class) < 2:
        raise ValueError("pairs need a class with two images and at least two classes")
    rows = []
    for n in range(num_pairs):
        if n < num_pairs // 2:
            c = pairable[rng.integers(len(pairable))]
            i, j = rng.choice(by_class[c], size=2, replace=False)
        else:
            i = rng.integers(len(labels))
            others = np.flatnonzero(labels != labels[i])
            j = others[rng.integers(len(others))]
        rows.append((i, j, int(labels[i] == labels[j])))
    return np.asarray(rows, np.int64)


def mixed_batch_rows(batch_size: int, ratio: tuple[int, int] = (4, 1)) -> tuple[int, int]:
    """Rows of (difference pairs, extra source) in one pretraining batch at ``ratio``
    (pairs : extra; the paper's NABirds : Birds-to-Words 1:4 is ``(4, 1)``). The batch must
    split exactly, so every batch has the same composition."""
    pairs, extra = ratio
    if pairs < 0 or extra < 0 or pairs + extra == 0:
        raise ValueError(f"ratio must be two non-negative counts, not both 0; got {ratio}")
    unit = pairs + extra
    if batch_size % unit:
        raise ValueError(f"batch size {batch_size} does not split {pairs}:{extra}; use a "
                         f"multiple of {unit}")
    return batch_size // unit * pairs, batch_size // unit * extra


def mixed_batches(pair_rows: Iterator[Any], extra_rows: Iterator[Any], batch_size: int,
                  ratio: tuple[int, int] = (4, 1), seed: int = 0) -> Iterator[list[Any]]:
    """Endless batches of ``batch_size`` rows, ``mixed_batch_rows`` of each source, their
    order inside the batch shuffled with a seeded generator (deterministic)."""
    n_pairs, n_extra = mixed_batch_rows(batch_size, ratio)
    rng = np.random.default_rng(seed)
    while True:
        batch = ([("pairs", next(pair_rows)) for _ in range(n_pairs)]
                 + [("extra", next(extra_rows)) for _ in range(n_extra)])
        yield [batch[k] for k in rng.permutation(len(batch))]


# ---------------------------------------------------------------------------------------------
# Building feature files
# ---------------------------------------------------------------------------------------------


def resnet_feature_fn(weights: str | Path, layer: int = 4, batch_size: int = 64) -> FeatureFn:
    """The project's ResNet-101 extractor (``data_prep.extract_features``) as a FeatureFn."""
    from data_prep import extract_features

    def extract(paths: Sequence[Path]) -> np.ndarray:
        feats = [f for _, f in extract_features.extract_features(
            list(paths), weights, layer=layer, batch_size=batch_size)]
        return np.stack(feats).transpose(0, 2, 3, 1)  # (N, C, H, W) -> channels-last

    return extract


def build_source(examples: Sequence[CaptionExample | ClassificationExample],
                 feature_fn: FeatureFn, out: str | Path, *, source: str,
                 vocab: Any | None = None, batch_size: int = 64) -> Path:
    """Writes ``out`` (see the module docstring) atomically; returns it."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    captioned = isinstance(examples[0], CaptionExample)
    if captioned and vocab is None:
        raise ValueError("a captioning source needs a vocabulary (--vocab)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        counts, shape = {}, None
        for split in sorted({e.split for e in examples}):
            chosen = [e for e in examples if e.split == split]
            feats = []
            for start in tqdm(range(0, len(chosen), batch_size), desc=f"{source} {split}",
                              dynamic_ncols=True):
                batch = feature_fn([e.image_path for e in chosen[start:start + batch_size]])
                feats.append(np.asarray(batch, np.float16))
            features = np.concatenate(feats)
            shape = list(features.shape[1:])
            arrays: dict[str, np.ndarray] = {
                "features": features, "image_ids": np.array([e.image_id for e in chosen])}
            if captioned:
                max_len = max(len(vocab.tokenize(c)) for e in chosen for c in e.captions)
                n_cap = max(len(e.captions) for e in chosen)
                ids = np.zeros((len(chosen), n_cap, max_len), np.int32)
                for n, e in enumerate(chosen):
                    ids[n, : len(e.captions)] = vocab.encode_many(list(e.captions), max_len,
                                                                  allow_unk=True)
                arrays["caption_ids"] = ids
            else:
                arrays["labels"] = np.array([e.label for e in chosen], np.int32)
            np.savez(tmp / f"{split}.npz", **arrays)
            counts[split] = len(chosen)
        meta = {"source": source, "task": "caption" if captioned else "classify",
                "splits": counts, "feature_shape": shape,
                "vocab_size": len(vocab) if vocab is not None else None}
        if not captioned:
            names = {e.label: (e.class_id, e.label_name) for e in examples}
            meta["labels"] = [{"index": i, "class_id": names[i][0], "name": names[i][1]}
                              for i in sorted(names)]
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _define_flags() -> None:
    from absl import flags

    flags.DEFINE_enum("source", None, ["cub", "nabirds"], "Which cross-task source.",
                      required=True)
    flags.DEFINE_string("raw_dir", None, "The dataset in its official layout.", required=True)
    flags.DEFINE_string("text_dir", None, "CUB: the text_c10 directory (default "
                        "<raw_dir>/text_c10).")
    flags.DEFINE_string("split_file", None, "CUB: another train_test_split.txt.")
    flags.DEFINE_string("vocab", None, "vocab.json of the difference-captioning dataset.")
    flags.DEFINE_string("out", None, "Output directory (must not exist).", required=True)
    flags.DEFINE_string("weights", None, "Local ResNet-101 weights (torchvision format).",
                        required=True)
    flags.DEFINE_integer("layer", 4, "ResNet stage whose output is kept (IDC-PCL: 4).")
    flags.DEFINE_integer("batch_size", 64, "Images per extraction batch.")


def main(argv: Sequence[str]) -> None:
    import sys

    from absl import app, flags

    from changecap_jax.data.vocab import Vocabulary

    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    FLAGS = flags.FLAGS
    try:
        if FLAGS.source == "cub":
            examples: list[Any] = read_cub(FLAGS.raw_dir, FLAGS.text_dir, FLAGS.split_file)
        else:
            examples = read_nabirds(FLAGS.raw_dir)
        vocab = Vocabulary.load(FLAGS.vocab) if FLAGS.vocab else None
        out = build_source(examples, resnet_feature_fn(FLAGS.weights, FLAGS.layer,
                                                       FLAGS.batch_size),
                           FLAGS.out, source=FLAGS.source, vocab=vocab,
                           batch_size=FLAGS.batch_size)
    except (LayoutError, FileExistsError, ValueError) as e:
        sys.exit(f"error: {e}")
    print(f"{FLAGS.source}: {len(examples)} images -> {out} "
          f"({math.ceil(len(examples) / FLAGS.batch_size)} batches)")


if __name__ == "__main__":
    from absl import app

    _define_flags()
    app.run(main)
