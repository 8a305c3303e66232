"""Times a config's train step and decoding.

    python -m changecap_jax.benchmark --config=configs/dirl.py [--batch_size=N] [--steps=20]

Prints compile time, median train-step time and examples/s after compilation, median greedy
decode time per eval batch, and peak memory (device memory stats where the backend has them,
else the process's peak resident memory).
"""

from __future__ import annotations

import resource
import statistics
import time

import jax
from absl import app, flags
from ml_collections import config_flags

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Model config file.", lock_config=False)
flags.DEFINE_integer("batch_size", None, "Global batch size (default: the config's).")
flags.DEFINE_integer("steps", 20, "Timed train steps after compilation.")
flags.DEFINE_integer("decode_batches", 3, "Timed decode batches after compilation.")


def _peak_memory() -> str:
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return f"{stats['peak_bytes_in_use'] / 2**20:.0f} MiB (device peak)"
    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MiB (process RSS)"


def main(argv: list[str]) -> None:
    del argv
    config = FLAGS.config
    if FLAGS.batch_size:
        config.batch_size = FLAGS.batch_size
    results = run(config, FLAGS.steps, FLAGS.decode_batches)
    print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}; "
          f"batch {config.batch_size}; eval batch {config.eval_batch_size}")
    print(f"train step compile: {results['compile_s']:.2f} s")
    print(f"train step median:  {results['step_s'] * 1e3:.1f} ms "
          f"({results['examples_per_s']:.1f} examples/s, {FLAGS.steps} steps)")
    print(f"greedy decode compile: {results['decode_compile_s']:.2f} s")
    print(f"greedy decode median:  {results['decode_s_per_batch'] * 1e3:.1f} ms per batch of "
          f"{config.eval_batch_size}")
    print(f"peak memory: {_peak_memory()}")


def run(config, steps: int, decode_batches: int) -> dict[str, float]:
    """Returns the measured numbers (also used by tests)."""
    import tempfile

    from changecap_jax import train
    from changecap_jax.data import pipeline

    trainer = train.Trainer(config, tempfile.mkdtemp(prefix="changecap_bench_"))
    state = trainer.init_state()
    iterator = iter(trainer.train_loader())
    batches = [pipeline.to_global(next(iterator), trainer.data_sharding) for _ in range(3)]
    t0 = time.perf_counter()
    state, metrics = trainer.train_step(state, batches[0])
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - t0
    times = []
    for k in range(steps):
        t = time.perf_counter()
        state, metrics = trainer.train_step(state, batches[k % len(batches)])
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times)

    eval_batch = next(pipeline.eval_batches(
        trainer.dataset.split("val"), global_batch_size=config.eval_batch_size))
    arrays = pipeline.to_global(eval_batch, trainer.data_sharding)
    key = jax.random.PRNGKey(0)
    t0 = time.perf_counter()
    jax.block_until_ready(trainer.decode_fn(state.params, arrays["before"],
                                            arrays["after_semantic"], key))
    decode_compile_s = time.perf_counter() - t0
    decode_times = []
    for _ in range(decode_batches):
        t = time.perf_counter()
        jax.block_until_ready(trainer.decode_fn(state.params, arrays["before"],
                                                arrays["after_semantic"], key))
        decode_times.append(time.perf_counter() - t)
    return {
        "compile_s": compile_s,
        "step_s": step_s,
        "examples_per_s": config.batch_size / step_s,
        "decode_compile_s": decode_compile_s,
        "decode_s_per_batch": statistics.median(decode_times),
    }


if __name__ == "__main__":
    flags.mark_flag_as_required("config")
    app.run(main)
