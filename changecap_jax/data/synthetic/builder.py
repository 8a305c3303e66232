"""TFDS builder of the synthetic change dataset (ArrayRecord).

One record per example id, in the common record schema of ``changecap_jax.data.schema``:
the grid features of the before, semantic-after and distractor-after images, the change and
no-change captions (text and ids), the change type and the changed object's boxes.

Beside the records, in the dataset directory, the builder writes:

* ``vocab.json`` (official word -> id format, from the train captions) and ``meta.json``;
* ``raw/``: the rendered images and annotations in the CLEVR-Change layout (``images/``,
  ``sc_images/``, ``nsc_images/``, ``change_captions.json``, ``no_change_captions.json``,
  ``splits.json``, ``type_mapping.json``), so a person can
  look at them and the ResNet-101 path of ``data_prep`` can re-extract features from them.

Everything is written inside TFDS's temporary ``incomplete.*`` directory and renamed into place
only when the whole build succeeded: Ctrl-C or an error removes it (the render workers are
stopped first), and the next build removes that of a killed one (``data/building.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow_datasets as tfds
from PIL import Image

from changecap_jax.data import schema
from changecap_jax.data.boxes import mean_box_iou
from changecap_jax.data.synthetic import scenes
from changecap_jax.data.synthetic.examples import (
    DEFAULT_FEATURE_DTYPE,
    DEFAULT_FEATURE_SHAPE,
    DEFAULT_IMAGE_SIZE,
    DEFAULT_MAX_CAPTION_LEN,
    DEFAULT_SIZES,
    GRID_EXTRACTOR_VERSION,
    change_type_of,
    example_rng,
    render_views,
)
from changecap_jax.data.vocab import (
    CaptionError,
    Vocabulary,
    log_unknown_words,
    max_caption_length,
)
from changecap_jax.features import grid as grid_features

# Config name part of a non-default feature dtype.
DTYPE_SUFFIXES = {"float32": "_fp32", "float16": "", "bfloat16": "_bf16"}


@dataclasses.dataclass(eq=False)
class SyntheticChangeConfig(tfds.core.BuilderConfig):
    """Builder config: distractor strength, seed, split sizes and shapes."""

    distractors: str = "moderate"
    seed: int = 0
    num_train: int = DEFAULT_SIZES["train"]
    num_val: int = DEFAULT_SIZES["val"]
    num_test: int = DEFAULT_SIZES["test"]
    image_size: tuple[int, int] = DEFAULT_IMAGE_SIZE
    feature_shape: tuple[int, int, int] = DEFAULT_FEATURE_SHAPE
    feature_dtype: str = DEFAULT_FEATURE_DTYPE  # a schema.FEATURE_DTYPES name
    captions_per_pair: int = 6
    max_caption_len: int = DEFAULT_MAX_CAPTION_LEN


def make_config(
    distractors: str = "moderate",
    seed: int = 0,
    num_train: int = DEFAULT_SIZES["train"],
    num_val: int = DEFAULT_SIZES["val"],
    num_test: int = DEFAULT_SIZES["test"],
    feature_shape: tuple[int, int, int] = DEFAULT_FEATURE_SHAPE,
    image_size: tuple[int, int] = DEFAULT_IMAGE_SIZE,
    feature_dtype: str = DEFAULT_FEATURE_DTYPE,
) -> SyntheticChangeConfig:
    """A config whose name spells out every non-default setting (one directory per variant)."""
    if distractors not in scenes.DISTRACTORS:
        raise ValueError(
            f"unknown distractor strength {distractors!r}; expected one of "
            f"{sorted(scenes.DISTRACTORS)}"
        )
    feature_shape = tuple(int(v) for v in feature_shape)
    image_size = tuple(int(v) for v in image_size)
    if len(feature_shape) != 3 or min(feature_shape) < 1:
        raise ValueError(f"feature_shape must be (H, W, C), positive sizes; got {feature_shape}")
    schema.feature_dtype(feature_dtype, "synthetic dataset option feature_dtype")
    if min(num_train, num_val, num_test) < 1:
        raise ValueError("every split needs at least one example")
    name = distractors
    if seed:
        name += f"_seed{seed}"
    sizes = (num_train, num_val, num_test)
    if sizes != tuple(DEFAULT_SIZES.values()):
        name += "_n{}-{}-{}".format(*sizes)
    if feature_shape != DEFAULT_FEATURE_SHAPE:
        name += "_f{}x{}x{}".format(*feature_shape)
    if image_size != DEFAULT_IMAGE_SIZE:
        name += "_img{}x{}".format(*image_size)
    name += DTYPE_SUFFIXES[feature_dtype]
    return SyntheticChangeConfig(
        name=name, description=f"synthetic change pairs, {distractors} distractors",
        distractors=distractors, seed=seed, num_train=num_train, num_val=num_val,
        num_test=num_test, feature_shape=feature_shape, image_size=image_size,
        feature_dtype=feature_dtype,
    )


def split_ids(config: SyntheticChangeConfig) -> dict[str, list[int]]:
    """Ids 0..N-1 shuffled into train/val/test (as CLEVR-Change's splits.json)."""
    n = config.num_train + config.num_val + config.num_test
    perm = np.random.default_rng([config.seed, 2**31 - 1]).permutation(n).tolist()
    return {
        "train": perm[: config.num_train],
        "val": perm[config.num_train : config.num_train + config.num_val],
        "test": perm[config.num_train + config.num_val :],
    }


def make_example(config: SyntheticChangeConfig, example_id: int) -> scenes.Example:
    return scenes.sample_example(
        example_rng(config.seed, example_id), change_type_of(example_id), config.distractors,
        config.captions_per_pair,
    )


IMAGE_DIRS = {  # record key -> (raw sub-directory, CLEVR-Change file prefix)
    "before": ("images", "CLEVR_default"),
    "after_semantic": ("sc_images", "CLEVR_semantic"),
    "after_distractor": ("nsc_images", "CLEVR_nonsemantic"),
}


def image_path(raw_dir: str | os.PathLike, key: str, example_id: int) -> Path:
    sub, prefix = IMAGE_DIRS[key]
    return Path(raw_dir) / sub / f"{prefix}_{example_id:06d}.png"


def _ignore_sigint() -> None:
    # Ctrl-C reaches the whole process group: the main process stops the pool; workers
    # that died of it on their own would be restarted by the pool and print tracebacks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def _render_pool(workers: int | None) -> Iterator[Any]:
    """A pool of render processes (None: one per core, at most 8), or None for 0 workers;
    terminated (and joined) on leaving, by an error or Ctrl-C too."""
    if workers is None:
        workers = max(1, min(os.cpu_count() or 1, 8))
    if not workers:
        yield None
        return
    # 'spawn': the caller may already run JAX threads, which must not be forked.
    with multiprocessing.get_context("spawn").Pool(workers, initializer=_ignore_sigint) as pool:
        yield pool


def _render_and_extract(job: tuple[SyntheticChangeConfig, int, str, int]) -> dict[str, Any]:
    """Worker: renders the three images of one example, saves them, extracts features (grid
    extractor ``extractor_version``)."""
    config, example_id, raw_dir, extractor_version = job
    ex = make_example(config, example_id)
    images, boxes = render_views(ex, config.image_size)
    for key, image in images.items():
        Image.fromarray(image).save(image_path(raw_dir, key, example_id), compress_level=6)
    feats = grid_features.extract(np.stack(list(images.values())), config.feature_shape,
                                  schema.feature_dtype(config.feature_dtype), extractor_version)
    out: dict[str, Any] = dict(zip(images, feats, strict=True))
    missing = np.full((4,), -1.0, np.float32)
    out["bbox_before"] = (np.asarray(boxes["before"][ex.changed_index_before], np.float32)
                          if ex.changed_index_before >= 0 else missing)
    out["bbox_after"] = (np.asarray(boxes["after_semantic"][ex.changed_index_after], np.float32)
                         if ex.changed_index_after >= 0 else missing)
    out["viewpoint_iou_semantic"] = np.float32(mean_box_iou(
        [(boxes["before"][i], boxes["after_semantic"][j]) for i, j in scenes.same_objects(ex)]))
    out["viewpoint_iou_distractor"] = np.float32(mean_box_iou(
        list(zip(boxes["before"], boxes["after_distractor"], strict=True))))
    return out


# Record fields measured on the rendered images, beside the feature grids.
RENDERED_FIELDS = ("bbox_before", "bbox_after", "viewpoint_iou_semantic",
                   "viewpoint_iou_distractor")


class SyntheticChange(schema.RecordBuilder):
    """CLEVR-Change-like synthetic pairs: semantic changes among viewpoint/light distractors."""

    VERSION = tfds.core.Version("2.0.0")
    # Older versions stay readable (TFDS builds only the newest).
    SUPPORTED_VERSIONS = [tfds.core.Version("1.3.0")]
    RELEASE_NOTES = {
        "1.0.0": "First release.",
        "1.1.0": "Grid features scaled to about unit RMS (grid_features.GAIN).",
        "1.2.0": "feature_dtype option (float32 / float16 / bfloat16); half precision stored "
                 "as 2-byte values (1.1.0 widened float16 to 4-byte floats).",
        "1.3.0": "viewpoint_iou_semantic / viewpoint_iou_distractor per record (the "
                 "difficulty-binned evaluation); every other field as in 1.2.0.",
        "2.0.0": "Grid extractor version 2 (features/grid.py: white balance, 2 x 2 sub-cells, "
                 "hue histogram and material cues), extractor name synthetic_grid_v2: the "
                 "default run captions colour and material changes. The 'weak' distractor "
                 "strength. Every other field as in 1.3.0.",
    }
    # Render processes; None: one per core (at most 8); 0: render in this process (debugging).
    num_workers: int | None = None
    BUILDER_CONFIGS = [make_config("moderate"), make_config("extreme")]
    DEFAULT_CONFIG_NAME = "moderate"

    def _info(self) -> tfds.core.DatasetInfo:
        cfg: SyntheticChangeConfig = self.builder_config
        return tfds.core.DatasetInfo(
            builder=self,
            description=__doc__,
            features=schema.features(
                cfg.feature_shape, cfg.max_caption_len, with_distractor=True, with_boxes=True,
                with_viewpoint_iou=True, feature_dtype=schema.feature_dtype(cfg.feature_dtype),
            ),
        )

    def _split_generators(self, dl_manager: Any) -> dict[str, Iterator]:
        cfg: SyntheticChangeConfig = self.builder_config
        data_dir = Path(self.data_dir)  # TFDS's temporary directory during the build
        raw_dir = data_dir / "raw"
        for sub, _ in IMAGE_DIRS.values():
            (raw_dir / sub).mkdir(parents=True, exist_ok=True)
        splits = split_ids(cfg)
        examples = {i: make_example(cfg, i) for ids in splits.values() for i in ids}
        for i, ex in examples.items():
            for caption in ex.change_captions + ex.no_change_captions:
                schema.check_caption(caption, f"synthetic example {i}")
        train_captions = [c for i in splits["train"] for c in
                          examples[i].change_captions + examples[i].no_change_captions]
        vocab = Vocabulary.build(train_captions)
        all_captions = [c for e in examples.values()
                        for c in e.change_captions + e.no_change_captions]
        longest = max_caption_length(all_captions)
        if longest > cfg.max_caption_len:
            raise ValueError(
                f"longest caption has {longest} tokens, more than max_caption_len="
                f"{cfg.max_caption_len}"
            )
        vocab.save(data_dir / schema.VOCAB_FILE)
        _write_raw_annotations(raw_dir, splits, examples)
        schema.DatasetMeta(
            feature_shape=cfg.feature_shape, max_caption_len=cfg.max_caption_len,
            change_types=list(scenes.CHANGE_TYPES), has_distractor=True,
            image_size=cfg.image_size, raw_dir="raw",
            extractor=grid_features.NAMES[self.extractor_version()],
            seed=cfg.seed, split_sizes={k: len(v) for k, v in splits.items()},
            feature_dtype=cfg.feature_dtype,
        ).save(data_dir / schema.META_FILE)
        self._examples, self._vocab, self._raw_dir = examples, vocab, raw_dir
        return {name: self._generate_examples(ids, name) for name, ids in splits.items()}

    def extractor_version(self) -> int:
        """The grid extractor of this builder version (features/grid.py)."""
        return 1 if self.version < "2.0.0" else GRID_EXTRACTOR_VERSION

    def build_detail(self) -> str:
        cfg: SyntheticChangeConfig = self.builder_config
        return f"{cfg.num_train + cfg.num_val + cfg.num_test} examples"

    def _download_and_prepare(self, dl_manager, download_config):  # noqa: ANN001
        # The render workers live as long as the whole build: an interruption ends them
        # before TFDS removes its temporary directory (living on in an unclosed generator,
        # they wrote images into it during the removal, which then failed).
        with _render_pool(self.num_workers) as pool:
            self._pool = pool
            try:
                super()._download_and_prepare(dl_manager, download_config)
            finally:
                self._pool = None

    def _generate_examples(
        self, ids: list[int], split: str
    ) -> Iterator[tuple[int, dict[str, Any]]]:
        cfg: SyntheticChangeConfig = self.builder_config
        # Unknown words are an error in train captions; in val/test they become <UNK>.
        unknown: dict[str, int] | None = None if split == "train" else {}
        jobs = [(cfg, i, str(self._raw_dir), self.extractor_version()) for i in ids]
        pool = getattr(self, "_pool", None)
        results = (pool.imap(_render_and_extract, jobs, chunksize=16) if pool is not None
                   else map(_render_and_extract, jobs))
        for i, rendered in zip(ids, results, strict=True):
            ex = self._examples[i]
            where = f"synthetic example {i} ({self._raw_dir})"
            record = {
                "id": i,
                "image_id": f"{i:06d}.png",
                **{k: rendered[k] for k in IMAGE_DIRS},
                "change_captions": np.array(ex.change_captions, dtype=object),
                "change_caption_ids": self._encode(ex.change_captions, where, unknown),
                "no_change_captions": np.array(ex.no_change_captions, dtype=object),
                "no_change_caption_ids": self._encode(ex.no_change_captions, where, unknown),
                "change_type": scenes.CHANGE_TYPES.index(ex.change_type),
                **{k: rendered[k] for k in RENDERED_FIELDS},
            }
            schema.check_record(record, cfg.feature_shape, cfg.max_caption_len, where)
            yield i, record
        if unknown:
            log_unknown_words(unknown, f"synthetic {split} split")

    def _encode(
        self, captions: tuple[str, ...], where: str, unknown: dict[str, int] | None
    ) -> np.ndarray:
        try:
            return self._vocab.encode_many(
                captions, self.builder_config.max_caption_len, allow_unk=unknown is not None,
                unknown_counter=unknown,
            )
        except CaptionError as e:
            raise CaptionError(f"{where}: {e}") from e


def _write_raw_annotations(
    raw_dir: Path, splits: dict[str, list[int]], examples: dict[int, scenes.Example]
) -> None:
    """The annotation files of the CLEVR-Change layout (datasets.md §1.2)."""
    ids = sorted(examples)
    name = lambda i: f"CLEVR_default_{i:06d}.png"  # noqa: E731
    files = {
        "change_captions.json": {name(i): list(examples[i].change_captions) for i in ids},
        "no_change_captions.json": {name(i): list(examples[i].no_change_captions) for i in ids},
        "splits.json": splits,
        "type_mapping.json": {
            t: [f"{i:06d}.png" for i in ids if examples[i].change_type == t]
            for t in scenes.CHANGE_TYPES
        },
    }
    for fname, content in files.items():
        (raw_dir / fname).write_text(json.dumps(content))
