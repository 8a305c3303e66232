"""A deterministic, fast grid-feature extractor for the synthetic dataset (NumPy, CPU).

It stands in for the ResNet-101 grid of the real datasets: one C-dimensional vector per cell
of an H x W grid over the image. What it computes, per image:

1. Resize (bilinear, PIL) to (H * P, W * P) pixels, P = ``PATCH`` = 16, scale to [0, 1].
2. Cut into H x W patches of P x P pixels. For each patch form 55 statistics:
   the mean RGB of each of its 4 x 4 sub-cells (48: colour and coarse shape), the per-channel
   standard deviation (3: texture, the specular highlight of metal), the per-channel maximum
   (3: highlights) and the mean absolute horizontal + vertical gradient (1: edges).
3. Centre them by fixed constants and project with a fixed random Gaussian matrix
   (seed ``PROJECTION_SEED``, shape 55 x C/2, entries N(0, 1/55)): y = s @ M.
4. Output ``GAIN`` * concat(relu(y), relu(-y)): C non-negative channels (like a post-ReLU CNN
   grid), and no information is lost while C/2 >= 55. ``GAIN`` = 12 brings typical synthetic
   scenes to about unit RMS per channel, the scale of CNN activations; without it the image
   content was ~15x weaker than the coordinate channels a model appends, and the DIRL decoder
   learned to switch its visual memory off before it could use it.

The projection depends only on C, never on the dataset seed, so every dataset (and ``predict``
on a user's images later) shares the same extractor for a given feature shape.

Version 2 (the synthetic builder from 2.0.0 on) lets the cells see an object's colour and
material through the benchmark's camera and light distractors, which version 1 (the
statistics above, on the raw image) did not (docs/ablations.md, "Why colour and material
changes are missed"). Before step 2 the image is white-balanced by its median colour (the
floor, most of every scene), which undoes a global brightness and tint change. Its 31
statistics per patch lean on what a shift of a few pixels inside the patch leaves alone: the
mean RGB of 2 x 2 sub-cells (12, in place of 4 x 4), the standard deviation, maximum and
gradient as above (7), a hue histogram (8 bins, each pixel weighted by saturation x value, so
the grey floor and white highlights count little) and 4 material cues (the shares of
white-highlight and of dark pixels, the spread and the mean of the value over the saturated
pixels: metal has a highlight and strong shading, rubber neither). The projection is
lossless from 64 channels on (C/2 >= 31). With the same ``GAIN`` its features come to an RMS
of about 1.8 on the synthetic scenes (version 1: 1.0).
"""

from __future__ import annotations

import numpy as np
from PIL import Image

PATCH = 16
SUBCELLS = {1: 4, 2: 2}  # per version: sub-cells per patch side
PROJECTION_SEED = 20240601
HUE_BINS = 8
NUM_MATERIAL_CUES = 4
VERSIONS = (1, 2)
# Per version: sub-cell colours, std / max / gradient (7), then version 2's shift-robust ones.
NUM_STATS = {v: SUBCELLS[v] ** 2 * 3 + 7 + (HUE_BINS + NUM_MATERIAL_CUES if v == 2 else 0)
             for v in VERSIONS}
# The extractor name datasets record in meta.json for each version (predict computes it).
NAMES = {1: "synthetic_grid", 2: "synthetic_grid_v2"}
GAIN = 12.0
# Version 2's white balance maps an image's median colour here: the floor under the before
# view's light (render.py), so a before image is nearly unchanged.
FLOOR_REFERENCE = np.array([150.0, 150.0, 146.0], np.float32)


def _check_version(version: int) -> int:
    if version not in VERSIONS:
        raise ValueError(f"unknown grid extractor version {version!r}; expected one of "
                         f"{list(VERSIONS)}")
    return version


def _projection(channels: int, version: int = 1) -> np.ndarray:
    if channels % 2:
        raise ValueError(f"grid feature channels must be even, got {channels}")
    num_stats = NUM_STATS[_check_version(version)]
    rng = np.random.default_rng(PROJECTION_SEED)
    return rng.normal(0.0, 1.0 / np.sqrt(num_stats), size=(num_stats, channels // 2)).astype(
        np.float32
    )


def white_balance(image: np.ndarray) -> np.ndarray:
    """(h, w, 3) uint8 -> uint8: each channel scaled so the median colour becomes
    ``FLOOR_REFERENCE`` (a global brightness or tint change of the light is undone)."""
    median = np.median(image.reshape(-1, 3), axis=0).astype(np.float32)
    scale = FLOOR_REFERENCE / np.maximum(median, 1.0)
    return np.clip(image * scale, 0, 255).astype(np.uint8)


def _resized(image: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    gh, gw = grid
    if image.ndim != 3 or image.shape[-1] != 3:
        raise ValueError(f"expected an RGB image of shape (h, w, 3), got {image.shape}")
    size = (gw * PATCH, gh * PATCH)
    if image.shape[:2] != (size[1], size[0]):
        image = np.asarray(Image.fromarray(image).resize(size, Image.BILINEAR))
    return image


def _cell_means(x: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """(gh * P, gw * P, ...) per-pixel values -> (gh, gw, ...) their mean per patch."""
    gh, gw = grid
    return x.reshape(gh, PATCH, gw, PATCH, *x.shape[2:]).mean(axis=(1, 3))


def shift_robust_statistics(image: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """(gh * P, gw * P, 3) uint8 -> (gh, gw, 12): the hue histogram and the material cues of
    version 2, per patch (pooled over the patch, so a small shift inside it leaves them)."""
    hsv = np.asarray(Image.fromarray(image).convert("HSV")).astype(np.float32) / 255.0
    hue, sat, val = hsv[..., 0], hsv[..., 1], hsv[..., 2]
    bins = np.minimum((hue * HUE_BINS).astype(np.int64), HUE_BINS - 1)
    weighted = np.eye(HUE_BINS, dtype=np.float32)[bins] * (sat * val)[..., None]
    hue_hist = HUE_BINS * _cell_means(weighted, grid)
    coloured = (sat > 0.3).astype(np.float32)
    highlight = ((sat < 0.25) & (val > 0.8)).astype(np.float32)
    dark = (val < 0.25).astype(np.float32)
    share = _cell_means(coloured, grid) + 1e-3
    mean_val = _cell_means(val * coloured, grid) / share
    spread = np.sqrt(np.maximum(_cell_means(val * val * coloured, grid) / share
                                - mean_val**2, 0.0))
    material = np.stack([4.0 * _cell_means(highlight, grid), 4.0 * _cell_means(dark, grid),
                         4.0 * spread, mean_val * np.minimum(4.0 * share, 1.0)], axis=-1)
    return np.concatenate([hue_hist, material], axis=-1)


def patch_statistics(image: np.ndarray, grid: tuple[int, int], version: int = 1) -> np.ndarray:
    """(h, w, 3) uint8 image -> (H, W, NUM_STATS[version]) float32 patch statistics (steps
    1-2 above; version 2 on the white-balanced image, plus its 12 shift-robust ones)."""
    _check_version(version)
    gh, gw = grid
    image = _resized(image, grid)
    if version == 2:
        image = white_balance(image)
    x = image.astype(np.float32) / 255.0
    patches = x.reshape(gh, PATCH, gw, PATCH, 3).transpose(0, 2, 1, 3, 4)  # (gh, gw, P, P, 3)
    n = SUBCELLS[version]
    s = PATCH // n
    sub = patches.reshape(gh, gw, n, s, n, s, 3).mean(axis=(3, 5)).reshape(gh, gw, -1)
    std = patches.std(axis=(2, 3))
    mx = patches.max(axis=(2, 3))
    gx = np.abs(np.diff(patches, axis=3)).mean(axis=(2, 3, 4))
    gy = np.abs(np.diff(patches, axis=2)).mean(axis=(2, 3, 4))
    grad = (gx + gy)[..., None]
    stats = np.concatenate([sub - 0.5, 4.0 * std, mx - 0.5, 8.0 * grad], axis=-1)
    if version == 2:
        stats = np.concatenate([stats, shift_robust_statistics(image, grid)], axis=-1)
    return stats


def extract(images: np.ndarray, feature_shape: tuple[int, int, int],
            dtype: type = np.float16, version: int = 1) -> np.ndarray:
    """Images (N, h, w, 3) uint8 -> grid features (N, H, W, C) of extractor ``version``,
    rounded once to ``dtype`` (computed in float32)."""
    gh, gw, channels = feature_shape
    proj = _projection(channels, version)
    stats = np.stack([patch_statistics(im, (gh, gw), version) for im in images])
    y = stats @ proj
    feats = GAIN * np.concatenate([np.maximum(y, 0.0), np.maximum(-y, 0.0)], axis=-1)
    return feats.astype(dtype)
