"""One model's train step and greedy decoding on random inputs of its preset's shapes, timed in
a child process with the benchmark's builders (``changecap_jax/commands/benchmark.py``).

The child's device peak (``memory_stats``) is its own: one job per (model, dtype, batch). It
includes the benchmark's three device batches and the decode batch beside the step's own
buffers; XLA's compile-time sizes of the step (``memory_analysis``) are given too.
"""

from __future__ import annotations

import importlib
from typing import Any

import ml_collections


def load_config(model: str, preset: str) -> ml_collections.ConfigDict:
    return importlib.import_module(f"configs.{model}").get_config(preset)


def compiled_sizes(compiled: Any) -> dict[str, int | None]:
    """XLA's buffer sizes of a compiled step (None where the backend gives none)."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # not every backend or jax version has it
        m = None
    names = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
             "alias_size_in_bytes")
    return {f"xla_{n}": (int(getattr(m, n)) if m is not None and hasattr(m, n) else None)
            for n in names}


def run_job(spec: dict[str, Any]) -> dict[str, Any]:
    from changecap_jax import compile_cache
    from changecap_jax.commands import benchmark
    from changecap_jax.commands import synthetic_inputs as si
    from changecap_jax.models import precision

    compile_cache.enable()
    config = load_config(spec["model"], spec["preset"])
    config.batch_size = spec["batch"]
    config.eval_batch_size = spec["decode_pairs"]
    config.compute_dtype = spec["dtype"]
    setup = benchmark.synthetic_setup(config, si.input_shapes(config))
    timing = benchmark.time_train_step(setup, spec["steps"], matmul_size=0)
    step_memory = benchmark.peak_memory()  # before decoding adds its own buffers
    out = {k: timing[k] for k in ("compile_s", "step_s", "steps", "loss_first_step", "flops",
                                  "dot_flops", "step_loaded_from_cache")}
    out.update(step_memory, **compiled_sizes(setup.compiled_step),
               examples_per_s=config.batch_size / timing["step_s"])
    out.update(benchmark.time_decode(setup, spec["decode_batches"],
                                     precision.compute_dtype(spec["dtype"])))
    return out
