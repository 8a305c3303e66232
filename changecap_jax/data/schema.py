"""The record schema every dataset of the trunk is stored in, and its dataset metadata.

A record is one example: a "before" feature grid, a semantic "after" (the pair whose change
the change captions describe) and, where the dataset has one, a distractor "after" with its
no-change captions (CLEVR-Change style). Keys:

=========================  =====================  ==========================================
key                        shape / dtype          meaning
=========================  =====================  ==========================================
id                         () int32               example number (file number in the raw data)
image_id                   () string              evaluation id, e.g. "000123.png"
before                     (H, W, C) float*       grid features of the before image (the
                                                  dataset's FEATURE_DTYPES entry)
after_semantic             (H, W, C) float*       after image with the semantic change
after_distractor           (H, W, C) float*       after image with distractors only (optional)
change_captions            (N,) string            reference captions of the semantic pair
change_caption_ids         (N, L) int32           training targets, tokenised, zero-padded
                                                  (the same captions, except where a
                                                  dataset's references hold unusable ones)
no_change_captions         (M,) string            captions of the distractor pair (optional)
no_change_caption_ids      (M, L) int32           (optional)
change_type                () int32               index into DatasetMeta.change_types, -1 none
bbox_before, bbox_after    (4,) float32           changed object's [x, y, w, h] px (optional;
                                                  all -1: no such object in that image)
viewpoint_iou_semantic     () float32             how far the camera moved between before and
                                                  after_semantic: the mean IoU of the same
                                                  objects' boxes in the two images (lower:
                                                  larger change); NaN unknown (optional,
                                                  ``changecap_jax/evaluators/difficulty.py``)
viewpoint_iou_distractor   () float32             the same for after_distractor (optional)
=========================  =====================  ==========================================

Datasets may add fields of their own (e.g. Spot-the-Diff's ``annotation_index``, the
annotator entry each reference sentence came from). The synthetic dataset stores float16
features and captions padded to a fixed length; the real datasets store the float32
features of the original extraction by default and declare the caption length of the
``*_caption_ids`` fields as variable (every record is still padded to
``DatasetMeta.max_caption_len``, which is computed from the data by the official rule).

Feature grids are stored in one of :data:`FEATURE_DTYPES` (``DatasetMeta.feature_dtype``).
Half precision (float16, bfloat16) is written as raw little-endian bytes, 2 per value: TFDS's
default encoding would widen float16 to a 4-byte float list (as many bytes as float32) and
cannot hold bfloat16 at all. Readers get the stored dtype; the train step and the decoding
cast to ``config.compute_dtype`` on the device (``changecap_jax/models/precision.py``), so the host
pipeline moves half the bytes.

Beside the records, each dataset directory holds ``vocab.json`` (official word -> id format),
``meta.json`` (:class:`DatasetMeta`) and ``files.json`` (size and sha256 of each record file,
so a truncated or replaced file is caught when the dataset is opened).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import tensorflow_datasets as tfds
from tensorflow_datasets.core import writer as writer_lib
from tensorflow_datasets.proto import tf_example_pb2

from changecap_jax.data.vocab import CaptionError
from changecap_jax.io.jsonio import read_json, write_json_atomic

VOCAB_FILE = "vocab.json"
META_FILE = "meta.json"
FILES_FILE = "files.json"  # size and sha256 of every record file, written at build time
# Stored feature dtypes, by name (builder options, meta.json) -> numpy type.
FEATURE_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def feature_dtype(name: str, where: str = "feature_dtype") -> type:
    """The numpy type of a stored-feature dtype name; errors name the option and the choices."""
    if name not in FEATURE_DTYPES:
        raise ValueError(f"{where} must be one of {sorted(FEATURE_DTYPES)}, got {name!r}")
    return FEATURE_DTYPES[name]


def features(
    feature_shape: tuple[int, int, int], max_caption_len: int | None, *, with_distractor: bool,
    with_boxes: bool = False, with_viewpoint_iou: bool = False,
    feature_dtype: type = np.float16,
    extra: dict[str, tfds.features.FeatureConnector] | None = None,
) -> tfds.features.FeaturesDict:
    """The TFDS features of the record schema above (``max_caption_len`` None: variable)."""
    # float32 keeps TFDS's float-list encoding, so datasets built before half precision was
    # stored compactly keep their format; half precision goes as raw bytes (docstring above).
    grid_encoding = "none" if np.dtype(feature_dtype) == np.float32 else "bytes"
    grid = lambda: tfds.features.Tensor(  # noqa: E731
        shape=tuple(feature_shape), dtype=feature_dtype, encoding=grid_encoding)
    ids_encoding = "none" if max_caption_len else "zlib"  # TFDS needs one for 2 unknown dims
    spec = {
        "id": tfds.features.Scalar(dtype=np.int32),
        "image_id": tfds.features.Tensor(shape=(), dtype=np.object_),
        "before": grid(),
        "after_semantic": grid(),
        "change_captions": tfds.features.Tensor(shape=(None,), dtype=np.object_),
        "change_caption_ids": tfds.features.Tensor(
            shape=(None, max_caption_len), dtype=np.int32, encoding=ids_encoding),
        "change_type": tfds.features.Scalar(dtype=np.int32),
    }
    if with_distractor:
        spec["after_distractor"] = grid()
        spec["no_change_captions"] = tfds.features.Tensor(shape=(None,), dtype=np.object_)
        spec["no_change_caption_ids"] = tfds.features.Tensor(
            shape=(None, max_caption_len), dtype=np.int32, encoding=ids_encoding
        )
    if with_boxes:
        spec["bbox_before"] = tfds.features.Tensor(shape=(4,), dtype=np.float32)
        spec["bbox_after"] = tfds.features.Tensor(shape=(4,), dtype=np.float32)
    if with_viewpoint_iou:
        for stream in ("semantic", "distractor") if with_distractor else ("semantic",):
            spec[f"viewpoint_iou_{stream}"] = tfds.features.Scalar(dtype=np.float32)
    spec.update(extra or {})
    return tfds.features.FeaturesDict(spec)


@dataclasses.dataclass
class DatasetMeta:
    """What the trainer needs to know about a built dataset (``meta.json``)."""

    feature_shape: tuple[int, int, int]
    max_caption_len: int
    change_types: list[str]
    has_distractor: bool
    image_size: tuple[int, int] | None = None
    raw_dir: str | None = None  # relative to the dataset directory, where images were kept
    extractor: str = ""  # "synthetic_grid[_v2]" or "resnet101_layer3" / "resnet101_layer4"
    seed: int | None = None
    split_sizes: dict[str, int] = dataclasses.field(default_factory=dict)
    tokenizer: str = "clevr"  # a name in changecap_jax.data.vocab.TOKENIZERS
    # Metrics the dataset's papers rank by, named as in evaluation.score_captions.
    main_metrics: list[str] = dataclasses.field(default_factory=lambda: ["CIDEr"])
    # Evaluation protocol in words (which pairs, which references), shown with the table.
    protocol: str = ""
    # What the build left out, reason -> count (e.g. ids in no split, missing images).
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)
    # Stored dtype of the feature grids (a FEATURE_DTYPES name); "" in datasets built before
    # it was recorded, where datasets.prepare fills it in from the record spec.
    feature_dtype: str = ""

    def save(self, path: str | os.PathLike) -> None:
        write_json_atomic(path, dataclasses.asdict(self), indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike) -> DatasetMeta:
        data = read_json(path, "dataset metadata")
        try:
            meta = cls(**data)
        except TypeError as e:
            raise ValueError(f"dataset metadata {path} is malformed: {e}") from e
        meta.feature_shape = tuple(meta.feature_shape)
        if meta.image_size is not None:
            meta.image_size = tuple(meta.image_size)
        return meta


def check_caption(caption: object, where: str) -> None:
    """A caption must be a non-empty string with at least one word."""
    if not isinstance(caption, str) or not caption.strip():
        raise CaptionError(f"{where}: empty caption {caption!r}; every caption needs words")


def check_record(
    record: dict, feature_shape: tuple[int, int, int], max_caption_len: int, where: str
) -> None:
    """Validates one record against the schema before it is written; errors name the key."""
    for key in ("before", "after_semantic", "after_distractor"):
        if key not in record:
            continue
        shape = tuple(np.shape(record[key]))
        if shape != tuple(feature_shape):
            raise ValueError(
                f"{where}: feature {key!r} has shape {shape}, expected {tuple(feature_shape)}"
            )
    for key in ("change_caption_ids", "no_change_caption_ids"):
        if key not in record:
            continue
        ids = np.asarray(record[key])
        if ids.ndim != 2 or ids.shape[1] != max_caption_len or ids.shape[0] == 0:
            raise ValueError(
                f"{where}: {key!r} has shape {ids.shape}, expected (N >= 1, {max_caption_len})"
            )


def record_files(directory: str | os.PathLike) -> list[Path]:
    return sorted(Path(directory).glob("*.array_record-*"))


def split_bytes(directory: str | os.PathLike, split: str) -> dict[str, int]:
    """Sizes of one split's record files: ``records``, ``record_bytes`` (serialized records,
    the bytes a reader decodes) and ``file_bytes`` (on disk; array_record compresses each
    record, so this depends on how compressible the features are). Reads every record."""
    from array_record.python.array_record_module import ArrayRecordReader

    files = sorted(Path(directory).glob(f"*-{split}.array_record-*"))
    if not files:
        raise FileNotFoundError(f"no record files of split {split!r} in {directory}")
    out = {"records": 0, "record_bytes": 0, "file_bytes": 0}
    for path in files:
        reader = ArrayRecordReader(str(path))
        try:
            records = reader.read_all()
        finally:
            reader.close()
        out["records"] += len(records)
        out["record_bytes"] += sum(len(r) for r in records)
        out["file_bytes"] += path.stat().st_size
    return out


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def canonical_record(serialized: bytes) -> bytes:
    """A serialized ``tf.train.Example`` re-serialized with its feature map in key order.

    protobuf writes map entries in hash-table order, and its hash seed differs between
    processes: the same record gave different bytes in every build (equal once decoded)."""
    return tf_example_pb2.Example.FromString(serialized).SerializeToString(deterministic=True)


class DeterministicExampleWriter(writer_lib.ExampleWriter):
    """TFDS's example writer, fed :func:`canonical_record` bytes: the same examples give
    byte-identical record files in every process."""

    def write(self, path: Any, examples: Iterable[tuple[Any, bytes]]) -> Any:
        return super().write(path, ((key, canonical_record(ex)) for key, ex in examples))


class RecordBuilder(tfds.core.GeneratorBasedBuilder):
    """Base of the trunk's builders: deterministic record bytes, ``files.json`` written before
    the atomic rename, and no TFDS download banner (``datasets.build`` logs its own line)."""

    def build_detail(self) -> str:
        """What the build reads or makes, for the build's log line (e.g. "62 examples")."""
        return ""

    def _example_writer(self) -> writer_lib.ExampleWriter:
        return DeterministicExampleWriter(self.info.file_format)

    def _log_download_bytes(self) -> None:
        # TFDS prints "Downloading and preparing dataset Unknown size ...": nothing is
        # downloaded and the size is known to nobody; datasets.build says what it builds.
        pass

    def _log_download_done(self) -> None:
        pass  # "downloaded and prepared": datasets.build logs "built ... in N s"

    def _download_and_prepare(self, dl_manager, download_config):  # noqa: ANN001
        super()._download_and_prepare(dl_manager, download_config)
        files = {p.name: {"bytes": p.stat().st_size, "sha256": file_digest(p)}
                 for p in record_files(self.data_dir)}
        (Path(self.data_dir) / FILES_FILE).write_text(json.dumps(files, indent=1))
