"""IDC-PCL's cross-task sources as pretraining streams (paper §2.4, appendix A.3).

``python -m data_prep.cross_task`` writes a source directory: ``meta.json`` (its ``task``:
"caption" for CUB-200-2011, "classify" for NABirds; ``splits``; ``feature_shape``; ``labels``;
for captions ``vocab_size`` and ``text_length``), per split ``<split>.features.npy`` (N, H, W, C)
and ``<split>.npz`` (``labels`` (N,), captions: ``caption_ids`` (N, K, L) + ``num_captions``).
:func:`open_source` reads and checks one split (errors name the file and the key); the two
sample sources below turn it into grain-readable rows for ``changecap_jax.trainers.pretraining``:

* :class:`CaptionPseudoPairs` (GIC, CUB): image i is the pseudo pair (its grid, an EMPTY second
  image) with its captions; the empty image is read as a zero grid of the same shape (A.3 draws
  it as a dashed, i.e. absent, image; zeros are also what MVCL writes into a masked region, so
  the model sees "no visual content"). ``PickCaption`` then draws one caption per visit; for
  FDA each row also carries the image's 6 negatives (``<split>_neg_tfidf6.json``).
* :class:`ClassificationPairs` (FGVC, NABirds): the pairs of :func:`classification_pairs`,
  each row both images with their labels and the same-class flag.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from changecap_jax.data import building
from changecap_jax.errors import UserError
from changecap_jax.io import paths

CAPTION, CLASSIFY = "caption", "classify"
TASKS = (CAPTION, CLASSIFY)


class ExtraSourceError(UserError, ValueError):
    """A cross-task source directory that cannot be read (names the file and the key)."""


@dataclasses.dataclass(frozen=True)
class ExtraSource:
    """One split of a source written by ``data_prep.cross_task.build_source``."""

    directory: Path
    split: str
    task: str
    features: np.ndarray  # (N, H, W, C), memory-mapped
    labels: np.ndarray  # (N,) int, 0 .. num_classes - 1
    num_classes: int
    caption_ids: np.ndarray | None = None  # (N, K, L), caption sources only
    num_captions: np.ndarray | None = None  # (N,)
    image_ids: np.ndarray | None = None  # (N,) str: what the FDA negatives are joined by

    def __len__(self) -> int:
        return len(self.labels)


def _meta(directory: Path) -> dict[str, Any]:
    path = directory / "meta.json"
    if not directory.is_dir():
        raise ExtraSourceError(f"{directory}: config.pretrain.extra_source.dir is not a "
                               "directory (make it with python -m data_prep.cross_task)")
    if not path.is_file():
        raise ExtraSourceError(f"{path}: missing (a source of python -m data_prep.cross_task "
                               "has a meta.json)")
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExtraSourceError(f"{path}: not readable JSON ({e})") from e
    if not isinstance(meta, dict):
        raise ExtraSourceError(f"{path}: expected a JSON object")
    return meta


def _field(meta: dict, path: Path, key: str, check: Any, expected: str) -> Any:
    value = meta.get(key)
    if key not in meta or not check(value):
        raise ExtraSourceError(f"{path}: key {key!r} is {value!r}, expected {expected}")
    return value


def local_directory(directory: str | Path, wait_s: float = 3600.0) -> Path:
    """The source directory to read: itself, or for a bucket folder (``gs://...``) this host's
    local copy (``paths.local_mirror_dir``, refreshed file by file; one process of a host
    copies while the others wait). The feature arrays are memory-mapped and read at random,
    which a bucket cannot serve; hard negatives made on first use stay in the copy."""
    if not paths.is_remote(directory):
        return Path(directory)
    local = paths.local_mirror_dir(directory)
    remote = paths.path(directory)
    if not (remote / "meta.json").exists():
        raise ExtraSourceError(f"{directory}: config.pretrain.extra_source.dir has no "
                               "meta.json (make it with python -m data_prep.cross_task)")
    try:
        with building.dataset_lock(local, f"the local copy of {directory}", wait_s):
            paths.mirror(remote, local, "extra source", last=("meta.json",))
    except building.LockTimeout as e:
        raise ExtraSourceError(str(e)) from e
    return local


def read_meta(directory: str | Path) -> dict[str, Any]:
    """``meta.json`` of a source directory, with the keys pretraining uses checked."""
    directory = local_directory(directory)
    meta, path = _meta(directory), directory / "meta.json"
    _field(meta, path, "task", lambda v: v in TASKS, f"one of {TASKS}")
    _field(meta, path, "splits", lambda v: isinstance(v, dict) and v,
           'a non-empty object {"<split>": <images>}')
    _field(meta, path, "feature_shape",
           lambda v: isinstance(v, list) and len(v) == 3 and all(
               isinstance(n, int) and n > 0 for n in v), "[H, W, C] of positive integers")
    _field(meta, path, "labels", lambda v: isinstance(v, list) and v, "a non-empty label list")
    if meta["task"] == CAPTION:
        _field(meta, path, "vocab_size", lambda v: isinstance(v, int) and v > 0,
               "the vocabulary size the captions were encoded with")
        _field(meta, path, "text_length", lambda v: isinstance(v, int) and v > 0,
               "the caption length L")
    return meta


def _array(arrays: Any, path: Path, key: str, ndim: int, rows: int, what: str) -> np.ndarray:
    if key not in arrays.files:
        raise ExtraSourceError(f"{path}: no array {key!r} ({what}); it has {arrays.files}")
    value = arrays[key]
    if value.ndim != ndim or value.shape[0] != rows:
        raise ExtraSourceError(f"{path}: {key!r} has shape {value.shape}, expected {what} "
                               f"with {rows} rows")
    return value


def open_source(directory: str | Path, split: str = "train") -> ExtraSource:
    """Split ``split`` of a source directory, checked against its ``meta.json``."""
    directory = local_directory(directory)
    meta = read_meta(directory)
    meta_path = directory / "meta.json"
    if split not in meta["splits"]:
        raise ExtraSourceError(f"{meta_path}: key 'splits' has no split {split!r} (it has "
                               f"{sorted(meta['splits'])}); set "
                               "config.pretrain.extra_source.split")
    feature_path = directory / f"{split}.features.npy"
    npz_path = directory / f"{split}.npz"
    for path in (feature_path, npz_path):
        if not path.is_file():
            raise ExtraSourceError(f"{path}: missing (split {split!r} of {meta_path})")
    features = np.load(feature_path, mmap_mode="r", allow_pickle=False)
    rows = int(meta["splits"][split])
    if features.shape != (rows, *meta["feature_shape"]):
        raise ExtraSourceError(f"{feature_path}: shape {features.shape}, expected (N, H, W, C) "
                               f"= {(rows, *meta['feature_shape'])} (meta.json 'splits', "
                               "'feature_shape')")
    num_classes = len(meta["labels"])
    with np.load(npz_path, allow_pickle=False) as arrays:
        labels = _array(arrays, npz_path, "labels", 1, rows, "(N,) class ids").astype(np.int64)
        captions = counts = None
        image_ids = (_array(arrays, npz_path, "image_ids", 1, rows, "(N,) image ids")
                     if "image_ids" in arrays.files else None)
        if meta["task"] == CAPTION:
            captions = _array(arrays, npz_path, "caption_ids", 3, rows, "(N, K, L) token ids")
            counts = _array(arrays, npz_path, "num_captions", 1, rows, "(N,) caption counts")
            if captions.shape[-1] != meta["text_length"]:
                raise ExtraSourceError(f"{npz_path}: 'caption_ids' has length "
                                       f"{captions.shape[-1]}, meta.json 'text_length' "
                                       f"{meta['text_length']}")
            if np.any(counts < 1) or np.any(counts > captions.shape[1]):
                raise ExtraSourceError(f"{npz_path}: 'num_captions' outside 1..{captions.shape[1]}")
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ExtraSourceError(f"{npz_path}: 'labels' outside 0..{num_classes - 1} (the "
                               "meta.json 'labels' table)")
    return ExtraSource(directory, split, meta["task"], features, labels, num_classes,
                       captions, counts, image_ids)


# ---------------------------------------------------------------------------------------------
# Sample sources (random access, for grain)
# ---------------------------------------------------------------------------------------------


class CaptionPseudoPairs:
    """GIC rows: image i as (its grid, a zero grid) with all its captions, padded to
    ``length`` ids (the difference-captioning dataset's), for ``PickCaption``. With
    ``negatives`` ((image_id, True) -> texts, ``negatives.negatives_by_pair`` of the source's
    ``<split>_neg_tfidf6.json``, named by ``origin``) also its FDA negatives (K, length),
    encoded by ``vocab`` as the IDC pairs' (unknown words <UNK>, cut to ``length``)."""

    def __init__(self, source: ExtraSource, length: int, *, negatives: Any = None,
                 vocab: Any = None, origin: str = "the hard-negatives file"):
        assert source.caption_ids is not None and source.num_captions is not None
        if negatives is not None and (vocab is None or source.image_ids is None):
            raise ExtraSourceError(f"{source.directory / (source.split + '.npz')}: FDA "
                                   "negatives need the vocabulary and the 'image_ids' array")
        self.negatives, self.vocab, self.origin = negatives, vocab, origin
        if source.caption_ids.shape[-1] > length:
            raise ExtraSourceError(
                f"{source.directory / (source.split + '.npz')}: captions of "
                f"{source.caption_ids.shape[-1]} ids are longer than the dataset's {length}; "
                f"rebuild the source with python -m data_prep.cross_task --max_len={length}")
        self.source, self.length = source, length

    def __len__(self) -> int:
        return len(self.source)

    def __repr__(self) -> str:
        # grain checks a restored iterator against repr(data source): it must be stable.
        joined = f", negatives from {self.origin}" if self.negatives is not None else ""
        return (f"CaptionPseudoPairs({self.source.directory}, split={self.source.split}, "
                f"images={len(self)}, length={self.length}{joined})")

    def __getitem__(self, index: int) -> dict[str, Any]:
        src = self.source
        grid = np.asarray(src.features[index])
        captions = src.caption_ids[index, : src.num_captions[index]]
        pad = self.length - captions.shape[-1]
        sample = {"img1": grid, "img2": np.zeros_like(grid),
                  "captions": np.pad(captions, ((0, 0), (0, pad))).astype(np.int32)}
        if self.negatives is not None:
            sample["negatives"] = self._encode(str(src.image_ids[index]))
        return sample

    def _encode(self, image_id: str) -> np.ndarray:
        texts = self.negatives.get((image_id, True))
        if texts is None:
            raise ExtraSourceError(f"{self.origin} has no negatives for image {image_id!r} "
                                   "(made for another build of this source? rebuild it with "
                                   "python -m data_prep.cross_task --negatives)")
        return np.stack([self.vocab.encode(t, self.length, allow_unk=True, truncate=True)
                         for t in texts]).astype(np.int32)


class ClassificationPairs:
    """FGVC rows: pair k = ``pairs[k]`` = (i, j, same) as both grids, their labels and the
    same-class flag."""

    def __init__(self, source: ExtraSource, pairs: np.ndarray):
        self.source, self.pairs = source, np.asarray(pairs, np.int64)

    def __len__(self) -> int:
        return len(self.pairs)

    def __repr__(self) -> str:
        return (f"ClassificationPairs({self.source.directory}, split={self.source.split}, "
                f"pairs={len(self)})")

    def __getitem__(self, index: int) -> dict[str, Any]:
        i, j, same = (int(v) for v in self.pairs[index])
        src = self.source
        return {"img1": np.asarray(src.features[i]), "img2": np.asarray(src.features[j]),
                "label1": np.int32(src.labels[i]), "label2": np.int32(src.labels[j]),
                "same": np.int32(same)}


def classification_pairs(labels: Sequence[int], num_pairs: int, seed: int = 0) -> np.ndarray:
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


# ---------------------------------------------------------------------------------------------
# Joining a step's rows
# ---------------------------------------------------------------------------------------------


def join_caption_rows(pairs: dict[str, Any], extra: dict[str, Any]) -> dict[str, np.ndarray]:
    """The drawn task's batch of difference pairs followed by the pseudo pairs (with their
    FDA negatives on FDA steps); ``pseudo`` (rows,) marks the latter (per row, so a
    multi-host global batch keeps the flag)."""
    keys = ("img1", "img2", "ids", *(("negatives",) if "negatives" in pairs else ()))
    out = {k: np.concatenate([np.asarray(pairs[k]), np.asarray(extra[k]).astype(
        np.asarray(pairs[k]).dtype)]) for k in keys}
    out["pseudo"] = np.concatenate([np.zeros(len(pairs["ids"]), bool),
                                    np.ones(len(extra["ids"]), bool)])
    return out


CLASSIFY_FIELDS = ("img1", "img2", "label1", "label2", "same")


def join_classify_rows(pairs: dict[str, Any], extra: dict[str, Any]) -> dict[str, np.ndarray]:
    """The drawn task's batch plus the classification rows under ``extra_<field>`` keys."""
    out = {k: v for k, v in pairs.items() if isinstance(v, np.ndarray) and v.dtype != object}
    out.update({f"extra_{k}": np.asarray(extra[k]) for k in CLASSIFY_FIELDS})
    return out
