"""Where a model looked: cross-attention heatmaps over the image grid, for every model.

The heatmap of a pair is the decoder's cross-attention from the generated words to its memory,
averaged over heads, decoder layers and the generated words (the positions that predicted each
word and the final END), then laid out on the image grid by the model's ``MEMORY_LAYOUT``
(``models/base.py``). It uses only that documented hook: no model-specific code lives here.

Also here: drawing a heatmap over an image, and the localization measure of the synthetic
dataset (does the heatmap's peak fall inside the changed object's box?), scored like the
difficulty bins' pointing game (``difficulty.py``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image

from changecap_jax.data import boxes
from changecap_jax.decoding.jit import inference_jit
from changecap_jax.models.base import ATTENTION, MEMORY_LAYOUTS

Array = jax.Array


class AttentionMaps(NamedTuple):
    """Heatmaps (B, H, W) float32 on the feature grid, each summing to 1 over the grid."""

    before: np.ndarray
    after: np.ndarray


def _variables(variables: Any) -> dict:
    return {k: v for k, v in dict(variables).items() if k != "cache"}


def query_attention(model: nn.Module, variables: Any, before: Any, after: Any, ids: Array,
                    conditioning: dict) -> Array:
    """(B, L, M): the decoder's cross-attention from each position of ``ids`` (teacher-forced)
    to the memory, averaged over heads and decoder layers. Query t predicts token t + 1."""
    memory = model.apply(variables, before, after, method="encode", **conditioning)
    _, state = model.apply(variables, memory, ids, method="decode", mutable=[ATTENTION])
    probs = jax.tree_util.tree_leaves(state[ATTENTION])
    if not probs:
        raise ValueError(f"{type(model).__name__}'s decoder sows no cross-attention into the "
                         f"{ATTENTION!r} collection (see changecap_jax/models/base.py)")
    return jnp.mean(jnp.stack([p.astype(jnp.float32).mean(axis=1) for p in probs]), axis=0)


@inference_jit(static_argnames=("model",))
def _word_attention(model: nn.Module, variables: Any, before: Any, after: Any,
                    ids: Array, conditioning: dict) -> Array:
    """(B, M): cross-attention from the positions that predicted ``ids``' words to the memory,
    averaged over layers, heads and those positions."""
    per_query = query_attention(model, variables, before, after, ids, conditioning)
    # The queries 0..n predicted the n words and END. Decoded ids hold 0 from END on, so
    # n = the count of non-zero ids after START (capped by the length).
    words = jnp.sum(ids[:, 1:] != 0, axis=1)
    n_queries = jnp.minimum(words + 1, ids.shape[1] - 1)
    used = (jnp.arange(ids.shape[1])[None, :] < n_queries[:, None]).astype(jnp.float32)
    return jnp.einsum("bq,bqm->bm", used, per_query) / n_queries[:, None]


def memory_layout(model: nn.Module) -> str:
    """The model's ``MEMORY_LAYOUT`` (``models/base.py``), checked."""
    layout = getattr(type(model), "MEMORY_LAYOUT", None)
    if layout not in MEMORY_LAYOUTS:
        raise ValueError(f"{type(model).__name__}.MEMORY_LAYOUT is {layout!r}; expected one of "
                         f"{MEMORY_LAYOUTS} (see changecap_jax/models/base.py)")
    return layout


def grid_maps(layout: str, weights: np.ndarray, grid: tuple[int, int]) -> AttentionMaps:
    """Memory weights (B, M) laid out on the (H, W) grid of each image by ``layout``, each
    map normalised to sum 1 (a shared-grid memory gives the same map for both images)."""
    cells = grid[0] * grid[1]
    before = _normalise(weights[:, :cells].reshape(-1, *grid))
    if layout == "shared_grid":
        return AttentionMaps(before, before)
    return AttentionMaps(before, _normalise(weights[:, cells:2 * cells].reshape(-1, *grid)))


def attention_maps(model: nn.Module, variables: Any, before: Any, after: Any,
                   ids: Array | np.ndarray,
                   conditioning: dict[str, Any] | None = None) -> AttentionMaps:
    """Heatmaps of decoded captions ``ids`` (B, L) for grid features ``before`` / ``after``
    (B, H, W, C), as the module docstring defines them (teacher-forced over ``ids``, which
    gives the cached decoder's attention exactly: the positions used see only real words).
    ``conditioning``: the pairs' extra inputs for models that declare some (e.g. entities)."""
    layout = memory_layout(model)
    weights = np.asarray(_word_attention(model, _variables(variables), before, after,
                                         jnp.asarray(ids, jnp.int32),
                                         dict(conditioning or {})))
    return grid_maps(layout, weights, tuple(np.shape(before)[1:3]))


def _normalise(maps: np.ndarray) -> np.ndarray:
    total = maps.sum(axis=(1, 2), keepdims=True)
    return (maps / np.where(total > 0, total, 1.0)).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Drawing
# ---------------------------------------------------------------------------------------------

# A perceptually ordered dark-blue -> red -> yellow ramp (control points, linearly blended).
_RAMP = np.array([[0, 0, 80], [40, 20, 160], [180, 30, 120], [240, 90, 30], [255, 230, 40]],
                 np.float32)


def colorize(values: np.ndarray) -> np.ndarray:
    """Values in [0, 1] (..., ) -> uint8 RGB (..., 3) on the ramp above."""
    t = np.clip(values, 0.0, 1.0) * (len(_RAMP) - 1)
    lo = np.floor(t).astype(int).clip(0, len(_RAMP) - 2)
    frac = (t - lo)[..., None]
    return (_RAMP[lo] * (1 - frac) + _RAMP[lo + 1] * frac).astype(np.uint8)


def overlay(image: np.ndarray, heatmap: np.ndarray, alpha: float = 0.5) -> np.ndarray:
    """uint8 (h, w, 3) image with the (H, W) heatmap (scaled to its maximum) upsampled
    bilinearly over it."""
    h, w = image.shape[:2]
    peak = float(heatmap.max())
    scaled = heatmap / peak if peak > 0 else heatmap
    big = np.asarray(Image.fromarray(scaled.astype(np.float32), mode="F").resize(
        (w, h), Image.BILINEAR))
    blended = (1 - alpha) * image.astype(np.float32) + alpha * colorize(big).astype(np.float32)
    return blended.clip(0, 255).astype(np.uint8)


# ---------------------------------------------------------------------------------------------
# Localization (synthetic dataset: the builder knows the changed object's boxes)
# ---------------------------------------------------------------------------------------------


class Localization(NamedTuple):
    hit_rate: float  # mean pointing-game hit of the heatmaps' peaks in the changed object's box
    uniform_rate: float  # the same for a uniform map: the boxes' mean share of the image
    num_pairs: int


def localization(heatmaps: np.ndarray, boxes_before: np.ndarray, boxes_after: np.ndarray,
                 image_size: tuple[int, int]) -> Localization:
    """Pointing game of (N, H, W) heatmaps against each pair's changed-object boxes in the
    before and the after image (their union), scored as the difficulty bins score it
    (``boxes.pointing_score``: the peak cells' mean area share inside the boxes, so a
    single peak cell wholly inside scores 1 and ties are shared), beside the score of a uniform
    map (the share of the image the boxes cover)."""
    if len(heatmaps) == 0:
        raise ValueError("no heatmaps to score")
    grid = heatmaps.shape[1:3]
    hits, uniform = [], []
    for heat, bb, ba in zip(heatmaps, boxes_before, boxes_after, strict=True):
        inside = boxes.union_fractions(grid, image_size, [bb, ba])
        hits.append(boxes.pointing_score(heat, inside))
        uniform.append(float(inside.mean()))
    return Localization(float(np.mean(hits)), float(np.mean(uniform)), len(hits))
