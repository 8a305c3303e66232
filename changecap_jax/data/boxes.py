"""Object boxes on an image and on its feature grid: the viewpoint IoU of a pair (how far the
camera moved), the share of each grid cell inside a box, and the pointing-game scores of an
attention map against a box (docs/evaluation.md "Difficulty bins";
``changecap_jax/evaluators/difficulty.py`` bins pairs by them, ``decoding/attention_maps.py`` scores
heatmaps with them)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

Box = Sequence[float]  # [x, y, w, h] in image pixels


def is_box(box: Box | None) -> bool:
    """A box with a positive area (absent boxes are stored as all -1, hidden ones as 0 size)."""
    return box is not None and float(box[2]) > 0 and float(box[3]) > 0


def box_iou(a: Box, b: Box) -> float:
    """Intersection over union of two [x, y, w, h] boxes (0 when either has no area)."""
    if not (is_box(a) and is_box(b)):
        return 0.0
    ix = max(0.0, min(a[0] + a[2], b[0] + b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[1] + a[3], b[1] + b[3]) - max(a[1], b[1]))
    inter = ix * iy
    return float(inter / (a[2] * a[3] + b[2] * b[3] - inter))


def mean_box_iou(same_objects: Sequence[tuple[Box, Box]]) -> float:
    """Viewpoint IoU: the mean IoU of (before box, after box) of each object seen in both
    images (an object with no visible box in either is left out); NaN when none is left."""
    ious = [box_iou(a, b) for a, b in same_objects if is_box(a) and is_box(b)]
    return float(np.mean(ious)) if ious else float("nan")


def cell_fractions(grid: tuple[int, int], image_size: tuple[int, int], box: Box) -> np.ndarray:
    """(H, W): the share of each grid cell's area inside ``box``, the grid covering an image of
    ``image_size`` (height, width) in equal cells."""
    (gh, gw), (ih, iw) = grid, image_size
    x0, y0, w, h = (float(v) for v in box)

    def overlap(lo: np.ndarray, hi: np.ndarray, a: float, b: float) -> np.ndarray:
        return np.clip(np.minimum(hi, b) - np.maximum(lo, a), 0.0, None) / (hi - lo)

    ys, xs = np.arange(gh + 1) * ih / gh, np.arange(gw + 1) * iw / gw
    rows = overlap(ys[:-1], ys[1:], y0, y0 + h)
    cols = overlap(xs[:-1], xs[1:], x0, x0 + w)
    return rows[:, None] * cols[None, :]


def union_fractions(grid: tuple[int, int], image_size: tuple[int, int],
                    boxes: Sequence[Box]) -> np.ndarray:
    """(H, W): the share of each grid cell's area inside the union of ``boxes`` (those with an
    area; absent boxes are skipped), by inclusion-exclusion over the boxes' intersections."""
    present = [tuple(float(v) for v in b) for b in boxes if is_box(b)]
    total = np.zeros(grid, np.float64)
    for size in range(1, len(present) + 1):
        for group in itertools.combinations(present, size):
            common = _intersection(group)
            if common is not None:
                total += (-1) ** (size + 1) * cell_fractions(grid, image_size, common)
    return np.clip(total, 0.0, 1.0)


def _intersection(boxes: Sequence[tuple[float, ...]]) -> tuple[float, ...] | None:
    x0, y0 = max(b[0] for b in boxes), max(b[1] for b in boxes)
    x1, y1 = min(b[0] + b[2] for b in boxes), min(b[1] + b[3] for b in boxes)
    return (x0, y0, x1 - x0, y1 - y0) if x1 > x0 and y1 > y0 else None


def pointing_score(heatmap: np.ndarray, fractions: np.ndarray) -> float:
    """Pointing-game hit of one map: the mean box share of its peak cells (1 for a single peak
    cell inside the box; the box's share of the image for a uniform map)."""
    peak = heatmap == heatmap.max()
    return float(fractions[peak].mean())


def attention_in_box(heatmap: np.ndarray, fractions: np.ndarray) -> float:
    """The share of the map's mass inside the box."""
    total = float(heatmap.sum())
    return float((heatmap * fractions).sum() / total) if total > 0 else 0.0
