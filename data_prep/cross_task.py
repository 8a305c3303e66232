"""Cross-task pretraining sources of IDC-PCL (paper §2.4 and appendix A.3).

IDC-PCL pretrains on more than difference captions: the single-image captions of
CUB-200-2011 ("general image captioning", GIC) and the fine-grained class labels of NABirds
("fine-grained visual classification", FGVC). A.3: each CUB image becomes a pseudo pair (the
image and an empty second image) with its captions, used by MLM, MVCL (only the real image is
masked) and FDA (Retrieve and Replace negatives only); NABirds images are paired at random,
half of the pairs from the same class, for a classification, a
contrastive and a same-class matching loss. CUB is used in a first pretraining stage, NABirds
together with Birds-to-Words in the second, at a batch ratio NABirds : Birds-to-Words = 1:4
(the pretraining task mixes the batches, ``config.pretrain.extra_source.ratio``). Pretraining
reads a built source through ``config.pretrain.extra_source.dir``: the one reader of this
format is ``changecap_jax/data/extra_source.py`` (``open_source``, and ``classification_pairs``
for the NABirds pairs).

    python -m data_prep.cross_task --source=cub --raw_dir=CUB_200_2011 --vocab=vocab.json \\
        --out=DIR (--weights=resnet101.pth | --features_dir=DIR) [--text_dir=text_c10] \\
        [--negatives [--negatives_seed=0] [--pos=lexicon]]
    python -m data_prep.cross_task --source=nabirds --raw_dir=nabirds --out=DIR \\
        (--weights=resnet101.pth | --features_dir=DIR) [--vocab=vocab.json]

Layouts read (:func:`read_cub`, :func:`read_nabirds`). A missing file, a malformed line, an
id in one file but not another, an unknown class or a missing image raises
:class:`LayoutError` with ``<file>:<line>:`` and what was expected.

* Both: ``images.txt`` ("<image id> <path under images/>"), ``image_class_labels.txt``
  ("<image id> <class id>"), ``classes.txt`` ("<class id> <name>"), ``train_test_split.txt``
  ("<image id> <1 train | 0 test>"; the split is named "train" / "test"), ``images/``. Lines
  are joined by id, never by position. Labels: the classes that images use, numbered 0.. in
  numeric class-id order (:class:`Label` keeps the dataset's id, the cleaned name and the
  name as text for the vocabulary).
* CUB-200-2011: integer ids, ``images/<class folder>/<file>.jpg`` where the folder is the
  image's class name in ``classes.txt`` ("001.Black_footed_Albatross", cleaned to "Black
  footed Albatross"). Captions: Reed et al.'s cvpr2016_cub ``text_c10/<class folder>/<image
  stem>.txt``, one caption per line, 10 per image (``captions_per_image``). The paper trains
  on 8,855 / 2,933 images after Yan et al.; that split is not an official file, so
  ``train_test_split.txt`` is used unless ``split_file`` names another file of its form.
* NABirds: 32-hex-digit image ids (dashes allowed), names with spaces, sparse class ids
  (``classes.txt`` also lists the hierarchy's inner nodes, which no image uses).
  ``hierarchy.txt`` and ``bounding_boxes.txt`` are not needed by A.3 and not read.

Output of :func:`build_source` (renamed into ``out`` only when complete): ``meta.json``
(source, task, split sizes, feature shape and dtype, vocabulary size and tokenizer, caption
length, the label table) and per split ``<split>.features.npy`` (N, H, W, C) channels-last
grids, one image per example (no before/after pair; streamed, memory-mappable) and
``<split>.npz`` with ``image_ids``, ``task`` (N,) ("caption" / "classify"), ``labels`` (N,),
and for CUB ``caption_ids`` (N, K, L) + ``num_captions`` (N,), for NABirds with a vocabulary
``label_text_ids`` (N, L). Token ids are the vocabulary's ``encode`` (``<START>`` ..
``<END>``, zero-padded; unknown words ``<UNK>``, counted).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ClassVar, Generic, TypeVar

import numpy as np
from absl import app, flags

from changecap_jax import cli, console
from changecap_jax.data.negatives import negatives_path
from changecap_jax.data.vocab import CaptionError, Vocabulary, log_unknown_words
from changecap_jax.errors import UserError
from changecap_jax.io.jsonio import staging_dir
from data_prep.methods import negative_mining as hn
from data_prep.methods.negative_mining import HardNegativeError, write_negatives

FeatureFn = Callable[[Sequence[Path]], np.ndarray]  # image paths -> (N, H, W, C) grids
SPLIT_FLAGS = {"1": "train", "0": "test"}
TASKS = {"cub": "caption", "nabirds": "classify"}


class LayoutError(UserError, ValueError):
    """A raw dataset that does not follow its official layout; names the file and line."""


@dataclasses.dataclass(frozen=True)
class CaptionExample:
    """One CUB image with its captions (single-image captioning)."""

    image_path: Path
    captions: list[str]
    split: str
    image_id: str = ""
    label_id: int = -1  # 0-based class index (see Source.labels)
    task: ClassVar[str] = "caption"


@dataclasses.dataclass(frozen=True)
class ClassificationExample:
    """One NABirds image with its class (fine-grained classification)."""

    image_path: Path
    label_id: int  # 0-based, contiguous (see Source.labels)
    label_name: str
    split: str
    image_id: str = ""
    class_id: int = -1  # the dataset's own, sparse class id
    task: ClassVar[str] = "classify"


@dataclasses.dataclass(frozen=True)
class Label:
    label_id: int  # 0-based, in numeric class-id order
    class_id: int  # as in classes.txt
    name: str  # cleaned: "Black footed Albatross"
    text: str  # for the vocabulary: "black footed albatross"


E = TypeVar("E", CaptionExample, ClassificationExample)


@dataclasses.dataclass(frozen=True)
class Source(Generic[E]):
    """A read source: its examples in ``images.txt`` order and its label table."""

    name: str
    examples: list[E]
    labels: list[Label]  # labels[i].label_id == i

    @property
    def task(self) -> str:
        return TASKS[self.name]

    @property
    def label_map(self) -> dict[int, int]:
        """The dataset's class id -> 0-based label id."""
        return {label.class_id: label.label_id for label in self.labels}

    def split(self, name: str) -> list[E]:
        return [e for e in self.examples if e.split == name]


# ---------------------------------------------------------------------------------------------
# Reading the official files
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Table:
    """A ``<key> <value> ...`` file: key -> (line number, values)."""

    path: Path
    rows: dict[str, tuple[int, tuple[str, ...]]]

    def where(self, key: str) -> str:
        return f"{self.path}:{self.rows[key][0]}"

    def value(self, key: str) -> str:
        return self.rows[key][1][0]


def _read_lines(path: Path, expected: str) -> list[str]:
    if not path.is_file():
        raise LayoutError(f"{path}: missing (expected {expected})")
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise LayoutError(f"{path}: not UTF-8 text ({e})") from e


def _read_table(path: Path, expected: str, *, free_text: bool = False) -> _Table:
    """Two-field lines ``expected`` (blank lines skipped), keyed by the first field;
    ``free_text``: the second field is the rest of the line (names with spaces)."""
    rows: dict[str, tuple[int, tuple[str, ...]]] = {}
    for number, line in enumerate(_read_lines(path, f"lines '{expected}'"), 1):
        if not line.strip():
            continue
        parts = line.split(maxsplit=1) if free_text else line.split()
        if len(parts) != 2:
            raise LayoutError(f"{path}:{number}: expected '{expected}', got {line!r}")
        key = parts[0]
        if key in rows:
            raise LayoutError(f"{path}:{number}: id {key!r} already on line {rows[key][0]}")
        rows[key] = (number, (parts[1].strip(),))
    if not rows:
        raise LayoutError(f"{path}:1: empty file (expected lines '{expected}')")
    return _Table(path, rows)


def _check_same_ids(images: _Table, other: _Table) -> None:
    for key in other.rows:
        if key not in images.rows:
            raise LayoutError(f"{other.where(key)}: image id {key!r} is not in {images.path}")
    for key in images.rows:
        if key not in other.rows:
            raise LayoutError(f"{images.where(key)}: image id {key!r} has no line in "
                              f"{other.path}")


def _integer(table: _Table, key: str, value: str, what: str) -> int:
    if not value.isdigit():
        raise LayoutError(f"{table.where(key)}: {what} {value!r}, expected an integer")
    return int(value)


_CLASS_PREFIX = re.compile(r"^\d+\.")


def clean_class_name(raw: str) -> str:
    """A ``classes.txt`` name for people: CUB's "001.Black_footed_Albatross" -> "Black footed
    Albatross"; NABirds' "Sooty Albatross  (Adult)" -> "Sooty Albatross (Adult)"."""
    return " ".join(_CLASS_PREFIX.sub("", raw.strip()).replace("_", " ").split())


def label_text(name: str) -> str:
    """A class name as text for the vocabulary: lowercased, punctuation other than "-" and "'"
    turned into spaces ("Sooty Albatross (Adult)" -> "sooty albatross adult")."""
    return " ".join(re.sub(r"[^\w\s'-]|_", " ", name.lower()).split())


@dataclasses.dataclass(frozen=True)
class _Layout:
    """The four files both datasets share, joined by id and checked."""

    raw_dir: Path
    images: _Table
    labels: _Table  # image id -> class id
    classes: _Table  # class id -> name
    splits: _Table
    label_of_class: dict[str, Label]  # classes used by images only

    def image_path(self, key: str) -> Path:
        path = self.raw_dir / "images" / self.images.value(key)
        if not path.is_file():
            raise LayoutError(f"{self.images.where(key)}: image file {path} does not exist")
        return path

    def split(self, key: str) -> str:
        flag = self.splits.value(key)
        if flag not in SPLIT_FLAGS:
            raise LayoutError(f"{self.splits.where(key)}: split flag {flag!r} of image {key!r}, "
                              "expected 1 (train) or 0 (test)")
        return SPLIT_FLAGS[flag]

    def label(self, key: str) -> Label:
        return self.label_of_class[self.labels.value(key)]


def _read_layout(raw_dir: Path, split_file: Path | None, names_with_spaces: bool) -> _Layout:
    images = _read_table(raw_dir / "images.txt", "<image id> <path under images/>")
    labels = _read_table(raw_dir / "image_class_labels.txt", "<image id> <class id>")
    classes = _read_table(raw_dir / "classes.txt", "<class id> <class name>",
                          free_text=names_with_spaces)
    splits = _read_table(split_file or raw_dir / "train_test_split.txt",
                         "<image id> <1 train | 0 test>")
    _check_same_ids(images, labels)
    _check_same_ids(images, splits)
    for class_id in classes.rows:
        _integer(classes, class_id, class_id, "class id")
    for key in labels.rows:
        class_id = labels.value(key)
        _integer(labels, key, class_id, "class id")
        if class_id not in classes.rows:
            raise LayoutError(f"{labels.where(key)}: class id {class_id!r} of image {key!r} is "
                              f"not in {classes.path}")
    used = sorted({labels.value(key) for key in labels.rows}, key=int)
    label_of_class = {}
    for n, class_id in enumerate(used):
        name = clean_class_name(classes.value(class_id))
        if not label_text(name):
            raise LayoutError(f"{classes.where(class_id)}: class {class_id} has no usable name")
        label_of_class[class_id] = Label(n, int(class_id), name, label_text(name))
    return _Layout(raw_dir, images, labels, classes, splits, label_of_class)


def _labels(layout: _Layout) -> list[Label]:
    return sorted(layout.label_of_class.values(), key=lambda label: label.label_id)


def _read_captions(text_path: Path, images: _Table, key: str,
                   captions_per_image: int | None) -> list[str]:
    if not text_path.is_file():
        raise LayoutError(f"{images.where(key)}: captions file {text_path} does not exist "
                          "(text_c10 layout: text_c10/<class folder>/<image stem>.txt)")
    lines = _read_lines(text_path, "one caption per line")
    captions = [line.strip() for line in lines if line.strip()]
    if not captions:
        raise LayoutError(f"{text_path}:1: no caption (expected one caption per line)")
    if captions_per_image and len(captions) != captions_per_image:
        raise LayoutError(f"{text_path}:{len(lines)}: {len(captions)} captions, expected "
                          f"{captions_per_image} (one per line)")
    return captions


def read_cub(raw_dir: str | Path, text_dir: str | Path | None = None,
             split_file: str | Path | None = None,
             captions_per_image: int | None = 10) -> Source[CaptionExample]:
    """CUB-200-2011 (``raw_dir`` = ``CUB_200_2011/``) with the text_c10 captions (default
    ``<raw_dir>/text_c10``), in ``images.txt`` order. ``captions_per_image``: the exact count
    each text file must hold (None: any, at least one)."""
    raw_dir = Path(raw_dir)
    text_dir = Path(text_dir) if text_dir else raw_dir / "text_c10"
    layout = _read_layout(raw_dir, Path(split_file) if split_file else None, False)
    examples = []
    for key in layout.images.rows:
        _integer(layout.images, key, key, "image id")
        relative = Path(layout.images.value(key))
        class_id = layout.labels.value(key)
        folder = layout.classes.value(class_id)
        if len(relative.parts) != 2 or relative.parts[0] != folder:
            raise LayoutError(f"{layout.images.where(key)}: image {relative.as_posix()!r} is "
                              f"not in its class folder, expected '{folder}/<file>' (class "
                              f"{class_id} at {layout.labels.where(key)})")
        image_path = layout.image_path(key)
        captions = _read_captions(text_dir / relative.with_suffix(".txt"), layout.images, key,
                                  captions_per_image)
        examples.append(CaptionExample(image_path, captions, layout.split(key), key,
                                       layout.label(key).label_id))
    return Source("cub", examples, _labels(layout))


_NABIRDS_ID = re.compile(r"^[0-9a-f]{32}$")


def read_nabirds(raw_dir: str | Path) -> Source[ClassificationExample]:
    """NABirds (``raw_dir`` holds ``images.txt`` ... and ``images/``), in ``images.txt``
    order; class ids mapped to 0-based labels (``Source.label_map``)."""
    raw_dir = Path(raw_dir)
    layout = _read_layout(raw_dir, None, True)
    examples = []
    for key in layout.images.rows:
        if not _NABIRDS_ID.match(key.replace("-", "").lower()):
            raise LayoutError(f"{layout.images.where(key)}: image id {key!r}, expected 32 hex "
                              "digits (dashes allowed)")
        label = layout.label(key)
        examples.append(ClassificationExample(layout.image_path(key), label.label_id,
                                              label.name, layout.split(key), key,
                                              label.class_id))
    return Source("nabirds", examples, _labels(layout))


# ---------------------------------------------------------------------------------------------
# Feature functions
# ---------------------------------------------------------------------------------------------


def resnet_feature_fn(weights: str | Path, layer: int = 4, *, device: str | None = None,
                      std_fix: bool = False) -> FeatureFn:
    """The project's ResNet-101 extractor (``data_prep.extract_features``, official
    preprocessing) with local torchvision-format ``weights``, loaded once; layer 4 gives
    IDC-PCL's (7, 7, 2048) grids."""
    from changecap_jax.features import extract as extraction
    from changecap_jax.features import resnet

    model = resnet.load_resnet101(weights, layer, device=extraction.pick_device(device))

    def extract(paths: Sequence[Path]) -> np.ndarray:
        feats = [f for _, f in extraction.extract_features(list(paths), model, layer,
                                                   batch_size=max(1, len(paths)),
                                                   std_fix=std_fix)]
        return np.stack(feats).transpose(0, 2, 3, 1)  # (N, C, H, W) -> channels-last

    return extract


def npy_feature_fn(features_dir: str | Path, images_dir: str | Path) -> FeatureFn:
    """Precomputed (C, H, W) features in ``data_prep.extract_features``' naming:
    ``<features_dir>/<path under images_dir>.npy``, else ``<features_dir>/<file name>.npy``."""
    features_dir, images_dir = Path(features_dir), Path(images_dir)

    def load_one(path: Path) -> np.ndarray:
        candidates = [features_dir / f"{path.name}.npy"]
        if path.is_relative_to(images_dir):
            candidates.insert(0, features_dir / f"{path.relative_to(images_dir)}.npy")
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            raise FileNotFoundError(f"no features for {path}: none of "
                                    f"{[str(c) for c in candidates]} exists")
        array = np.load(found, allow_pickle=False)
        if array.ndim != 3:
            raise ValueError(f"{found}: shape {array.shape}, expected (C, H, W)")
        return array.transpose(1, 2, 0)

    def load(paths: Sequence[Path]) -> np.ndarray:
        grids = [load_one(p) for p in paths]
        if len({g.shape for g in grids}) > 1:
            raise ValueError(f"feature files of different shapes among {list(paths)}")
        return np.stack(grids)

    return load


# ---------------------------------------------------------------------------------------------
# Building feature files
# ---------------------------------------------------------------------------------------------


def encode_texts(vocab: Vocabulary, texts: Sequence[Sequence[str]], max_len: int | None,
                 unknown: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """Per example a list of texts -> ids (N, K, L) zero-padded (K: most texts of an example;
    L: ``max_len``, where longer texts are cut with a forced ``<END>``, else the longest) and
    the text count per example (N,). Unknown words become ``<UNK>``, counted in ``unknown``."""
    length = max_len or max(len(vocab.tokenize(t)) for group in texts for t in group)
    ids = np.zeros((len(texts), max((len(g) for g in texts), default=0), length), np.int32)
    for n, group in enumerate(texts):
        ids[n, : len(group)] = vocab.encode_many(list(group), length, allow_unk=True,
                                                 unknown_counter=unknown, truncate=True)
    return ids, np.array([len(g) for g in texts], np.int32)


def _text_arrays(source: Source, vocab: Vocabulary | None, max_len: int | None,
                 unknown: dict[str, int]) -> tuple[dict[str, dict[str, np.ndarray]], int | None]:
    """Per split, the token arrays, and their length (one over all splits)."""
    if vocab is None:
        return {}, None
    if source.task == "caption":
        texts = [list(e.captions) for e in source.examples]
    else:
        texts = [[source.labels[e.label_id].text] for e in source.examples]
    ids, counts = encode_texts(vocab, texts, max_len, unknown)
    out: dict[str, dict[str, np.ndarray]] = {}
    for split in {e.split for e in source.examples}:
        rows = [n for n, e in enumerate(source.examples) if e.split == split]
        if source.task == "caption":
            out[split] = {"caption_ids": ids[rows], "num_captions": counts[rows]}
        else:
            out[split] = {"label_text_ids": ids[rows, 0]}
    return out, int(ids.shape[-1])


CAPTION_NEGATIVE_KINDS = ("retrieve", "replace")  # A.3: no Confuse for single-image captions
CAPTION_NEGATIVES_PER_KIND = 3  # 6 per image, the FDA group size of the IDC pairs


def caption_negatives(source: Source, vocab: Vocabulary, *, seed: int = 0,
                      pos: str = "lexicon", progress: bool = False) -> dict[str, list[dict]]:
    """A.3's FDA negatives of a caption source, per split: each image is a pseudo pair whose
    references are its captions, with 3 Retrieve and 3 Replace negatives (no Confuse: a
    single-image caption describes no difference) made by ``data_prep.hard_negatives`` (TF-IDF
    fitted on the train captions; records in its file format, ``img2`` = ``cub_semantic_<id>``).
    Captions the tokeniser rejects are left out of the references."""
    pairs: dict[str, list] = {}
    for split in sorted({e.split for e in source.examples}):
        rows = []
        for e in source.split(split):
            refs = []
            for text in e.captions:
                try:
                    tokens = tuple(vocab.tokenize(text)[1:-1])
                except CaptionError:
                    continue
                if hn.caption_key(tokens):
                    refs.append(hn.Caption(text, tokens))
            if not refs:
                raise ValueError(f"image {e.image_id} ({e.image_path}) has no caption the "
                                 "tokeniser accepts, so no FDA negatives")
            rows.append(hn.Pair(e.image_id, True, refs))
        pairs[split] = rows
    if "train" not in pairs:
        raise ValueError("FDA negatives need a train split (TF-IDF is fitted on it)")
    made = hn.negatives_for_pairs(pairs, source.name, vocab.tokenizer, vocab.tokenize,
                                  splits=sorted(pairs), seed=seed, pos=pos,
                                  kinds=CAPTION_NEGATIVE_KINDS,
                                  per_kind=CAPTION_NEGATIVES_PER_KIND, progress=progress)
    return made.records


def _write_features(path: Path, images: Sequence[Path], feature_fn: FeatureFn,
                    batch_size: int, dtype: str, desc: str, progress: bool) -> tuple[int, ...]:
    """Streams the grids of ``images`` into a (N, H, W, C) ``.npy``; returns (H, W, C)."""
    stored = None
    with console.Progress(total=len(images), unit="img", desc=desc, disable=not progress,
                          dynamic_ncols=True) as bar:
        for start in range(0, len(images), batch_size):
            chunk = images[start:start + batch_size]
            grids = np.asarray(feature_fn(chunk))
            if grids.ndim != 4 or grids.shape[0] != len(chunk):
                raise ValueError(f"the feature function gave shape {grids.shape} for "
                                 f"{len(chunk)} images, expected (N, H, W, C)")
            if stored is None:
                stored = np.lib.format.open_memmap(path, mode="w+", dtype=dtype,
                                                   shape=(len(images), *grids.shape[1:]))
            if grids.shape[1:] != stored.shape[1:]:
                raise ValueError(f"grid shape {grids.shape[1:]} at image {start}, earlier "
                                 f"{stored.shape[1:]}")
            cast = grids.astype(dtype)
            if not np.isfinite(cast).all():
                raise ValueError(f"non-finite features at images {start}..{start + len(chunk)}"
                                 f" as {dtype} (use float32)")
            stored[start:start + len(chunk)] = cast
            bar.update(len(chunk))
    assert stored is not None
    stored.flush()
    return tuple(stored.shape[1:])


def build_source(source: Source, feature_fn: FeatureFn, out: str | Path, *,
                 vocab: Vocabulary | None = None, max_len: int | None = None,
                 batch_size: int = 64, feature_dtype: str = "float16",
                 progress: bool = True, negatives: bool = False, negatives_seed: int = 0,
                 pos: str = "lexicon") -> Path:
    """Writes ``out`` (layout in the module docstring) through a temporary sibling directory
    renamed into place at the end, so ``out`` is complete or absent; returns it. CUB needs
    ``vocab``; with NABirds it adds the label names' tokens. The texts are encoded before the
    features are extracted, so a text error costs no extraction. ``negatives`` (caption
    sources): also ``<split>_neg_tfidf6.json`` of :func:`caption_negatives` (``pos``: the
    word classes' tagger, as ``data_prep.hard_negatives --pos``), for FDA pretraining."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty directory")
    if source.task == "caption" and vocab is None:
        raise ValueError("a captioning source needs a vocabulary (--vocab)")
    if not source.examples:
        raise ValueError(f"source {source.name!r} has no example")
    if negatives and source.task != "caption":
        raise ValueError("FDA negatives are made for caption sources only (A.3)")
    unknown: dict[str, int] = {}
    texts, text_length = _text_arrays(source, vocab, max_len, unknown)
    log_unknown_words(unknown, f"{source.name} texts")
    negative_records = (caption_negatives(source, vocab, seed=negatives_seed, pos=pos,
                                          progress=progress) if negatives and vocab else {})
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = staging_dir(out.parent, out.name)
    try:
        counts, shape = {}, None
        for split in sorted({e.split for e in source.examples}):
            chosen = source.split(split)
            shape = _write_features(tmp / f"{split}.features.npy",
                                    [e.image_path for e in chosen], feature_fn, batch_size,
                                    feature_dtype, f"{source.name} {split}", progress)
            np.savez(tmp / f"{split}.npz", image_ids=np.array([e.image_id for e in chosen]),
                     task=np.array([e.task for e in chosen]),
                     labels=np.array([e.label_id for e in chosen], np.int32),
                     **texts.get(split, {}))
            counts[split] = len(chosen)
            if split in negative_records:
                write_negatives(negative_records[split], negatives_path(tmp, split))
        meta = {"source": source.name, "task": source.task, "splits": counts,
                "feature_shape": list(shape or ()), "feature_dtype": feature_dtype,
                "vocab_size": len(vocab) if vocab else None,
                "tokenizer": vocab.tokenizer if vocab else None,
                "text_length": text_length,
                "unknown_words": sum(unknown.values()),
                "negatives": ({"kinds": list(CAPTION_NEGATIVE_KINDS),
                               "per_kind": CAPTION_NEGATIVES_PER_KIND, "seed": negatives_seed}
                              if negative_records else None),
                "labels": [dataclasses.asdict(label) for label in source.labels]}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def _define_flags() -> None:
    flags.DEFINE_enum("source", None, list(TASKS), "Which cross-task source.", required=True)
    flags.DEFINE_string("raw_dir", None, "The dataset in its official layout (CUB: the "
                        "CUB_200_2011 folder).", required=True)
    flags.DEFINE_string("out", None, "Output directory (absent or empty).", required=True)
    flags.DEFINE_string("vocab", None, "vocab.json of the difference-captioning dataset "
                        "(required for CUB).")
    flags.DEFINE_string("tokenizer", None, "The vocabulary's tokenizer (default: from the "
                        "meta.json beside --vocab, else 'clevr').")
    flags.DEFINE_string("weights", None, "Local torchvision ResNet-101 state dict.")
    flags.DEFINE_string("features_dir", None, "Instead of --weights: precomputed per-image "
                        "<image file name>.npy (C, H, W) from data_prep.extract_features.")
    flags.DEFINE_integer("layer", 4, "ResNet stage kept (IDC-PCL: 4, (7, 7, 2048)).",
                         lower_bound=3, upper_bound=4)
    flags.DEFINE_boolean("std_fix", False, "Blue std 0.225 instead of the official 0.224.")
    flags.DEFINE_string("device", None, "torch device (default: cuda if available).")
    flags.DEFINE_integer("batch_size", 64, "Images per extraction batch.", lower_bound=1)
    flags.DEFINE_enum("feature_dtype", "float16", ["float16", "float32"], "Stored dtype.")
    flags.DEFINE_string("text_dir", None, "CUB: the text_c10 folder (default "
                        "<raw_dir>/text_c10).")
    flags.DEFINE_string("split_file", None, "CUB: another file in train_test_split.txt form.")
    flags.DEFINE_integer("captions_per_image", 10, "CUB: captions each text file must hold "
                         "(0: any).", lower_bound=0)
    flags.DEFINE_boolean("negatives", False, "CUB: also write <split>_neg_tfidf6.json, 3 "
                         "Retrieve + 3 Replace FDA negatives per image (A.3).")
    flags.DEFINE_integer("negatives_seed", 0, "Seed of the negatives.")
    flags.DEFINE_enum("pos", "lexicon", ["auto", "spacy", "lexicon"], "Word classes' tagger "
                      "for Replace (as data_prep.hard_negatives --pos).")
    flags.DEFINE_integer("max_len", 0, "Token cap with <START>/<END> (0: the longest text).",
                         lower_bound=0)


def _vocab_tokenizer(vocab_path: str) -> str:
    meta = Path(vocab_path).with_name("meta.json")
    if meta.is_file():
        tokenizer = json.loads(meta.read_text()).get("tokenizer")
        if isinstance(tokenizer, str):
            return tokenizer
    return "clevr"


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    f = flags.FLAGS
    if (f.weights is None) == (f.features_dir is None):
        raise app.UsageError("give exactly one of --weights and --features_dir")
    try:
        if f.source == "cub":
            source: Source = read_cub(f.raw_dir, f.text_dir, f.split_file,
                                      f.captions_per_image or None)
        else:
            source = read_nabirds(f.raw_dir)
        vocab = (Vocabulary.load(f.vocab, f.tokenizer or _vocab_tokenizer(f.vocab))
                 if f.vocab else None)
        if f.weights:
            feature_fn = resnet_feature_fn(f.weights, f.layer, device=f.device,
                                           std_fix=f.std_fix)
        else:
            feature_fn = npy_feature_fn(f.features_dir, Path(f.raw_dir) / "images")
        out = build_source(source, feature_fn, f.out, vocab=vocab, max_len=f.max_len or None,
                           batch_size=f.batch_size, feature_dtype=f.feature_dtype,
                           negatives=f.negatives, negatives_seed=f.negatives_seed, pos=f.pos)
    except (LayoutError, OSError, ValueError, HardNegativeError) as e:  # OSError: files, images
        sys.exit(f"error: {e}")
    sizes = ", ".join(f"{len(source.split(s))} {s}" for s in ("train", "test"))
    print(f"{f.source}: {len(source.examples)} images ({sizes}), {len(source.labels)} classes"
          f" -> {out}")


if __name__ == "__main__":
    _define_flags()
    cli.run(main)
