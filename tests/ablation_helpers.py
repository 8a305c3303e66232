"""What the ablation-preset tests of every model check: a preset switches exactly the config
fields its ABLATIONS entry names, to the values it names (configs/*.py, docs/ablations.md)."""

from __future__ import annotations

from collections.abc import Mapping

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np


def flatten(config: ml_collections.ConfigDict) -> dict[str, object]:
    """``{"model.use_sim": False, ...}``: every field of ``config`` by its dotted path."""
    return flax.traverse_util.flatten_dict(config.to_dict(), sep=".")


def assert_switches_exactly(base: Mapping[str, object], got: Mapping[str, object],
                            fields: Mapping[str, object], name: str, drop: object) -> None:
    """``got`` (flattened) differs from ``base`` in exactly the paths of ``fields`` whose
    value differs there, and holds each of them (``drop``: the path is removed)."""
    changed = {p for p in base.keys() | got.keys() if base.get(p, drop) != got.get(p, drop)}
    assert changed == {p for p, v in fields.items() if base.get(p, drop) != v}, name
    for path, value in fields.items():
        assert got.get(path, drop) == value, (name, path)


def semantic_batch(grid: tuple[int, int, int], caption_len: int, vocab_size: int,
                   seed: int = 0) -> dict[str, jax.Array]:
    """Four semantic pairs of random grids with captions of 5, 8, 3 and 6 tokens (START 2,
    words from 4, END 3, then padding)."""
    r = np.random.RandomState(seed)
    ids = np.zeros((4, caption_len), np.int32)
    for row, n in enumerate([5, 8, 3, 6]):
        ids[row, 0], ids[row, 1:n - 1], ids[row, n - 1] = 2, r.randint(4, vocab_size, n - 2), 3
    return {"before": jnp.asarray(r.rand(4, *grid), jnp.float32),
            "after_semantic": jnp.asarray(r.rand(4, *grid), jnp.float32),
            "change_caption": jnp.asarray(ids)}
