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

The files, in ``<dataset directory>/entity_retrieval/``: ``meta.json`` (format, k,
num_entities, embedding_dim, orientations, splits), ``embeddings.npy`` (M, D) float32,
``texts.json`` (M strings) and ``<split>.npz`` (``record_ids`` (N,), ``ids_<o>`` (N, k)).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

RETRIEVAL_DIR = "entity_retrieval"
FORMAT = "changecap_jax.entity_retrieval/1"
ORIENTATIONS = ("semantic", "distractor", "distractor_swapped")
PAIR_FIELDS = ("entities", "entity_ids")  # per-orientation record fields this module adds


class EntityInputError(ValueError):
    """Retrieval files that are missing or do not fit the dataset."""


def _fail(path: Path, key: str, problem: str) -> EntityInputError:
    return EntityInputError(f"{path}: {key} {problem}")


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

    def split_ids(self, split: str, num_records: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(record_ids (N,), orientation -> ids (N, k)) of one split, checked against it."""
        path = self.directory / f"{split}.npz"
        if not path.exists():
            raise EntityInputError(f"{path} does not exist: the retrieval has no split {split!r}"
                                   f" (splits: {sorted(self.meta['splits'])}); run "
                                   "python -m data_prep.retrieval for it")
        with np.load(path) as data:
            arrays = {k: data[k] for k in data.files}
        if "record_ids" not in arrays:
            raise _fail(path, "record_ids", "is missing")
        record_ids = arrays["record_ids"]
        if record_ids.shape != (num_records,):
            raise _fail(path, "record_ids", f"has shape {record_ids.shape}, expected "
                        f"({num_records},): the split has {num_records} records (the dataset "
                        "was rebuilt after the retrieval? run data_prep.retrieval again)")
        ids = {}
        for o in self.orientations:
            key = f"ids_{o}"
            if key not in arrays:
                raise _fail(path, key, f"is missing (meta.json lists orientation {o!r})")
            a = arrays[key]
            if a.shape != (num_records, self.k) or not np.issubdtype(a.dtype, np.integer):
                raise _fail(path, key, f"has shape {a.shape} dtype {a.dtype}, expected "
                            f"({num_records}, {self.k}) integer")
            if a.size and (a.min() < 0 or a.max() >= len(self.texts)):
                raise _fail(path, key, f"holds ids outside [0, {len(self.texts)})")
            ids[o] = a.astype(np.int32)
        return record_ids, ids


def load(dataset_directory: str | Path) -> EntityInputs:
    """Reads ``<dataset_directory>/entity_retrieval``; errors name the file and the key."""
    directory = Path(dataset_directory) / RETRIEVAL_DIR
    meta_path = directory / "meta.json"
    if not meta_path.exists():
        raise EntityInputError(
            f"{meta_path} does not exist: this model reads retrieved change entities; create "
            f"them with python -m data_prep.entities and then python -m data_prep.retrieval "
            f"for the dataset in {Path(dataset_directory)}")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT:
        raise _fail(meta_path, "format", f"is {meta.get('format')!r}, expected {FORMAT!r}")
    for key in ("k", "num_entities", "embedding_dim"):
        if not isinstance(meta.get(key), int) or meta[key] < 1:
            raise _fail(meta_path, key, f"must be a positive integer, got {meta.get(key)!r}")
    unknown = set(meta.get("orientations", [])) - set(ORIENTATIONS)
    if not meta.get("orientations") or unknown:
        raise _fail(meta_path, "orientations", f"must be a non-empty subset of {ORIENTATIONS}")
    texts = json.loads((directory / "texts.json").read_text())
    embeddings = np.load(directory / "embeddings.npy")
    shape = (meta["num_entities"], meta["embedding_dim"])
    if embeddings.shape != shape:
        raise _fail(directory / "embeddings.npy", "array", f"has shape {embeddings.shape}, "
                    f"meta.json says {shape}")
    if not isinstance(texts, list) or len(texts) != shape[0]:
        raise _fail(directory / "texts.json", "list", f"must hold {shape[0]} entity strings")
    return EntityInputs(directory, meta, texts, embeddings.astype(np.float32))


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
