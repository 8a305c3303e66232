"""Hard negative captions for IDC-PCL's FDA pretraining, the command; the construction and the
file format are ``data_prep/methods/negative_mining.py``.

    python -m data_prep.hard_negatives --data_dir=DIR --dataset=NAME [--variant=V] [--seed=0]
        [--out=DIR] [--splits=train,val] [--pos=auto|spacy|lexicon] [--min_df=10]
        [--option=num_train=40 ...]   (synthetic only: the options it was built with)

writes ``{split}_neg_tfidf6.json`` per split (default: beside the dataset), atomically.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from absl import app, flags

from changecap_jax import cli
from changecap_jax.data import building, datasets, negatives
from data_prep.methods import negative_mining as lib


def _parse_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep:
        raise ValueError(f"--option {text!r}: expected key=value")
    parts = value.split(",")
    try:
        parsed = [int(p) for p in parts]
    except ValueError:
        return key, value
    return key, tuple(parsed) if len(parsed) > 1 else parsed[0]


def main(argv: list[str]) -> None:
    flags_ = flags.FLAGS
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    try:
        options = dict(_parse_option(o) for o in flags_.option or [])
    except ValueError as e:
        raise app.UsageError(str(e)) from e
    try:
        prepared = datasets.prepare(flags_.dataset, flags_.data_dir, flags_.variant or "",
                                    options, build_if_missing=False)
        out_dir = Path(flags_.out) if flags_.out else prepared.directory
        # As every writer into a dataset's directory (first-use preparation too).
        with building.dataset_lock(prepared.directory, building.name_of(prepared.directory)):
            result = lib.generate(prepared, seed=flags_.seed, splits=flags_.splits,
                                  pos=flags_.pos, spacy_model=flags_.spacy_model,
                                  min_df=flags_.min_df, progress=True)
            print(lib.format_summary(result.summary))
            for split, records in result.records.items():
                path = negatives.negatives_path(out_dir, split)
                lib.write_negatives(records, path)
                print(f"wrote {len(records)} pairs x {negatives.NUM_NEGATIVES} negatives to {path}")
    except (datasets.DatasetError, building.LockTimeout, lib.HardNegativeError) as e:
        sys.exit(f"error: {e}")


def _define_flags() -> None:
    flags.DEFINE_string("data_dir", None, "Data dir the dataset was built in (default: the "
                        "user cache folder, as data_prep.build).")
    flags.DEFINE_string("dataset", None, "Dataset name, e.g. clevr_change or synthetic.")
    flags.DEFINE_string("variant", "", "Dataset variant (e.g. layer4; synthetic: moderate).")
    flags.DEFINE_integer("seed", lib.DEFAULT_SEED, "Seed of the random choices.")
    flags.DEFINE_string("out", None, "Output directory for {split}_neg_tfidf6.json "
                        "(default: the dataset's directory).")
    flags.DEFINE_list("splits", [], "Splits to write (default: all).")
    flags.DEFINE_enum("pos", "auto", ["auto", "spacy", "lexicon"],
                      "Word classes: spaCy tags when installed (auto), required (spacy), or "
                      "the seed lexicon + caption statistics only (lexicon).")
    flags.DEFINE_string("spacy_model", None, "Installed spaCy English package to use.")
    flags.DEFINE_integer("min_df", lib.DEFAULT_MIN_DF, "Document frequency a non-lexicon "
                         "word needs to be a replacement (paper: 10).")
    flags.DEFINE_multi_string("option", [], "Synthetic dataset option key=value it was built "
                              "with (num_train, num_val, num_test, feature_shape=4,4,16).")
    flags.mark_flag_as_required("dataset")


if __name__ == "__main__":
    _define_flags()
    cli.run(main)
