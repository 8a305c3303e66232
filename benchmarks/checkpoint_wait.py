"""How long the training loop waits per checkpoint save, synchronous against asynchronous.

    python -m benchmarks.checkpoint_wait --config=configs/dirl.py:synthetic \\
        --steps=60 --every=10 --rounds=2 [--config.FIELD=VALUE ...]

Trains ``--steps`` steps from scratch, saving every ``--every``, ``--rounds`` times in each
mode, alternated (sync, async, sync, async, ...) so that both see the same machine load; each
run gets a fresh workdir and no evaluation. What is measured is the loop's own
``checkpoint_wait_s`` scalar (``trainers/loop.py``: the seconds ``save`` blocked the steps),
logged every ``--every`` steps so that each log window after the first holds one save; the
last save, waited for when the loop ends, is left out. Prints the median and the quartiles of
the per-save waits of each mode, and the median run time.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import ml_collections
from absl import flags
from ml_collections import config_flags

from changecap_jax import cli, compile_cache
from changecap_jax.io.jsonio import write_json_atomic
from changecap_jax.trainers import captioning

FLAGS = flags.FLAGS
MODES = {"sync": False, "async": True}


def one_run(config: ml_collections.ConfigDict, workdir: Path, steps: int, every: int,
            asynchronous: bool) -> tuple[list[float], float]:
    """(the per-save waits in seconds, the run's seconds) of one fresh run."""
    config = ml_collections.ConfigDict(config.to_dict())
    config.update(num_train_steps=steps, checkpoint_every_steps=every, log_every_steps=every,
                  eval_every_steps=10 * steps, eval_splits=(), final_eval_splits=(),
                  async_checkpoints=asynchronous, early_stop_evals=0)
    trainer = captioning.Trainer(config, workdir)
    began = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - began
    # Window k > 1 holds the save at the end of window k - 1 (a save follows its step's log).
    waits = [scalars["checkpoint_wait_s"] for step, scalars in trainer.history if step > every]
    return waits, seconds


def measure(config: ml_collections.ConfigDict, steps: int, every: int,
            rounds: int) -> dict[str, Any]:
    """Every run's waits, and per mode the median and quartiles of its per-save waits."""
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="save_wait_") as root:
        for k in range(rounds):
            for mode, asynchronous in MODES.items():
                waits, seconds = one_run(config, Path(root) / f"{mode}_{k}", steps, every,
                                         asynchronous)
                runs.append({"mode": mode, "round": k, "waits_s": waits, "run_s": seconds})
                print(f"{mode} round {k}: median wait {statistics.median(waits):.4f} s "
                      f"per save ({len(waits)} saves), run {seconds:.1f} s", flush=True)
    summary = {}
    for mode in MODES:
        waits = [w for r in runs if r["mode"] == mode for w in r["waits_s"]]
        q1, median, q3 = statistics.quantiles(waits, n=4) if len(waits) > 1 else [waits[0]] * 3
        summary[mode] = {"saves": len(waits), "median_wait_s": median, "q1_s": q1, "q3_s": q3,
                         "median_run_s": statistics.median(
                             r["run_s"] for r in runs if r["mode"] == mode)}
    return {"runs": runs, "summary": summary}


def define_flags() -> None:
    """The command's flags (defined when run as a command only, as the benchmark command's)."""
    config_flags.DEFINE_config_file("config", None, "Model config file.", lock_config=False)
    flags.DEFINE_integer("steps", 60, "Train steps per run.")
    flags.DEFINE_integer("every", 10, "Save (and log) every this many steps.")
    flags.DEFINE_integer("rounds", 2, "Runs per mode, alternated sync / async.")
    flags.DEFINE_string("json", None, "Write every run's waits and the summary to this file.")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise ValueError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.steps < 3 * FLAGS.every:
        raise ValueError("--steps must be at least 3 * --every (two measured saves a run)")
    results = measure(FLAGS.config, FLAGS.steps, FLAGS.every, FLAGS.rounds)
    for mode, row in results["summary"].items():
        print(f"{mode:5s}: median {row['median_wait_s'] * 1e3:.1f} ms blocked per save "
              f"(quartiles {row['q1_s'] * 1e3:.1f}-{row['q3_s'] * 1e3:.1f} ms, "
              f"{row['saves']} saves); median run {row['median_run_s']:.1f} s")
    if FLAGS.json:
        write_json_atomic(FLAGS.json, json.loads(json.dumps(results)), indent=1)
        print(f"wrote {FLAGS.json}")


if __name__ == "__main__":
    define_flags()
    flags.mark_flag_as_required("config")
    compile_cache.enable()
    cli.run(main)
