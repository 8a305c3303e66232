"""Change-entity retrieval for CHEERS (paper §3.1.2, Eq. 1), the command; the method and the
output format are ``data_prep/methods/entity_retrieval.py``.

    python -m data_prep.retrieval --dataset=NAME [--data_dir=DIR] [--variant=V] \\
        [--backbone=auto|contrastive|clip] [--clip_path=LOCAL_DIR] [--k=3] \\
        [--difference=signed|absolute] [--pooling=mean|change] [--steps=400] \\
        [--batch_size=32] [--splits=train,val,test] [--overwrite]

needs the entity list of ``python -m data_prep.entities`` (``entities.json`` beside the
dataset) and writes ``<dataset directory>/entity_retrieval/``, printing the retrieval accuracy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from absl import flags

from changecap_jax import compile_cache
from changecap_jax.data import building, datasets
from data_prep.methods import entity_retrieval as lib


def _define_flags(fv: Any) -> None:
    def define(kind: Callable[..., Any], name: str, default: Any, help_: str,
               *args: Any) -> None:
        kind(name, default, *args, help_, flag_values=fv)

    define(flags.DEFINE_string, "data_dir", None,
           "Where the dataset was built (default: the user cache folder).")
    define(flags.DEFINE_string, "dataset", None, "Dataset name, e.g. clevr_change or synthetic.")
    define(flags.DEFINE_string, "variant", "", "Built variant; synthetic: the distractor "
           "strength (default moderate).")
    define(flags.DEFINE_enum, "backbone", "auto", "auto: clip when --clip_path is given, else "
           "contrastive.", ["auto", *lib.BACKBONES])
    define(flags.DEFINE_string, "clip_path", None, "Local HuggingFace CLIP checkpoint directory.")
    define(flags.DEFINE_integer, "k", lib.DEFAULT_K, "Entities kept per pair (CHEERS: 3).")
    define(flags.DEFINE_enum, "difference", "signed", "Eq. 1 as printed (signed) or its "
           "absolute value.", list(lib.DIFFERENCES))
    define(flags.DEFINE_list, "splits", [], "Splits to process (default: all).")
    define(flags.DEFINE_integer, "batch_size", 32, "CLIP batch size (images and texts).")
    define(flags.DEFINE_integer, "steps", lib.ContrastiveSettings.steps,
           "Contrastive training steps.")
    define(flags.DEFINE_enum, "pooling", lib.ContrastiveSettings.pooling, "Contrastive image "
           "pooling: mean of the cells, or cells weighted by where the pair differs.",
           list(lib.POOLINGS))
    define(flags.DEFINE_integer, "model_seed", 0, "Contrastive model seed.")
    define(flags.DEFINE_bool, "overwrite", False, "Replace an existing entity_retrieval/.")
    define(flags.DEFINE_integer, "stop_after_batches", None, "Testing the resume: stop the "
           "CLIP image embedding after this many batches, as an interruption would.")
    # The synthetic dataset is found by its build options (as data_prep.build took them).
    define(flags.DEFINE_integer, "seed", 0, "Synthetic dataset seed.")
    define(flags.DEFINE_integer, "num_train", 3000, "Synthetic train examples.")
    define(flags.DEFINE_integer, "num_val", 300, "Synthetic val examples.")
    define(flags.DEFINE_integer, "num_test", 600, "Synthetic test examples.")
    define(flags.DEFINE_list, "feature_shape", ["8", "8", "64"], "Synthetic feature shape H,W,C.")


def main(argv: Sequence[str], log: Callable[[str], None] = print) -> int:
    """The command; ``argv`` as ``sys.argv`` (program name first). Returns the exit status:
    0; 2 on a user error, bad flags included (one line on stderr, as changecap_jax.cli
    prints it for the other commands); 130 when interrupted (a CLIP run then continues from
    its cache when started again)."""
    import sys

    fv = flags.FlagValues()  # own flags: main() can run twice in one process (tests)
    _define_flags(fv)
    if any(a in ("-h", "--help", "--helpshort") for a in argv[1:]):
        log(f"usage: python -m data_prep.retrieval --dataset=NAME [flags]\n{fv}")
        return 0
    try:
        extra = fv(list(argv))[1:]
        if extra:
            raise flags.Error(f"unexpected arguments {extra}")
        if not fv.dataset:
            raise flags.Error("--dataset is required")
    except flags.Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    options = None
    if fv.dataset == "synthetic":
        options = {"seed": fv.seed, "num_train": fv.num_train, "num_val": fv.num_val,
                   "num_test": fv.num_test,
                   "feature_shape": tuple(int(v) for v in fv.feature_shape)}
    dataset = None
    try:
        dataset = datasets.prepare(fv.dataset, fv.data_dir, fv.variant, options,
                                   build_if_missing=False)
        # As every writer into a dataset's directory (first-use preparation too).
        with building.dataset_lock(dataset.directory, building.name_of(dataset.directory)):
            meta = lib.run_retrieval(
                dataset, backbone=fv.backbone, clip_path=fv.clip_path, k=fv.k,
                difference=fv.difference, splits=fv.splits or None, overwrite=fv.overwrite,
                contrastive=lib.ContrastiveSettings(steps=fv.steps, seed=fv.model_seed,
                                                      pooling=fv.pooling),
                clip_options={"batch_size": fv.batch_size,
                              "stop_after_batches": fv.stop_after_batches})
    except (datasets.DatasetError, building.LockTimeout, OSError, ValueError,
            ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        cache = dataset.directory / lib.CLIP_CACHE_DIR if dataset is not None else None
        print(f"interrupted ({e}); nothing written"
              + (f". The CLIP image embeddings so far are kept in {cache}: run the same "
                 "command again to continue" if cache is not None and cache.exists() else ""),
              file=sys.stderr)
        return 130
    log(f"entity retrieval ({meta['backbone']}, k={meta['k']}, {meta['difference']}) of "
        f"{fv.dataset}: {meta['num_entities']} entities")
    log(lib.format_accuracy(meta))
    log(f"written: {dataset.directory / lib.RETRIEVAL_DIR}")
    return 0


if __name__ == "__main__":
    import sys

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    compile_cache.enable()  # the synthetic backbone's training step is jitted
    sys.exit(main(sys.argv))
