"""Train or evaluate a model: ``python -m changecap_jax.main --config=configs/dirl.py``.

    --config=configs/MODEL.py[:PRESET]   ml_collections config file (override any field with
                                         --config.FIELD=VALUE, e.g. --config.batch_size=32)
    --workdir=DIR                        checkpoints/, tensorboard/, metrics/, captions/
    --mode=train|eval                    train (resumes from DIR's latest checkpoint) or
                                         score the latest checkpoint on the final splits
                                         (both pass damaged checkpoints with a warning,
                                         changecap_jax/checkpoints.py); a config with a
                                         ``pretrain`` block pretrains
                                         (changecap_jax/pretrain.py, train mode only)
    --model=DIR                          with --mode=eval: score an exported model
                                         (python -m changecap_jax.export) instead; --config
                                         is then optional (it overrides all but the model)
    --multihost                          call jax.distributed.initialize first
"""

from __future__ import annotations

import logging
import os

from absl import app, flags
from ml_collections import config_flags

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


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from changecap_jax import checkpoints, parallel, train

    # orbax logs every checkpoint step at INFO; keep its warnings only.
    logging.getLogger("absl").addFilter(
        lambda r: r.levelno >= logging.WARNING or "/orbax/" not in r.pathname)
    if FLAGS.multihost:
        parallel.initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes,
                                        FLAGS.process_id, FLAGS.cpu_collectives)
    config = FLAGS.config
    if FLAGS.model is not None:
        if FLAGS.mode != "eval":
            raise app.UsageError("--model is for --mode=eval (train from a config)")
        workdir = FLAGS.workdir or os.path.join(
            "workdir", "eval_" + os.path.basename(os.path.normpath(FLAGS.model)))
        train.evaluate_exported(FLAGS.model, workdir, config)
        return
    if config is None:
        raise app.UsageError("--config is required (or --mode=eval --model=DIR)")
    workdir = FLAGS.workdir
    if workdir is None:
        name = os.path.splitext(os.path.basename(FLAGS["config"].config_filename))[0]
        workdir = os.path.join("workdir", name)
    logging.info("workdir: %s\nconfig:\n%s", workdir, config)
    try:
        if "pretrain" in config:
            # A config with a pretrain block trains by sampled tasks (changecap_jax/pretrain.py);
            # it validates while training and has no captions to score.
            if FLAGS.mode != "train":
                raise app.UsageError("a pretraining config (with a pretrain block) has no "
                                     "--mode=eval: its val losses are written while it trains")
            from changecap_jax import pretrain

            pretrain.PretrainTrainer(config, workdir).train()
        elif FLAGS.mode == "train":
            train.Trainer(config, workdir).train()
        else:
            train.evaluate_checkpoint(config, workdir, FLAGS.checkpoint_step)
    except checkpoints.CheckpointError as e:  # one clear line, not TensorStore's trace
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    from changecap_jax import compile_cache

    compile_cache.enable()
    app.run(main)
