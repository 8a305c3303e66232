"""Synthetic change pairs made in memory, for training where TFDS and grain are not installed.

The examples are the built-in synthetic set's (``data/synthetic/examples.py``: the same scene,
captions and images for a seed and example id; the set's grid features, its 16-token caption
ids with a vocabulary built from these captions), kept in one ``.npz`` that the GPU and the
CPU training children both read. :func:`training_batch` then draws batch ``k`` as the
training loader does (a random change caption, the distractor pair swapped with
``swap_prob``), seeded by ``k`` alone, so both children train on the same batches. It is not
the loader's sequence (grain shuffles differently); the curves compare backends, not this set
with the built one.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from changecap_jax.data.synthetic import examples
from changecap_jax.data.vocab import Vocabulary
from changecap_jax.features import grid

SEED = 0  # the built-in set's default seed
FEATURE_DTYPE = np.float16  # as the set stores its grids


def _example(example_id: int) -> tuple[np.ndarray, tuple[str, ...], tuple[str, ...]]:
    ex = examples.sample_example(SEED, example_id)
    images, _ = examples.render_views(ex, examples.DEFAULT_IMAGE_SIZE)
    feats = grid.extract(np.stack([images[k] for k in examples.VIEWS]),
                         examples.DEFAULT_FEATURE_SHAPE, FEATURE_DTYPE,
                         examples.GRID_EXTRACTOR_VERSION)
    return feats, ex.change_captions, ex.no_change_captions


def make(n: int, path: str | os.PathLike, workers: int = 0) -> dict[str, Any]:
    """Renders examples 0..n-1 into ``path`` (.npz); ``workers`` processes (0: this one)."""
    if workers > 1:
        # 'spawn': no fork of a process that may hold threads.
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            made = list(pool.map(_example, range(n), chunksize=max(1, n // (4 * workers))))
    else:
        made = [_example(i) for i in range(n)]
    vocab = Vocabulary.build([c for _, change, same in made for c in change + same])
    length = examples.DEFAULT_MAX_CAPTION_LEN
    feats = np.stack([f for f, _, _ in made])  # (n, 3, H, W, C)
    arrays = {key: feats[:, v] for v, key in enumerate(examples.VIEWS)}
    arrays["change_ids"] = np.stack([vocab.encode_many(c, length) for _, c, _ in made])
    arrays["no_change_ids"] = np.stack([vocab.encode_many(s, length) for _, _, s in made])
    np.savez(path, vocab_size=len(vocab), **arrays)
    return {"examples": n, "vocab_size": len(vocab), "caption_len": length,
            "feature_shape": list(examples.DEFAULT_FEATURE_SHAPE)}


def training_batch(data: Any, k: int, batch: int, swap_prob: float) -> dict[str, np.ndarray]:
    """Batch ``k``: examples without replacement, a random caption per pair, the distractor
    pair's images swapped with probability ``swap_prob``; seeded by ``k`` alone."""
    # Here, not at the top: streams imports JAX, which the parent process leaves alone.
    from changecap_jax.data.streams import BEFORE, STREAMS

    rng = np.random.default_rng([SEED, k])
    n = data[BEFORE].shape[0]
    ids = rng.choice(n, size=batch, replace=False)
    semantic, distractor = STREAMS["semantic"], STREAMS["distractor"]
    rows = np.arange(batch)
    change, same = data["change_ids"][ids], data["no_change_ids"][ids]
    before, after_d = data[BEFORE][ids], data[distractor.after][ids]
    swap = rng.random(batch) < swap_prob
    return {BEFORE: np.where(swap[:, None, None, None], after_d, before),
            semantic.after: data[semantic.after][ids],
            semantic.caption: change[rows, rng.integers(change.shape[1], size=batch)],
            distractor.after: np.where(swap[:, None, None, None], before, after_d),
            distractor.caption: same[rows, rng.integers(same.shape[1], size=batch)]}


def default_workers() -> int:
    return max(1, min(os.cpu_count() or 1, 16))


def load(path: str | os.PathLike) -> dict[str, np.ndarray]:
    with np.load(Path(path)) as f:
        return {k: f[k] for k in f.files}
