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
    --multihost                          call jax.distributed.initialize first; a lost
                                         process stops the others within --peer_timeout_s
                                         (changecap_jax/host_watch.py)
    --verbose                            tracebacks of user errors, and the whole config

A run ends with a line naming its metrics, captions and checkpoints folders and the command
that makes its HTML report (changecap_jax.commands.report).
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import sys

import ml_collections
from absl import app, flags
from ml_collections import config_flags

from changecap_jax import cli, host_watch
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
flags.DEFINE_integer("peer_timeout_s", 100, "With --multihost: a process that sends no heartbeat "
                     "this long is lost, and every other one stops with a line naming it.")


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
    if FLAGS.multihost and not host_watch.is_watched_child():
        # This process only watches; the same command runs the job as its child.
        sys.exit(host_watch.run_watched(FLAGS.process_id, FLAGS.num_processes,
                                        FLAGS.peer_timeout_s))
    if host_watch.is_watched_child():
        host_watch.stop_with_watcher()
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
                                        FLAGS.process_id, FLAGS.cpu_collectives,
                                        heartbeat_timeout_s=FLAGS.peer_timeout_s)
    # One run per workdir: a second one is refused here, before anything is written.
    with workdir_lock.hold(workdir):
        preempted = _run(config, workdir)
    _close(workdir, preempted)


def _run(config: ml_collections.ConfigDict | None, workdir: str) -> str | None:
    """Trains or evaluates; returns the line saying so when a preemption stopped training."""
    from changecap_jax.trainers import captioning, pretraining
    from changecap_jax.trainers.preemption import Preempted

    if FLAGS.model is not None:
        captioning.evaluate_exported(FLAGS.model, workdir, config)
        return None
    # The whole config is in WORKDIR/config.json once training starts; on the console it
    # would bury the rest (and an early error under 70 lines).
    logging.info("workdir %s, config %s", workdir, FLAGS["config"].config_filename)
    if FLAGS.verbose:
        logging.info("config:\n%s", config)
    if FLAGS.mode == "train":
        # The synthetic set's per-model files (CHEERS' entities, IDC-PCL's hard negatives),
        # made here when missing: an explicit step of training, not of building a dataset.
        from data_prep import first_use

        for made in first_use.prepare(config):
            logging.info("prepared %s", made)
        # The task (captioning, or pretraining for a config with a pretrain block); its
        # train() runs the one loop (loop.run).
        task = pretraining.PretrainTrainer if "pretrain" in config else captioning.Trainer
        try:
            task(config, workdir).train()
        except Preempted as stop:  # saved: exit status 0, and the same command resumes
            return str(stop)
    else:
        captioning.evaluate_checkpoint(config, workdir, FLAGS.checkpoint_step)
    return None


def _close(workdir: str, preempted: str | None = None) -> None:
    import jax

    if jax.process_index() == 0:
        print(preempted or closing_line(workdir), flush=True)


if __name__ == "__main__":
    from changecap_jax import compile_cache

    compile_cache.enable()
    cli.run(main)
