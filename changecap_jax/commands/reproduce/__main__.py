"""Trains the official PyTorch model and ours side by side and tables every step.

    python -m changecap_jax reproduce --official_repo=PATH --config=configs/dirl.py[:PRESET] \
        --steps=N [--batch_size=B] [--out=DIR] [--inputs=dataset|random] \
        [--steps_per_epoch=K] [--official_cfg=KEY=VALUE ...] [--rtol=1e-4] [--atol=0] \
        [--precision=float32|float64]

PATH is a checkout of tuyunbin/DIRL (``configs/dirl.py``), tuyunbin/SCORER
(``configs/scorer.py``) or yaolinli/IDC (``configs/idc_pcl.py``, fine-tuning: its ``clver/``
code, reproduce/idc_pcl.py); torch must be installed (``requirements-torch.txt``). Both sides start
from the official modules' random initialisation (converted to our parameters by the project's
converter), see the same batches with dropout off, and train for N steps with their own
optimiser and learning-rate schedule: the official ``build_optimizer`` + ``StepLR`` from the
official yaml, ours from ``--config``. Prints one line per step and writes ``steps.csv``,
``steps.json`` and ``losses.png`` into DIR (default ``workdir/reproduce_<config name>``).

``--inputs=dataset`` (default) draws the batches from the config's dataset with the project's
input pipeline; ``--inputs=random`` draws random batches at its shapes (``--feature_shape``,
``--vocab_size`` and ``--caption_len`` override them), e.g. the paper's 14x14x1024 grids for a
paper preset without its built dataset. ``--steps_per_epoch`` sets where both schedules step
(default: the dataset's ceil(train / batch); random inputs: the whole run is one epoch).
``--official_cfg=train.optim.lr=0.0003`` merges a value into the official cfg (its own
``merge_cfg_from_list``), e.g. to see what a difference does.

``--precision=float64`` runs both sides in float64 (default float32): ours under
``jax_enable_x64`` with float64 parameters, Adam moments and batches, the official modules
cast with ``.double()`` and stepped under ``torch.set_default_dtype(torch.float64)``; a part
of either side that would still compute in float32 is an error (``reproduce/float64.py``).
It separates float32 rounding from real differences.

``--evaluate=test`` then has both trained models caption the split and scores them the
trainer's way (``reproduce/evaluate.py``); ``--sides=official`` trains the official modules
alone on the batches (and IDC-PCL masks) ours would see, without the per-step comparison: does
the official code learn on this data?

Exit status: 0 when every loss term agrees at every step (|ours - official| <= atol + rtol *
max(|ours|, |official|)), 3 when one does not, 2 for a missing argument, 1 for any other
error. docs/reproduce.md has the
details and the official quirks met.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import jax
from absl import app, flags
from ml_collections import config_flags

from changecap_jax.commands.reproduce import evaluate, official, report, run
from changecap_jax.convert import ConversionError

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Model config file (configs/dirl.py, "
                                "configs/scorer.py or configs/idc_pcl.py, with a preset).",
                                lock_config=False)
flags.DEFINE_string("official_repo", None,
                    "Checkout of tuyunbin/DIRL, tuyunbin/SCORER or yaolinli/IDC.")
flags.DEFINE_integer("steps", 100, "Training steps on each side.")
flags.DEFINE_integer("batch_size", None, "Examples per step (default: the config's).")
flags.DEFINE_string("out", None, "Output folder (default: workdir/reproduce_<config name>).")
flags.DEFINE_enum("inputs", "dataset", ["dataset", "random"], "Where the batches come from.")
flags.DEFINE_integer("steps_per_epoch", 0, "Steps per epoch of both schedules (0: default).")
flags.DEFINE_list("feature_shape", None, "Random inputs: H,W,C of each feature grid.")
flags.DEFINE_integer("vocab_size", None, "Random inputs: vocabulary size.")
flags.DEFINE_integer("caption_len", None, "Random inputs: padded caption length.")
flags.DEFINE_multi_string("official_cfg", [], "KEY=VALUE merged into the official cfg.")
flags.DEFINE_float("rtol", 1e-4, "Relative tolerance of the loss comparison.")
flags.DEFINE_float("atol", 0.0, "Absolute tolerance of the loss comparison.")
flags.DEFINE_enum("precision", "float32", ["float32", "float64"],
                  "Float precision of both sides.")
flags.DEFINE_enum("sides", "both", list(run.SIDES),
                  "official: train the official modules alone on the batches (and masks) ours "
                  "would see, no comparison (with --evaluate: do they learn on this data?).")
flags.DEFINE_list("evaluate", [], "Splits both trained models caption and are scored on "
                  "after the steps (e.g. test): does each side learn?")

EXIT_DIFFERENT, EXIT_USAGE = 3, 2


def _usage(message: str) -> None:
    print(f"reproduce: {message}", file=sys.stderr)
    sys.exit(EXIT_USAGE)


def main(argv: list[str]) -> None:
    """Runs the comparison (module docstring) and exits with its status."""
    if len(argv) > 1:
        _usage(f"unexpected arguments {argv[1:]}")
    if not FLAGS.official_repo:
        _usage("no official checkout given: pass --official_repo=PATH (a checkout of "
               "tuyunbin/DIRL, tuyunbin/SCORER or yaolinli/IDC); nothing was run")
    if FLAGS.config is None:
        _usage("pass --config=configs/dirl.py[:PRESET], --config=configs/scorer.py[:PRESET] or "
               "--config=configs/idc_pcl.py[:PRESET]")
    if FLAGS.precision == "float64":
        # Process-wide before any JAX array exists (run.compare also scopes it to the run).
        jax.config.update("jax_enable_x64", True)

    options = run.Options(
        official_repo=FLAGS.official_repo, steps=FLAGS.steps, batch_size=FLAGS.batch_size,
        inputs=FLAGS.inputs, steps_per_epoch=FLAGS.steps_per_epoch,
        feature_shape=tuple(int(v) for v in FLAGS.feature_shape) if FLAGS.feature_shape
        else None, vocab_size=FLAGS.vocab_size, caption_len=FLAGS.caption_len,
        official_cfg=tuple(FLAGS.official_cfg), rtol=FLAGS.rtol, atol=FLAGS.atol,
        precision=FLAGS.precision)
    name = os.path.splitext(os.path.basename(FLAGS["config"].config_filename))[0]
    out = FLAGS.out or os.path.join("workdir", f"reproduce_{name}")
    options = dataclasses.replace(options, evaluate=tuple(FLAGS.evaluate), out=Path(out),
                                  sides=FLAGS.sides)

    def log(row: dict) -> None:
        if options.sides == "official":
            print(report.format_official_row(row), flush=True)
            return
        if row["step"] == 1:
            print(report.header(report.loss_terms(row)))
        print(report.format_row(row), flush=True)

    try:
        result = run.compare(FLAGS.config, options, log=log)
    except (run.ReproduceError, official.OfficialCheckoutError, ConversionError) as e:
        print(f"reproduce: {e}", file=sys.stderr)
        sys.exit(1)
    paths = report.write_outputs(out, result)
    for note in result.notes:
        print(f"note: {note}")
    if options.sides == "both":
        print(report.format_summary(result.summary))
    if result.evaluation:
        print(evaluate.format_results(result.evaluation))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    sys.exit(0 if result.summary.get("losses_within_tolerance", True) else EXIT_DIFFERENT)


if __name__ == "__main__":
    app.run(main)
