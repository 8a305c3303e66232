"""Change-entity extraction for CHEERS (paper §3.1.1), the command; the method is
``data_prep/methods/change_entities.py``.

    python -m data_prep.entities --data_dir=DIR --dataset=NAME [--variant=V] \\
        [--backend=auto|spacy|rules] [--spacy_model=NAME_OR_PATH]

writes ``<dataset directory>/entities.json`` (atomically) from the change captions of the train
split of a built dataset (``data_prep.build``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from absl import app, flags

from changecap_jax import cli
from changecap_jax.data import building, datasets
from data_prep.methods import change_entities as lib


def extract_dataset_entities(
    name: str,
    data_dir: str | os.PathLike | None,
    variant: str = "",
    options: Mapping[str, Any] | None = None,
    *,
    backend: lib.Backend = "auto",
    spacy_model: str | None = None,
    output: str | os.PathLike | None = None,
) -> tuple[Path, lib.EntityExtraction]:
    """:func:`save_dataset_entities` of a dataset found by name. Never builds a dataset."""
    dataset = datasets.prepare(name, data_dir, variant, options, build_if_missing=False)
    return lib.save_dataset_entities(dataset, backend=backend, spacy_model=spacy_model,
                                     output=output)


def _define_flags() -> None:
    # Defined only when run as a program, so importing this module next to another
    # command's flags (data_prep.build) cannot clash.
    flags.DEFINE_string("data_dir", None, "Where the dataset was built (default: the user "
                        "cache folder).")
    flags.DEFINE_string("dataset", None, "Dataset name, e.g. clevr_change or synthetic.",
                        required=True)
    flags.DEFINE_string("variant", "", "Built variant (e.g. layer3); synthetic: the "
                        "distractor strength (default moderate).")
    flags.DEFINE_enum("backend", "auto", ["auto", "spacy", "rules"],
                      "auto: spaCy when installed with a pipeline, else the rules.")
    flags.DEFINE_string("spacy_model", None, "Installed spaCy pipeline: package name or "
                        "local path (nothing is downloaded).")
    flags.DEFINE_string("output", None, "Where to write (default: "
                        "<dataset directory>/entities.json).")
    # The synthetic dataset is found by its build options (as data_prep.build took them).
    flags.DEFINE_integer("seed", 0, "Synthetic dataset seed.")
    flags.DEFINE_integer("num_train", 3000, "Synthetic train examples.")
    flags.DEFINE_integer("num_val", 300, "Synthetic val examples.")
    flags.DEFINE_integer("num_test", 600, "Synthetic test examples.")
    flags.DEFINE_list("feature_shape", ["8", "8", "64"], "Synthetic feature shape H,W,C.")


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    FLAGS = flags.FLAGS
    options = None
    if FLAGS.dataset == "synthetic":
        options = {"seed": FLAGS.seed, "num_train": FLAGS.num_train,
                   "num_val": FLAGS.num_val, "num_test": FLAGS.num_test,
                   "feature_shape": tuple(int(v) for v in FLAGS.feature_shape)}
    try:
        dataset = datasets.prepare(FLAGS.dataset, FLAGS.data_dir, FLAGS.variant, options,
                                   build_if_missing=False)
        # As every writer into a dataset's directory (first-use preparation too).
        with building.dataset_lock(dataset.directory, building.name_of(dataset.directory)):
            path, extraction = lib.save_dataset_entities(
                dataset, backend=FLAGS.backend, spacy_model=FLAGS.spacy_model,
                output=FLAGS.output)
    except (datasets.DatasetError, building.LockTimeout, RuntimeError, ValueError) as e:
        sys.exit(f"error: {e}")
    print(f"change entities of the train change captions of {FLAGS.dataset} "
          f"({extraction.source['config']})")
    print(extraction.summary())
    print(f"written: {path}")


if __name__ == "__main__":
    _define_flags()
    cli.run(main)
