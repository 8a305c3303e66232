"""Timing the jitted train step alternately with another implementation's step, so that both
see the same machine load (``python -m benchmarks.vs_pytorch``: the torch reference and the
official code)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import jax

from changecap_jax.commands.benchmark import timed


def alternate_with_jax_step(setup: Any, jax_batches: Sequence[Any],
                            other_step: Callable[[int], Any], rounds: int) -> tuple[float, float]:
    """One untimed JAX step on ``jax_batches[0]``, then ``rounds`` rounds of a timed JAX step
    (round k on ``jax_batches[(k + 1) % len(jax_batches)]``) and a timed ``other_step(k)``.

    ``setup.compiled_step`` is the compiled step; it donates its state, so the state is
    threaded through the calls and left in ``setup.state``. Returns the medians (JAX, other)."""
    state = setup.state

    def jax_step(batch: Any) -> None:
        nonlocal state
        state, metrics = setup.compiled_step(state, batch)
        jax.block_until_ready(metrics)

    jax_step(jax_batches[0])
    jax_times, other_times = [], []
    try:
        for k in range(rounds):
            batch = jax_batches[(k + 1) % len(jax_batches)]
            jax_times.append(timed(lambda batch=batch: jax_step(batch)))
            other_times.append(timed(lambda k=k: other_step(k)))
    finally:
        setup.state = state  # the old state was donated to the step
    return statistics.median(jax_times), statistics.median(other_times)

