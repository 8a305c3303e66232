"""Hard-negative caption files of IDC-PCL's FDA pretraining task (reference §5.1): the reader
shared by the pretraining pipeline and ``data_prep.hard_negatives`` (which writes them).

A file is ``<dataset dir>/<split>_neg_tfidf6.json`` (the official name, ``neg_name =
"neg_tfidf6"``): JSON lines ``{"img1", "img2", "sentences", "neg_samples": [6 captions]}``,
ours with ``image_id`` and ``neg_kinds`` added. A pair is keyed by (image_id, semantic), the
image id from ``image_id`` or img2's "<prefix>_<semantic|nonsemantic>_<id>" name.

Section numbers (§) and quirk ids (S-Q, D-Q, I-Q) refer to docs/official/ (see its README.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from changecap_jax.errors import UserError

NUM_NEGATIVES = 6  # 2 retrieve, 2 replace, 2 confuse (paper A.2)
FILE_SUFFIX = "_neg_tfidf6.json"  # official: f"{split}_{neg_name}.json", neg_name "neg_tfidf6"


class NegativesFileError(UserError, ValueError):
    """A hard-negatives file that is missing keys or has values of the wrong type or shape."""


def negatives_path(directory: str | os.PathLike, split: str) -> Path:
    """``<directory>/<split>_neg_tfidf6.json``, the official file name."""
    return Path(directory) / f"{split}{FILE_SUFFIX}"


@dataclasses.dataclass(frozen=True)
class NegativeRecord:
    """One pair of a hard-negatives file (ours or the authors')."""

    img1: str
    img2: str
    sentences: tuple[str, ...]
    negatives: tuple[str, ...]
    image_id: str  # the file's "image_id", else from img2 "<prefix>_<kind>_<id>"
    semantic: bool | None  # img2's second "_" field, as IDC reads it; None if not named so
    kinds: tuple[str, ...] | None = None  # our "neg_kinds"; None in the authors' files


def _check_str(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise NegativesFileError(f"{where} must be a non-empty string, got {value!r}")
    return value


def _check_str_list(value: Any, where: str, length: int | None) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise NegativesFileError(f"{where} must be a list of strings, got "
                                 f"{type(value).__name__}")
    if length is not None and len(value) != length:
        raise NegativesFileError(f"{where} must hold {length} strings, got {len(value)}")
    if not value:
        raise NegativesFileError(f"{where} must not be empty")
    return tuple(_check_str(v, f"{where}[{i}]") for i, v in enumerate(value))


def _parse_record(obj: Any, where: str, num_negatives: int | None) -> NegativeRecord:
    if not isinstance(obj, dict):
        raise NegativesFileError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key in ("img1", "img2", "sentences", "neg_samples"):
        if key not in obj:
            raise NegativesFileError(f"{where}: missing key {key!r} (expected img1, img2, "
                                     "sentences, neg_samples)")
    img1 = _check_str(obj["img1"], f"{where}: 'img1'")
    img2 = _check_str(obj["img2"], f"{where}: 'img2'")
    sentences = obj["sentences"]
    if isinstance(sentences, str):  # IDC's train files hold one sentence as a string
        sentences = [sentences]
    sentences = _check_str_list(sentences, f"{where}: 'sentences'", None)
    negatives = _check_str_list(obj["neg_samples"], f"{where}: 'neg_samples'", num_negatives)
    kinds = None
    if "neg_kinds" in obj:
        kinds = _check_str_list(obj["neg_kinds"], f"{where}: 'neg_kinds'", len(negatives))
    fields = img2.split("_", 2)
    named = len(fields) == 3 and fields[1] in ("semantic", "nonsemantic")
    image_id = fields[2] if named else f"{img1}_{img2}"
    if "image_id" in obj:
        image_id = _check_str(obj["image_id"], f"{where}: 'image_id'")
    return NegativeRecord(img1, img2, sentences, negatives, image_id,
                          fields[1] == "semantic" if named else None, kinds)


def load_negatives(
    path: str | os.PathLike, *, num_negatives: int | None = NUM_NEGATIVES
) -> list[NegativeRecord]:
    """Reads a ``*_neg_tfidf6.json`` file: ours or the authors' (JSON lines; a JSON array of
    the same objects is accepted too). Every record needs ``img1``, ``img2`` (strings),
    ``sentences`` (a string or a list of strings) and ``neg_samples`` (``num_negatives``
    strings; None: any number >= 1). Errors name the file, the line and the key."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"hard-negatives file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    items: list[tuple[str, Any]] = []
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise NegativesFileError(f"{path}: not valid JSON: {e}") from e
        items = [(f"{path}: record {i}", obj) for i, obj in enumerate(data)]
    else:
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                items.append((f"{path}: line {n}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise NegativesFileError(f"{path}: line {n}: not valid JSON: {e}") from e
    if not items:
        raise NegativesFileError(f"{path}: holds no records")
    records, seen = [], {}
    for where, obj in items:
        rec = _parse_record(obj, where, num_negatives)
        pair = (rec.img1, rec.img2)
        if pair in seen:
            raise NegativesFileError(f"{where}: pair img1={rec.img1!r} img2={rec.img2!r} "
                                     f"repeats {seen[pair]}")
        seen[pair] = where
        records.append(rec)
    return records


def negatives_by_pair(
    records: Iterable[NegativeRecord],
) -> dict[tuple[str, bool | None], tuple[str, ...]]:
    """(image_id, semantic) -> negatives, the lookup a data pipeline needs."""
    out: dict[tuple[str, bool | None], tuple[str, ...]] = {}
    for rec in records:
        key = (rec.image_id, rec.semantic)
        if key in out:
            raise NegativesFileError(f"two records for image_id {rec.image_id!r} "
                                     f"(semantic={rec.semantic})")
        out[key] = rec.negatives
    return out
