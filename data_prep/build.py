"""Builds a dataset into a TFDS (ArrayRecord) data dir.

    python -m data_prep.build synthetic --data_dir=DIR [--config=moderate|weak|extreme] \\
        [--seed=N] [--feature_shape=H,W,C] [--feature_dtype=float16|float32|bfloat16]
    python -m data_prep.build DATASET --raw_dir=DIR [--features_dir=DIR] --data_dir=DIR \\
        [--weights=resnet101.pth] [--layer=3|4] [--feature_dtype=float32|float16|bfloat16]

DATASET is one of clevr_change, clevr_dc, spot_the_diff, image_editing_request,
birds_to_words, read from its official raw download in ``--raw_dir``. With ``--features_dir``
the per-image ``<image name>.npy`` files (official naming, channels first, e.g. the authors'
precomputed archives or ``python -m data_prep.extract_features``) are used; without it the
features are extracted during the build from ``--weights`` (a local torchvision ResNet-101
state dict; CUDA when available). The dataset lands in ``DIR/DATASET/<variant>/<version>``
(variant ``layer3`` / ``layer4``, plus ``_fp16``, ``_bf16``, ``_stdfix``, ``_len<N>`` when set)
and is selected with ``--config.dataset.name=DATASET --config.dataset.data_dir=DIR``.

One build of a dataset at a time: a second build of the same dataset and version (or a
training run building it on first use) waits up to ``--wait`` seconds for the first and then
uses its result. A killed build's temporary ``incomplete.*`` folder is removed by the next.

``--feature_dtype`` (default: float32 for the real datasets, float16 for the synthetic one)
is the stored dtype of the feature grids, recorded in ``meta.json``: float16 or bfloat16 halve
the bytes every training step reads (1.2 MB instead of 2.4 MB per CLEVR-Change example at
14x14x1024); the train step casts them to ``config.compute_dtype`` on the device.
"""

from __future__ import annotations

import sys
from pathlib import Path

from absl import app, flags

from changecap_jax import cli
from changecap_jax.data import datasets
from changecap_jax.data.vocab import CaptionError
from changecap_jax.io import paths
from data_prep import builders
from data_prep.builders.base import BuildError, make_config

FLAGS = flags.FLAGS
flags.DEFINE_string("data_dir", None, "Where to build (default: the user cache folder).")
# Synthetic dataset.
flags.DEFINE_string("config", "moderate", "Synthetic distractor strength: moderate | weak | "
                    "extreme (or none, the diagnostic).")
flags.DEFINE_integer("seed", 0, "Synthetic dataset seed.")
flags.DEFINE_integer("num_train", 3000, "Synthetic train examples (each gives two pairs).")
flags.DEFINE_integer("num_val", 300, "Synthetic val examples.")
flags.DEFINE_integer("num_test", 600, "Synthetic test examples.")
flags.DEFINE_list("feature_shape", ["8", "8", "64"], "Synthetic grid feature shape H,W,C.")
# Real datasets.
flags.DEFINE_string("raw_dir", None, "The dataset's raw download, in its official layout.")
flags.DEFINE_string("features_dir", None,
                    "Per-image <image name>.npy features (C, H, W); else extracted.")
flags.DEFINE_string("weights", None, "Local torchvision ResNet-101 state dict, to extract.")
flags.DEFINE_integer("layer", None, "ResNet-101 cut: 3 (1024x14x14) or 4 (2048x7x7); "
                     "default: the dataset's papers' choice.")
flags.DEFINE_enum("feature_dtype", None, ["float32", "float16", "bfloat16"],
                  "Stored feature dtype; half precision halves the bytes read per example. "
                  "Default: float32 for the real datasets, float16 for the synthetic one.")
flags.DEFINE_boolean("std_fix", False, "Extract with blue std 0.225 instead of the official "
                     "0.224 typo.")
flags.DEFINE_integer("max_caption_len", 0, "Cap captions at N tokens with <START>/<END> "
                     "(longer ones are cut); 0: the dataset's official rule.")
flags.DEFINE_integer("batch_size", 64, "Images per extraction batch.")
flags.DEFINE_string("device", None, "torch device for extraction (default: cuda if present).")
flags.DEFINE_float("wait", datasets.building.WAIT_S, "Seconds to wait for another process "
                   "building the same dataset (then use its result); 0: stop at once.")


def build_real(name: str) -> datasets.PreparedDataset:
    if not FLAGS.raw_dir:
        raise app.UsageError(f"building {name} needs --raw_dir (its raw download)")
    try:
        cls = builders.builder_class(name)
    except KeyError as e:
        raise app.UsageError(str(e.args[0])) from None
    layer = FLAGS.layer or cls.DEFAULT_LAYER
    config = make_config(layer, FLAGS.feature_dtype or "float32", FLAGS.std_fix,
                         FLAGS.max_caption_len)
    named = config.name if config.name in cls.builder_configs else config
    root = FLAGS.data_dir or str(datasets.default_data_dir())
    # Into a bucket: built in this host's local copy of it, then uploaded (TFDS writes and
    # the build lock need a local disk).
    local_root = paths.local_mirror_dir(root) if paths.is_remote(root) else root
    builder = cls(data_dir=str(local_root), config=named, file_format="array_record",
                  raw_dir=FLAGS.raw_dir, features_dir=FLAGS.features_dir,
                  weights=FLAGS.weights, batch_size=FLAGS.batch_size, device=FLAGS.device)
    try:
        datasets.build(builder, wait_s=FLAGS.wait)
    except (BuildError, CaptionError, FileNotFoundError, datasets.building.LockTimeout) as e:
        sys.exit(f"error: {e}")
    if paths.is_remote(root):
        local = Path(builder.data_dir)
        paths.upload(local, paths.path(root) / local.relative_to(local_root).as_posix(),
                     datasets.describe(builder), last=("dataset_info.json",))
    return datasets.prepare(builder.name, root, config.name)


def build_synthetic() -> datasets.PreparedDataset:
    options = {
        "seed": FLAGS.seed,
        "num_train": FLAGS.num_train,
        "num_val": FLAGS.num_val,
        "num_test": FLAGS.num_test,
        "feature_shape": tuple(int(v) for v in FLAGS.feature_shape),
    }
    if FLAGS.feature_dtype:
        options["feature_dtype"] = FLAGS.feature_dtype
    try:
        return datasets.prepare("synthetic", FLAGS.data_dir, FLAGS.config, options,
                                wait_s=FLAGS.wait)
    except datasets.DatasetError as e:
        sys.exit(f"error: {e}")


def main(argv: list[str]) -> None:
    known = ["synthetic", *builders.BUILDERS]
    if len(argv) != 2 or (argv[1] not in known and ":" not in argv[1]):
        raise app.UsageError(
            f"usage: python -m data_prep.build DATASET [flags]; DATASET one of {known}, or a "
            "builder of your own as package.module:ClassName (docs/adding_a_dataset.md)")
    name = argv[1]
    try:
        prepared = build_synthetic() if name == "synthetic" else build_real(name)
    except KeyboardInterrupt:
        sys.exit("interrupted: nothing was written (the build's temporary folder is removed)")
    meta = prepared.meta
    print(f"dataset {prepared.name} ({prepared.directory.parent.name}) ready in "
          f"{prepared.directory}")
    print(f"  splits: {meta.split_sizes}; features {meta.feature_shape} {meta.feature_dtype}; "
          f"vocabulary {len(prepared.vocab)} words; captions <= {meta.max_caption_len}")
    for reason, n in sorted(meta.skipped.items()):
        print(f"  skipped {n}: {reason}")
    if meta.raw_dir:
        print(f"  images and annotations: {prepared.directory / meta.raw_dir}")


if __name__ == "__main__":
    cli.run(main)
