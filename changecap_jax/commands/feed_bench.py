"""Training steps per second of a preset by how its batches reach the devices.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m changecap_jax feed_bench \\
        --config=configs/dirl.py [--steps=20] [--warmup=3] [--rounds=3] \\
        [--modes=loader,prefetch,on_device] [--config.dataset.options.num_train=...]

Three ways to feed the same training (the same batches and losses, see
tests/test_on_device_data.py): ``loader`` (each step's batch read and transferred before the
step), ``prefetch`` (``config.data.device_prefetch=2``: transferred by a thread while the step
before runs), ``on_device`` (``config.dataset.on_device``: the split is on the devices, the
step gathers its batch). Each mode gets its trainer and warm-up (compile, ``--warmup`` steps)
once; then ``--rounds`` times every mode runs ``--steps`` timed steps in turn (A B C A B C ...),
so the slow phases of a shared machine spread over all of them. Prints the median steps/s of
each mode and its ratio to the first.
"""

from __future__ import annotations

import statistics
import tempfile
import time

import jax
import ml_collections
from absl import flags
from ml_collections import config_flags

from changecap_jax import cli
from changecap_jax.trainers import captioning

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Model config file.", lock_config=False)
flags.DEFINE_integer("steps", 20, "Timed steps per run.")
flags.DEFINE_integer("warmup", 3, "Steps after the compile before the first timed run.")
flags.DEFINE_integer("rounds", 3, "Timed runs per mode, alternated.")
flags.DEFINE_list("modes", ["loader", "prefetch", "on_device"], "Feeding modes to compare.")

MODES = {"loader": (False, 0), "prefetch": (False, 2), "on_device": (True, 0)}


def mode_config(config: ml_collections.ConfigDict, mode: str) -> ml_collections.ConfigDict:
    """``config`` fed as ``mode`` says (:data:`MODES`: on_device, device_prefetch)."""
    on_device, depth = MODES[mode]
    config = ml_collections.ConfigDict(config.to_dict())
    config.dataset.on_device = on_device
    config.data.device_prefetch = depth
    return config


class Run:
    """One mode's trainer, state and stream, stepping on from where it stopped."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str):
        self.trainer = captioning.Trainer(config, workdir)
        self.state = self.trainer.init_state()
        self.streams = self.trainer.data_streams()
        self.step = 0

    def steps(self, n: int) -> float:
        """Runs ``n`` steps; their wall-clock seconds, until the last state is ready."""
        start = time.perf_counter()
        for _ in range(n):
            self.step += 1
            self.state, _, _ = self.trainer.run_step(self.state, self.step, self.streams)
        jax.block_until_ready(self.state)
        return time.perf_counter() - start


def measure(config: ml_collections.ConfigDict, modes: list[str], steps: int, warmup: int,
            rounds: int) -> dict[str, list[float]]:
    """Steps/s of each mode, ``rounds`` alternated runs of ``steps`` steps each."""
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise ValueError(f"--modes has unknown mode(s) {unknown}; known: {list(MODES)}")
    with tempfile.TemporaryDirectory(prefix="feed_bench_") as tmp:
        runs = {m: Run(mode_config(config, m), f"{tmp}/{m}") for m in modes}
        for run in runs.values():
            run.steps(1 + warmup)  # the compile, then the warm-up
        rates: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(rounds):
            for m, run in runs.items():
                rates[m].append(steps / run.steps(steps))
        for run in runs.values():
            for stream in run.streams.values():
                stream.close()
    return rates


def report(rates: dict[str, list[float]]) -> None:
    first = next(iter(rates))
    base = statistics.median(rates[first])
    print(f"{'mode':10s} {'median steps/s':>15s} {'ratio':>7s}  runs")
    for m, values in rates.items():
        median = statistics.median(values)
        print(f"{m:10s} {median:15.2f} {median / base:7.3f}  "
              + " ".join(f"{v:.2f}" for v in values))


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.config is None:
        raise ValueError("give --config=configs/<model>.py")
    print(f"{jax.device_count()} devices ({jax.devices()[0].platform}); batch "
          f"{FLAGS.config.batch_size}, {FLAGS.steps} steps x {FLAGS.rounds} rounds")
    report(measure(FLAGS.config, list(FLAGS.modes), FLAGS.steps, FLAGS.warmup,
                   FLAGS.rounds))


if __name__ == "__main__":
    cli.run(main)
