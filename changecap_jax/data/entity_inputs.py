"""Retrieved change entities as extra inputs of each pair (written by ``data_prep.retrieval``).

A model that reads text entities beside the images declares it (``conditioning_shapes()``
returns ``{"entities": (k, D)}``); the trainer then attaches the dataset's retrieval results,
and every record gains, per pair orientation ``o``,

* ``entity_ids_<o>`` (k,) int32: the ids of the k retrieved entities, best first;
* ``entities_<o>`` (k, D) float32: their embeddings (rows of ``embeddings.npy``).

Orientations are the (before, after) image order of a pair: ``semantic`` (before,
after_semantic), ``distractor`` (before, after_distractor) and ``distractor_swapped``
(after_distractor, before), which the training pipeline uses when its augmentation swaps the
before and distractor images (the retrieval score is not symmetric in the two images).

The files, in ``<dataset directory>/entity_retrieval/`` (written by ``data_prep.retrieval``;
this module is their one reader, for the trainer and for ``data_prep`` alike): ``meta.json``
(format, backbone, k, difference, num_entities M, embedding_dim D, orientations, splits
{split: N}), ``embeddings.npy`` (M, D) float32, ``texts.json`` (M strings) and
``<split>.npz`` (``record_ids`` int64 (N,) and, per orientation o, ``ids_<o>`` int32 (N, k),
``scores_<o>`` float32 (N, k), ``constrained_<o>`` bool (N, k)).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from changecap_jax.errors import UserError
from changecap_jax.io.jsonio import read_json

RETRIEVAL_DIR = "entity_retrieval"
FORMAT = "changecap_jax.entity_retrieval/1"
ORIENTATIONS = ("semantic", "distractor", "distractor_swapped")
DIFFERENCES = ("signed", "absolute")  # Eq. 1 as printed, or its absolute value
PAIR_FIELDS = ("entities", "entity_ids")  # per-orientation record fields this module adds


class EntityInputError(UserError, ValueError):
    """Retrieval files that are missing or do not fit the dataset."""


def _fail(path: Path, key: str, problem: str) -> EntityInputError:
    return EntityInputError(f"{path}: {key} {problem}")


@dataclasses.dataclass
class SplitRetrieval:
    """One split's retrieval: row i is record i of the split."""

    record_ids: np.ndarray  # (N,) int64
    ids: dict[str, np.ndarray]  # orientation -> (N, k) int32, best first
    scores: dict[str, np.ndarray]  # orientation -> (N, k) float32, Eq. 1's scores
    constrained: dict[str, np.ndarray]  # orientation -> (N, k) bool: passed the constraint


@dataclasses.dataclass
class EntityInputs:
    """The retrieval of one dataset: entity texts and embeddings, per-split top-k ids."""

    directory: Path
    meta: dict[str, Any]
    texts: list[str]
    embeddings: np.ndarray  # (M, D) float32

    @property
    def k(self) -> int:
        return int(self.meta["k"])

    @property
    def orientations(self) -> tuple[str, ...]:
        return tuple(self.meta["orientations"])

    def split(self, name: str, num_records: int | None = None) -> SplitRetrieval:
        """The arrays of one split, each checked for key, shape and dtype against meta.json
        (and against ``num_records``, the split's record count, when given)."""
        meta_path = self.directory / "meta.json"
        if name not in self.meta["splits"]:
            raise _fail(meta_path, "splits", f"has no {name!r} (it has "
                        f"{sorted(self.meta['splits'])}); run python -m data_prep.retrieval "
                        "for that split")
        path = self.directory / f"{name}.npz"
        if not path.exists():
            raise _fail(path, "file", f"missing (meta.json lists split {name!r})")
        n = int(self.meta["splits"][name])
        if num_records is not None and num_records != n:
            raise _fail(path, "record_ids", f"holds {n} rows but the split has {num_records} "
                        "records (the dataset was rebuilt after the retrieval? run "
                        "python -m data_prep.retrieval again)")
        with np.load(path) as data:
            arrays = {key: data[key] for key in data.files}
        record_ids = _array(path, arrays, "record_ids", (n,), np.int64)
        out = SplitRetrieval(record_ids, {}, {}, {})
        for o in self.orientations:
            ids = _array(path, arrays, f"ids_{o}", (n, self.k), np.int32)
            if ids.size and (ids.min() < 0 or ids.max() >= len(self.texts)):
                raise _fail(path, f"ids_{o}", f"holds ids outside [0, {len(self.texts)})")
            out.ids[o] = ids
            out.scores[o] = _array(path, arrays, f"scores_{o}", (n, self.k), np.float32)
            out.constrained[o] = _array(path, arrays, f"constrained_{o}", (n, self.k), np.bool_)
        return out

    def split_ids(self, split: str, num_records: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(record_ids (N,), orientation -> ids (N, k)) of one split, checked against it."""
        arrays = self.split(split, num_records)
        return arrays.record_ids, arrays.ids


def _array(path: Path, arrays: dict[str, np.ndarray], key: str, shape: tuple[int, ...],
           dtype: Any) -> np.ndarray:
    if key not in arrays:
        raise _fail(path, key, f"is missing (expected {shape} {np.dtype(dtype)})")
    a = arrays[key]
    if a.shape != shape or a.dtype != dtype:
        raise _fail(path, key, f"has shape {a.shape} dtype {a.dtype}, expected {shape} "
                    f"{np.dtype(dtype)}")
    return a


def _check_meta(path: Path, meta: Any) -> dict[str, Any]:
    if not isinstance(meta, dict):
        raise _fail(path, "top level", "must be a JSON object")
    if meta.get("format") != FORMAT:
        raise _fail(path, "format", f"is {meta.get('format')!r}, expected {FORMAT!r}")
    for key in ("k", "num_entities", "embedding_dim"):
        if type(meta.get(key)) is not int or meta[key] < 1:
            raise _fail(path, key, f"must be a positive integer, got {meta.get(key)!r}")
    if meta["k"] > meta["num_entities"]:
        raise _fail(path, "k", f"is {meta['k']}, more than num_entities {meta['num_entities']}")
    if not isinstance(meta.get("backbone"), str) or not meta["backbone"]:
        raise _fail(path, "backbone", f"must name the retrieval backbone, got "
                    f"{meta.get('backbone')!r}")
    if meta.get("difference") not in DIFFERENCES:
        raise _fail(path, "difference", f"is {meta.get('difference')!r}, expected one of "
                    f"{DIFFERENCES}")
    orientations = meta.get("orientations")
    if (not isinstance(orientations, list) or not orientations
            or not set(orientations) <= set(ORIENTATIONS)):
        raise _fail(path, "orientations", f"is {orientations!r}, expected a non-empty list of "
                    f"{ORIENTATIONS}")
    splits = meta.get("splits")
    if not isinstance(splits, dict) or not all(
            type(n) is int and n >= 0 for n in splits.values()):
        raise _fail(path, "splits", f"is {splits!r}, expected {{split: number of records}}")
    return meta


def load(dataset_directory: str | Path) -> EntityInputs:
    """Reads and checks ``<dataset_directory>/entity_retrieval`` (the split arrays are read
    by :meth:`EntityInputs.split`); errors name the file, the key and what was expected."""
    directory = Path(dataset_directory) / RETRIEVAL_DIR
    meta_path = directory / "meta.json"
    if not meta_path.exists():
        raise EntityInputError(
            f"{meta_path} does not exist: this model reads retrieved change entities; create "
            f"them with python -m data_prep.entities and then python -m data_prep.retrieval "
            f"for the dataset in {Path(dataset_directory)} (training a synthetic preset with "
            f"python -m changecap_jax.main makes them on first use)")
    try:
        meta = _check_meta(meta_path, read_json(meta_path, "retrieval meta file"))
    except ValueError as e:  # bad JSON: already names the file
        raise EntityInputError(str(e)) from e
    shape = (meta["num_entities"], meta["embedding_dim"])
    emb_path = directory / "embeddings.npy"
    if not emb_path.exists():
        raise _fail(emb_path, "file", f"missing (expected {shape} float32)")
    embeddings = np.load(emb_path)
    if embeddings.shape != shape or embeddings.dtype != np.float32:
        raise _fail(emb_path, "array", f"has shape {embeddings.shape} dtype {embeddings.dtype}, "
                    f"expected {shape} float32 (meta.json num_entities, embedding_dim)")
    texts_path = directory / "texts.json"
    if not texts_path.exists():
        raise _fail(texts_path, "file", f"missing (expected {shape[0]} entity strings)")
    texts = read_json(texts_path, "retrieval entity texts")
    if (not isinstance(texts, list) or len(texts) != shape[0]
            or not all(isinstance(t, str) for t in texts)):
        raise _fail(texts_path, "list", f"must hold num_entities = {shape[0]} strings")
    for split in meta["splits"]:
        if not (directory / f"{split}.npz").exists():
            raise _fail(directory / f"{split}.npz", "file", f"missing (meta.json lists split "
                        f"{split!r})")
    return EntityInputs(directory, meta, texts, embeddings)


class WithEntities:
    """A data source whose records gain ``entity_ids_<o>`` / ``entities_<o>`` (first
    ``count`` of the k retrieved) for every orientation the dataset has. ``count`` is checked
    against k once, by ``datasets.with_entities``, which every use goes through."""

    def __init__(self, source: Any, inputs: EntityInputs, split: str, count: int):
        self._source, self._inputs, self._count = source, inputs, count
        self._record_ids, self._ids = inputs.split_ids(split, len(source))
        self._path = inputs.directory / f"{split}.npz"

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> dict[str, Any]:
        record = dict(self._source[index])
        if int(record["id"]) != int(self._record_ids[index]):  # cheap join check per read
            raise EntityInputError(
                f"{self._path}: row {index} is for record id {int(self._record_ids[index])}, "
                f"the split's record {index} has id {int(record['id'])}; run "
                "data_prep.retrieval again for this dataset")
        for o, ids in self._ids.items():
            chosen = ids[index, : self._count]
            record[f"entity_ids_{o}"] = chosen
            record[f"entities_{o}"] = self._inputs.embeddings[chosen]
        return record

    def __repr__(self) -> str:
        return f"WithEntities({self._source!r}, k={self._count})"


def entity_texts(inputs: EntityInputs, ids: np.ndarray) -> list[str]:
    return [inputs.texts[int(i)] for i in np.asarray(ids).reshape(-1)]
