"""Builds a dataset into a TFDS (ArrayRecord) data dir.

    python -m data_prep.build synthetic --data_dir=DIR [--config=moderate|extreme] [--seed=N]

The synthetic dataset needs no raw files. The real datasets (clevr_change, clevr_dc,
spot_the_diff, image_editing_request, birds_to_words) will be built by the same command
from their raw downloads.
"""

from __future__ import annotations

import sys

from absl import app, flags

from changecap_jax.data import datasets

FLAGS = flags.FLAGS
flags.DEFINE_string("data_dir", None, "Where to build (default: the user cache folder).")
flags.DEFINE_string("config", "moderate", "Synthetic distractor strength: moderate | extreme.")
flags.DEFINE_integer("seed", 0, "Synthetic dataset seed.")
flags.DEFINE_integer("num_train", 3000, "Synthetic train examples (each gives two pairs).")
flags.DEFINE_integer("num_val", 300, "Synthetic val examples.")
flags.DEFINE_integer("num_test", 600, "Synthetic test examples.")
flags.DEFINE_list("feature_shape", ["8", "8", "64"], "Synthetic grid feature shape H,W,C.")


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        raise app.UsageError(
            f"usage: python -m data_prep.build DATASET [flags]; DATASET one of "
            f"{sorted(datasets.BUILDERS)}"
        )
    name = argv[1]
    if name != "synthetic":
        sys.exit(f"dataset {name!r} has no builder yet; available: {sorted(datasets.BUILDERS)}")
    options = {
        "seed": FLAGS.seed,
        "num_train": FLAGS.num_train,
        "num_val": FLAGS.num_val,
        "num_test": FLAGS.num_test,
        "feature_shape": tuple(int(v) for v in FLAGS.feature_shape),
    }
    prepared = datasets.prepare(name, FLAGS.data_dir, FLAGS.config, options)
    print(f"dataset {name} ({prepared.builder.builder_config.name}) ready in {prepared.directory}")
    print(f"  splits: {prepared.meta.split_sizes}; features {prepared.meta.feature_shape}; "
          f"vocabulary {len(prepared.vocab)} words; captions <= {prepared.meta.max_caption_len}")
    if prepared.meta.raw_dir:
        print(f"  images and annotations: {prepared.directory / prepared.meta.raw_dir}")


if __name__ == "__main__":
    app.run(main)
