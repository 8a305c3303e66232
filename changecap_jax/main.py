"""Train or evaluate a model: ``python -m changecap_jax.main --config=configs/dirl.py``.

    --config=configs/MODEL.py[:PRESET]   ml_collections config file (override any field with
                                         --config.FIELD=VALUE, e.g. --config.batch_size=32)
    --workdir=DIR                        checkpoints/, tensorboard/, metrics/, captions/
                                         (a local folder or gs://BUCKET/...)
    --mode=train|eval                    train (resumes from DIR's latest checkpoint) or
                                         score the latest checkpoint on the final splits
                                         (both pass damaged checkpoints with a warning,
                                         changecap_jax/io/checkpoints.py); a config with a
                                         ``pretrain`` block pretrains
                                         (changecap_jax/trainers/pretraining.py, train mode only)
    --model=DIR                          with --mode=eval: score an exported model
                                         (python -m changecap_jax export) instead; --config
                                         is then optional (it overrides all but the model)
    --multihost                          call jax.distributed.initialize first
    --verbose                            tracebacks of user errors, and the whole config

A run ends with a line naming its metrics, captions and checkpoints folders and the command
that makes its HTML report (changecap_jax.inference.report).
"""

from __future__ import annotations

import logging
import os
import re
import shlex

import ml_collections
from absl import app, flags
from ml_collections import config_flags

from changecap_jax import cli
from changecap_jax.errors import UserError
from changecap_jax.io import paths, workdir_lock

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Model config file.", lock_config=True)
flags.DEFINE_string("workdir", None, "Output directory (default: workdir/<config name>).")
flags.DEFINE_enum("mode", "train", ["train", "eval"], "What to do.")
flags.DEFINE_integer("checkpoint_step", None,
                     "For --mode=eval: step to restore (latest intact); never passed if damaged.")
flags.DEFINE_string("model", None, "For --mode=eval: an exported model directory.")
flags.DEFINE_bool("multihost", False, "Initialise jax.distributed (multi-host runs).")
flags.DEFINE_string("coordinator_address", None, "jax.distributed coordinator host:port.")
flags.DEFINE_integer("num_processes", None, "Number of processes (with --coordinator_address).")
flags.DEFINE_integer("process_id", None, "This process's id (with --coordinator_address).")
flags.DEFINE_string("cpu_collectives", None, "CPU collectives for multi-process CPU runs: gloo.")


def closing_line(workdir: str | os.PathLike) -> str:
    """What a run leaves in ``workdir`` (the folders that exist) and, when it has captions and
    its config.json, the command that makes the HTML report of its latest evaluation."""
    workdir = paths.path(workdir)
    folders = [f"{name} {workdir / name}" for name in ("metrics", "captions", "checkpoints")
               if (workdir / name).is_dir()]
    line = "done: " + (", ".join(folders) if folders else f"nothing written in {workdir}")
    # captions/<split>_<step>.json, by time written; the report's default split is test.
    evaluated = sorted((paths.mtime(p), m.group(1)) for p in (workdir / "captions").glob("*")
                       if (m := re.fullmatch(r"(.+)_\d+\.json", p.name)))
    if evaluated and (workdir / "config.json").exists():
        splits = {split for _, split in evaluated}
        split = "test" if "test" in splits else evaluated[-1][1]
        command = f"python -m changecap_jax report --workdir={shlex.quote(str(workdir))}"
        line += "; HTML report: " + command + ("" if split == "test" else f" --split={split}")
    return line


def _require_checkpoint(workdir: str) -> None:
    """--mode=eval of a workdir without checkpoints fails before the dataset is opened (or,
    for the synthetic one, built)."""
    from changecap_jax.io import checkpoints  # JAX and orbax: after the allocator restart

    directory = paths.path(workdir) / "checkpoints"
    if not checkpoints.has_steps(directory):
        raise UserError(f"no checkpoint in {directory}: train into --workdir={workdir} first, "
                        "or convert one (python -m changecap_jax convert)")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = FLAGS.config
    # The command line is checked before a dataset is opened or anything compiles: a mistake in
    # it is reported at once.
    if FLAGS.model is not None:
        if FLAGS.mode != "eval":
            raise app.UsageError("--model is for --mode=eval (train from a config)")
        workdir = FLAGS.workdir or os.path.join(
            "workdir", "eval_" + os.path.basename(os.path.normpath(FLAGS.model)))
    else:
        if config is None:
            raise app.UsageError("--config is required (or --mode=eval --model=DIR)")
        # A config with a pretrain block trains by sampled tasks
        # (changecap_jax/trainers/pretraining.py);
        # it validates while training and has no captions to score.
        if "pretrain" in config and FLAGS.mode != "train":
            raise app.UsageError("a pretraining config (with a pretrain block) has no "
                                 "--mode=eval: its val losses are written while it trains")
        workdir = FLAGS.workdir
        if workdir is None:
            name = os.path.splitext(os.path.basename(FLAGS["config"].config_filename))[0]
            workdir = os.path.join("workdir", name)
        if FLAGS.mode == "eval":
            _require_checkpoint(workdir)
    from changecap_jax import parallel

    if FLAGS.multihost:
        parallel.initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes,
                                        FLAGS.process_id, FLAGS.cpu_collectives)
    # One run per workdir: a second one is refused here, before anything is written.
    with workdir_lock.hold(workdir):
        _run(config, workdir)
    _close(workdir)


def _run(config: ml_collections.ConfigDict | None, workdir: str) -> None:
    from changecap_jax.trainers import captioning, pretraining

    if FLAGS.model is not None:
        captioning.evaluate_exported(FLAGS.model, workdir, config)
        return
    # The whole config is in WORKDIR/config.json once training starts; on the console it
    # would bury the rest (and an early error under 70 lines).
    logging.info("workdir %s, config %s", workdir, FLAGS["config"].config_filename)
    if FLAGS.verbose:
        logging.info("config:\n%s", config)
    if FLAGS.mode == "train":
        # The task (captioning, or pretraining for a config with a pretrain block); its
        # train() runs the one loop (loop.run).
        task = pretraining.PretrainTrainer if "pretrain" in config else captioning.Trainer
        task(config, workdir).train()
    else:
        captioning.evaluate_checkpoint(config, workdir, FLAGS.checkpoint_step)


def _close(workdir: str) -> None:
    import jax

    if jax.process_index() == 0:
        print(closing_line(workdir), flush=True)


if __name__ == "__main__":
    from changecap_jax import compile_cache

    compile_cache.enable()
    cli.run(main)
