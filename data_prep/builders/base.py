"""What every real-dataset builder shares: raw annotations -> features -> ArrayRecord.

A dataset module reads its official raw layout into :class:`Annotations` (one
:class:`PairSpec` per record, per split) and states its rules (tokeniser, vocabulary,
default ResNet layer, evaluation protocol). :class:`PairDatasetBuilder` does the rest:

1. checks that every image a record names exists (or, where the dataset tolerates it, skips
   and counts the record);
2. builds the vocabulary by the dataset's rule and encodes the captions, padded to the
   longest caption over all splits (the official ``L_h5``) unless a maximum is set;
3. takes the features from per-image ``.npy`` files (``features_dir``, the official
   ``<image file name>.npy`` of shape (C, H, W)) or extracts them with ResNet-101 while the
   records are written (``weights``);
4. writes ``vocab.json``, ``meta.json``, ``files.json`` and the records, inside TFDS's
   temporary directory, renamed into place only when everything succeeded.

The variant (TFDS builder config) names the features: ``layer3`` (1024 x 14 x 14) or
``layer4`` (2048 x 7 x 7), with ``_fp16`` / ``_bf16`` when stored as float16 / bfloat16 (half
the bytes of float32; ``schema.FEATURE_DTYPES``), ``_stdfix`` when extracted with the corrected
blue std and ``_len<N>`` when captions were capped at N tokens.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from changecap_jax import console
from changecap_jax.data import schema
from changecap_jax.data.vocab import CaptionError, Vocabulary, log_unknown_words
from changecap_jax.io.jsonio import read_json

SPLITS = ("train", "val", "test")
FEATURE_SHAPES = {3: (1024, 14, 14), 4: (2048, 7, 7)}  # (C, H, W), as the official .npy
IMAGE_KEYS = ("before", "after_semantic", "after_distractor")
DTYPE_SUFFIXES = {"float32": "", "float16": "_fp16", "bfloat16": "_bf16"}  # variant name part


class BuildError(ValueError):
    """Raw files that do not match the official layout or schema; names file, key, values."""


@dataclasses.dataclass
class PairSpec:
    """One record to write, as read from the raw annotations.

    ``images`` maps record keys (``before``, ``after_semantic`` and, with distractors,
    ``after_distractor``) to image paths relative to the raw directory. ``change_captions``
    are the training targets (tokenised into ``change_caption_ids``); ``references``, when
    the evaluation references differ from them (Spot-the-Diff keeps its empty sentences as
    the official reference file does), are stored as the record's ``change_captions``.
    """

    id: int
    image_id: str
    images: dict[str, str]
    change_captions: list[str]
    no_change_captions: list[str] | None = None
    change_type: int = -1
    references: list[str] | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Annotations:
    """A dataset's raw annotations: the records of each split, what was left out, and the
    (H, W) image size the records' boxes are measured in (None: no boxes)."""

    splits: dict[str, list[PairSpec]]
    change_types: list[str] = dataclasses.field(default_factory=list)
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)
    image_size: tuple[int, int] | None = None

    def all_specs(self) -> Iterator[PairSpec]:
        for split in self.splits.values():
            yield from split


def load_json(path: Path, what: str) -> object:
    """A JSON file's content; a missing or unparsable file is a :class:`BuildError` naming
    ``what`` ("split file") and the path."""
    if not path.is_file():
        raise BuildError(f"missing {what}: {path}")
    try:
        return read_json(path, what)
    except ValueError as e:
        raise BuildError(str(e)) from e


def find_annotation_dir(raw_dir: Path, subdirs: Sequence[str], names: Sequence[str],
                        dataset: str) -> Path:
    """The first of ``raw_dir / sub`` (``subdirs`` in order) holding one of the split files
    ``<name>.json``; the error names every folder looked in."""
    for sub in subdirs:
        candidate = raw_dir / sub
        if any((candidate / f"{name}.json").is_file() for name in names):
            return candidate
    looked = ", ".join(str(raw_dir / sub) for sub in subdirs)
    raise BuildError(f"missing {dataset} annotation files {{{','.join(names)}}}.json: none "
                     f"in {looked}")


def read_entry_list(path: Path, what: str, keys: Sequence[str],
                    described: str) -> list[dict[str, Any]]:
    """A JSON annotation file that holds a list of objects, each with every key of ``keys``;
    ``what`` names the file in errors ("Spot-the-Diff annotation file"), ``described`` the
    entries ("{'img_id', 'sentences'}"). Errors name the file, the entry and the key."""
    if not path.is_file():
        raise BuildError(f"missing {what} {path}")
    try:
        data = read_json(path, what)
    except ValueError as e:
        raise BuildError(str(e)) from e
    if not isinstance(data, list):
        raise BuildError(f"{path}: expected a list of {described} entries, found "
                         f"{type(data).__name__}")
    for i, entry in enumerate(data):
        if not isinstance(entry, dict):
            raise BuildError(f"{path}: entry {i}: expected an object, found "
                             f"{type(entry).__name__}")
        for key in keys:
            if key not in entry:
                raise BuildError(f"{path}: entry {i}: missing key {key!r} (found keys "
                                 f"{sorted(entry)})")
    return data


def skip(skipped: dict[str, int], reason: str, n: int = 1) -> None:
    skipped[reason] = skipped.get(reason, 0) + n


@dataclasses.dataclass(eq=False)
class PairsConfig(tfds.core.BuilderConfig):
    """The stored variant: which features, in which dtype, captions capped or not."""

    layer: int = 3
    feature_dtype: str = "float32"
    std_fix: bool = False
    max_caption_len: int = 0  # 0: the longest caption (official rule)


def make_config(layer: int = 3, feature_dtype: str = "float32", std_fix: bool = False,
                max_caption_len: int = 0) -> PairsConfig:
    if layer not in FEATURE_SHAPES:
        raise ValueError(f"layer must be 3 or 4, got {layer}")
    schema.feature_dtype(feature_dtype)  # a known name, else the error lists them
    name = f"layer{layer}" + DTYPE_SUFFIXES[feature_dtype]
    if std_fix:
        name += "_stdfix"
    if max_caption_len:
        name += f"_len{max_caption_len}"
    return PairsConfig(name=name, description=f"ResNet-101 layer{layer} features, {feature_dtype}",
                       layer=layer, feature_dtype=feature_dtype, std_fix=std_fix,
                       max_caption_len=max_caption_len)


def find_feature_file(features_dir: Path, image_rel: str, subdir_map: dict[str, str],
                      names: Sequence[str] = ()) -> Path | None:
    """The ``.npy`` of one image: ``<features_dir>/<feature subdir>/<name>.npy`` (the official
    layout, e.g. ``images/`` -> ``features/``), the image's own sub-path, or flat; for each of
    ``names`` (default: the image's file name) in turn."""
    rel = Path(image_rel)
    parent = rel.parent.as_posix()
    folders = []
    if parent in subdir_map:
        folders.append(features_dir / subdir_map[parent])
    if parent not in ("", "."):
        folders.append(features_dir / rel.parent)
    folders.append(features_dir)
    for name in names or (rel.name,):
        for folder in folders:
            if (folder / f"{name}.npy").exists():
                return folder / f"{name}.npy"
    return None


def load_feature_file(path: Path, expected_chw: tuple[int, int, int]) -> np.ndarray:
    """A (C, H, W) float32 .npy -> (H, W, C); errors name the file and both shapes."""
    try:
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise BuildError(f"feature file {path} cannot be read as .npy: {e}") from e
    if tuple(array.shape) != tuple(expected_chw):
        raise BuildError(f"feature file {path} has shape {tuple(array.shape)}, expected "
                         f"{tuple(expected_chw)} (C, H, W)")
    if not np.issubdtype(array.dtype, np.floating):
        raise BuildError(f"feature file {path} has dtype {array.dtype}, expected float")
    return np.ascontiguousarray(np.transpose(array, (1, 2, 0)))


class PairDatasetBuilder(schema.RecordBuilder, skip_registration=True):
    """Base of the real datasets' TFDS builders. Subclasses set the class attributes and
    implement :meth:`read_annotations`.

    Constructor arguments beside TFDS's (only needed to build, not to read):
      raw_dir: the dataset's raw download, in the official layout.
      features_dir: per-image ``.npy`` features (official naming); else ``weights`` is used.
      weights: a local torchvision ResNet-101 state dict, to extract the features.
      batch_size, device, resize_flavour: of the extraction (``data_prep.extract_features``).
    """

    VERSION = tfds.core.Version("1.1.0")
    RELEASE_NOTES = {
        "1.0.0": "First release.",
        "1.1.0": "Half-precision features stored as 2-byte values (1.0.0 widened float16 to "
                 "4-byte floats); bfloat16; meta.json records feature_dtype.",
    }
    BUILDER_CONFIGS = [make_config(3), make_config(4)]
    DEFAULT_CONFIG_NAME = "layer3"

    DEFAULT_LAYER = 3  # the ResNet-101 cut the dataset's papers use
    HAS_DISTRACTOR = False
    TOKENIZER = "clevr"
    VOCAB_SPLITS: tuple[str, ...] = ("train",)  # captions the vocabulary is built from
    VOCAB_MIN_COUNT = 1
    VOCAB_ORDER = "sorted"
    # Official caption cap (IER: 40 with a forced <END>); 0: the longest caption.
    DEFAULT_MAX_CAPTION_LEN = 0
    MAIN_METRICS: tuple[str, ...] = ("CIDEr",)
    PROTOCOL = ""
    # image sub-directory -> the official feature sub-directory (features_dir lookup)
    FEATURE_SUBDIRS: dict[str, str] = {}

    def __init__(
        self,
        *,
        raw_dir: str | os.PathLike | None = None,
        features_dir: str | os.PathLike | None = None,
        weights: str | os.PathLike | None = None,
        batch_size: int = 64,
        device: str | None = None,
        resize_flavour: str = "opencv",
        progress: bool = True,
        **kwargs: Any,
    ):
        self.raw_dir = Path(raw_dir) if raw_dir else None
        self.features_dir = Path(features_dir) if features_dir else None
        self.weights = weights
        self.batch_size = batch_size
        self.device = device
        self.resize_flavour = resize_flavour
        self.progress = progress
        super().__init__(**kwargs)

    # -- to implement ---------------------------------------------------------------------

    def read_annotations(self, raw_dir: Path) -> Annotations:
        """Reads and validates the raw annotations (raise :class:`BuildError`)."""
        raise NotImplementedError

    def extra_features(self) -> dict[str, tfds.features.FeatureConnector]:
        """TFDS features of the dataset's own record fields (``PairSpec.extra``)."""
        return {}

    def has_boxes(self) -> bool:
        """Whether the records carry ``bbox_before`` / ``bbox_after`` (schema.py); decided
        before the annotations are read (the features spec is made first)."""
        return False

    def has_viewpoint_iou(self) -> bool:
        """Whether the records carry ``viewpoint_iou_*`` (schema.py); as :meth:`has_boxes`."""
        return False

    def feature_names(self, image_rel: str) -> list[str]:
        """Image file names whose ``<name>.npy`` may hold an image's features, in order of
        preference (a dataset whose official features were named after renamed images adds
        those names)."""
        return [Path(image_rel).name]

    # -- TFDS -----------------------------------------------------------------------------

    def build_detail(self) -> str:
        source = f"features {self.features_dir}" if self.features_dir else "ResNet-101 extraction"
        return f"from {self.raw_dir}, {source}"

    @property
    def feature_chw(self) -> tuple[int, int, int]:
        """(C, H, W) of one image's features, as the per-image ``.npy`` files hold them: the
        ResNet-101 cut of the variant (a builder with features of its own overrides this)."""
        return FEATURE_SHAPES[self.builder_config.layer]

    @property
    def extractor_name(self) -> str:
        """What made the features (``meta.json``'s ``extractor``; ``predict`` extracts new
        images the same way when it knows the name)."""
        cfg: PairsConfig = self.builder_config
        return f"resnet101_layer{cfg.layer}" + ("_stdfix" if cfg.std_fix else "")

    @property
    def feature_shape(self) -> tuple[int, int, int]:
        c, h, w = self.feature_chw
        return (h, w, c)

    def _info(self) -> tfds.core.DatasetInfo:
        cfg: PairsConfig = self.builder_config
        return tfds.core.DatasetInfo(
            builder=self,
            description=self.__doc__,
            features=schema.features(
                self.feature_shape, None, with_distractor=self.HAS_DISTRACTOR,
                with_boxes=self.has_boxes(), with_viewpoint_iou=self.has_viewpoint_iou(),
                feature_dtype=schema.feature_dtype(cfg.feature_dtype),
                extra=self.extra_features(),
            ),
            disable_shuffling=True,  # records in annotation order, deterministic
        )

    def _split_generators(self, dl_manager: Any) -> dict[str, Iterator]:
        cfg: PairsConfig = self.builder_config
        if self.raw_dir is None:
            raise BuildError(f"building {self.name} needs raw_dir (the raw download)")
        if not self.raw_dir.is_dir():
            raise BuildError(f"raw_dir {self.raw_dir} is not a directory")
        if self.features_dir is None and self.weights is None:
            raise BuildError("give features_dir (per-image .npy features) or weights (a "
                             "torchvision ResNet-101 state dict to extract them)")
        if self.features_dir is not None and not self.features_dir.is_dir():
            raise BuildError(f"features_dir {self.features_dir} is not a directory")
        ann = self.read_annotations(self.raw_dir)
        ann = self._drop_missing_images(ann)
        for spec in ann.all_specs():
            for c in [*spec.change_captions, *(spec.no_change_captions or [])]:
                schema.check_caption(c, f"{self.name} record {spec.image_id}")
        vocab = Vocabulary.build(
            [c for s in self.VOCAB_SPLITS for spec in ann.splits.get(s, [])
             for c in [*spec.change_captions, *(spec.no_change_captions or [])]],
            self.TOKENIZER, min_count=self.VOCAB_MIN_COUNT, order=self.VOCAB_ORDER)
        longest = max(len(vocab.tokenize(c)) for spec in ann.all_specs()
                      for c in [*spec.change_captions, *(spec.no_change_captions or [])])
        max_len = cfg.max_caption_len or self.DEFAULT_MAX_CAPTION_LEN or longest
        if longest > max_len:
            cut = sum(len(vocab.tokenize(c)) > max_len for spec in ann.all_specs()
                      for c in [*spec.change_captions, *(spec.no_change_captions or [])])
            logging.warning("%s: %d caption(s) longer than %d tokens are cut, with a final "
                            "<END>", self.name, cut, max_len)
        data_dir = Path(self.data_dir)  # TFDS's temporary directory during the build
        vocab.save(data_dir / schema.VOCAB_FILE)
        c, h, w = self.feature_chw
        schema.DatasetMeta(
            feature_shape=(h, w, c), max_caption_len=max_len,
            change_types=list(ann.change_types), has_distractor=self.HAS_DISTRACTOR,
            raw_dir=str(self.raw_dir.resolve()),
            extractor=self.extractor_name,
            split_sizes={k: len(v) for k, v in ann.splits.items()},
            tokenizer=self.TOKENIZER, main_metrics=list(self.MAIN_METRICS),
            protocol=self.PROTOCOL, skipped=dict(ann.skipped), feature_dtype=cfg.feature_dtype,
            image_size=ann.image_size,
        ).save(data_dir / schema.META_FILE)
        for reason, n in sorted(ann.skipped.items()):
            logging.warning("%s: skipped %d: %s", self.name, n, reason)
        self._vocab, self._max_len = vocab, max_len
        self._features = self._feature_loader()
        return {name: self._generate_examples(specs, name)
                for name, specs in ann.splits.items()}

    def _drop_missing_images(self, ann: Annotations) -> Annotations:
        """Every image a record names must exist; datasets that tolerate gaps override."""
        for spec in ann.all_specs():
            for key, rel in spec.images.items():
                if not (self.raw_dir / rel).is_file():
                    raise BuildError(
                        f"{self.name}: record {spec.image_id!r} needs image {key!r} at "
                        f"{self.raw_dir / rel}, which does not exist")
        return ann

    def _feature_loader(self) -> Callable[[list[str]], dict[str, np.ndarray]]:
        """image paths (relative) -> (H, W, C) features, by file or by extraction."""
        cfg: PairsConfig = self.builder_config
        chw = self.feature_chw
        if self.features_dir is not None:
            def from_files(rels: list[str]) -> dict[str, np.ndarray]:
                out = {}
                for rel in rels:
                    names = self.feature_names(rel)
                    path = find_feature_file(self.features_dir, rel, self.FEATURE_SUBDIRS,
                                             names)
                    if path is None:
                        raise BuildError(
                            f"no feature file for image {rel} under {self.features_dir} "
                            f"(looked for {' or '.join(n + '.npy' for n in names)} in "
                            f"{self.FEATURE_SUBDIRS.get(Path(rel).parent.as_posix(), '')!r}, "
                            f"{Path(rel).parent.as_posix()!r} and the top level)")
                    out[rel] = load_feature_file(path, chw)
                return out
            return from_files

        # Extraction: torch is imported only here, so reading datasets never needs it.
        from changecap_jax.features.extract import extract_features, pick_device
        from changecap_jax.features.resnet import load_resnet101

        model = load_resnet101(self.weights, cfg.layer, device=pick_device(self.device))

        def extracted(rels: list[str]) -> dict[str, np.ndarray]:
            paths = [self.raw_dir / r for r in rels]
            feats = extract_features(paths, model, cfg.layer, self.batch_size,
                                     std_fix=cfg.std_fix, resize_flavour=self.resize_flavour)
            return {r: np.ascontiguousarray(np.transpose(f, (1, 2, 0)))
                    for r, (_, f) in zip(rels, feats, strict=True)}
        return extracted

    def _generate_examples(
        self, specs: Sequence[PairSpec], split: str
    ) -> Iterator[tuple[int, dict[str, Any]]]:
        cfg: PairsConfig = self.builder_config
        dtype = np.dtype(schema.feature_dtype(cfg.feature_dtype))
        # Unknown words: an error in the vocabulary's own splits when every word is kept
        # (official allow_unk=0); otherwise (other splits, or a count threshold that drops
        # rare words) they become <UNK> and are counted.
        unknown: dict[str, int] = {}
        chunk = max(1, self.batch_size)
        with console.Progress(total=len(specs), desc=f"{self.name} {split}", unit="record",
                              disable=not self.progress) as bar:
            for start in range(0, len(specs), chunk):
                batch = specs[start:start + chunk]
                rels = list(dict.fromkeys(r for s in batch for r in s.images.values()))
                features = self._features(rels)
                for n, spec in enumerate(batch, start):
                    # Keyed by position: TFDS writes unshuffled records sorted by key, and the
                    # split keeps the annotation files' order.
                    yield n, self._record(spec, features, dtype, split, unknown)
                bar.update(len(batch))
        if unknown:
            log_unknown_words(unknown, f"{self.name} {split} split")

    def _record(self, spec: PairSpec, features: dict[str, np.ndarray], dtype: np.dtype,
                split: str, unknown: dict[str, int]) -> dict[str, Any]:
        where = f"{self.name} {split} record {spec.image_id!r}"
        record: dict[str, Any] = {
            "id": spec.id,
            "image_id": spec.image_id,
            "change_type": spec.change_type,
            "change_captions": np.array(
                spec.change_captions if spec.references is None else spec.references,
                dtype=object),
            "change_caption_ids": self._encode(spec.change_captions, where, split, unknown),
        }
        for key, rel in spec.images.items():
            record[key] = features[rel].astype(dtype)
        if self.HAS_DISTRACTOR:
            record["no_change_captions"] = np.array(spec.no_change_captions, dtype=object)
            record["no_change_caption_ids"] = self._encode(
                spec.no_change_captions, where, split, unknown)
        record.update(spec.extra)
        schema.check_record(record, self.feature_shape, self._max_len, where)
        return record

    def _encode(self, captions: Sequence[str], where: str, split: str,
                unknown: dict[str, int]) -> np.ndarray:
        try:
            return self._vocab.encode_many(
                captions, self._max_len,
                allow_unk=split not in self.VOCAB_SPLITS or self.VOCAB_MIN_COUNT > 1,
                unknown_counter=unknown,
                truncate=True)  # only captions beyond an explicit cap are long
        except CaptionError as e:
            raise CaptionError(f"{where}: {e}") from e
