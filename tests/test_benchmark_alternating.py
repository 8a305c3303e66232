"""benchmarks/alternating.py: the alternating timing both comparisons share."""

from types import SimpleNamespace

import numpy as np

from benchmarks.alternating import alternate_with_jax_step


def test_alternates_cycles_the_batches_and_threads_the_donated_state():
    calls = []

    def compiled_step(state, batch):
        calls.append(("jax", batch, state))
        return state + 1, {"loss": np.float32(state)}

    setup = SimpleNamespace(state=10, compiled_step=compiled_step)
    jax_s, other_s = alternate_with_jax_step(setup, ["b0", "b1", "b2"],
                                             lambda k: calls.append(("other", k)), 4)
    assert calls == [("jax", "b0", 10),  # untimed
                     ("jax", "b1", 11), ("other", 0), ("jax", "b2", 12), ("other", 1),
                     ("jax", "b0", 13), ("other", 2), ("jax", "b1", 14), ("other", 3)]
    assert setup.state == 15  # each call's state went into the next, the last one kept
    assert jax_s >= 0 and other_s >= 0


def test_medians_are_of_each_side_s_own_times(monkeypatch):
    from benchmarks import alternating as benchmark_alternating

    times = iter([1.0, 5.0, 3.0, 7.0, 2.0, 6.0])  # jax, other, jax, other, ...
    monkeypatch.setattr(benchmark_alternating, "timed", lambda fn: (fn(), next(times))[1])
    setup = SimpleNamespace(state=0, compiled_step=lambda s, b: (s, {}))
    assert alternate_with_jax_step(setup, [None], lambda k: None, 3) == (2.0, 6.0)
