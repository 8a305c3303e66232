"""Captioning and change localization against the amount of viewpoint change (SCORER Fig. 6,
DIRL Fig. 4): the measures behind the difficulty-binned evaluation (``evaluators.py``
``DifficultyBins``; docs/evaluation.md "Difficulty bins").

- **Viewpoint IoU** of a pair: the mean, over the objects seen in both images, of the IoU of
  an object's box in the before image with its box in the after image. The more the camera
  moves, the less the boxes overlap: lower IoU = harder pair. (The papers give the measure in
  words only; CLEVR-Change ships one such value per pair, ``change_captions_by_IOU.json``.)
- **Bins**: the pairs sorted by IoU and cut into ``num_bins`` groups of equal size (quantile
  bins, as the CLEVR-Change scripts select the hardest / easiest quarter), hardest first.
- **Pointing game** (after DUDA, Park et al. 2019, whose scoring the CLEVR-Change scripts
  implement): a map "points" at the changed object when its peak lies in the object's box;
  the before map is scored against the before box and the after map against the after box,
  each present box counts once. The map here is the decoder's cross-attention while it
  generates the change words (below), as SCORER scores "attention maps of cross-modal
  alignment". Ties at the peak are shared: the score of a box is the share of the peak cells'
  area inside it (a single peak cell wholly inside scores 1; a uniform map scores the box's
  share of the image). ``attention_in_box`` is the attention mass inside the box.
- **Change words**: the first run of object-describing words of the generated caption (size,
  colour, material, shape and "thing"/"object" words of ``data/word_classes.py``), i.e. the
  subject naming the changed object ("the *small red metal cube* moved"); later runs name
  referents or the new attribute. A caption without such words has no change words and its
  pair is left out of the pointing game (counted).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import numpy as np

from changecap_jax.data.word_classes import LEXICON

MEASURE = "viewpoint_iou"
CHANGE_WORD_CLASSES = ("colour", "size", "material", "shape", "generic")
CHANGE_WORDS = frozenset(w for cls in CHANGE_WORD_CLASSES for sense in LEXICON[cls][2]
                         for w in sense)

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


def quantile_bins(values: Sequence[float], num_bins: int) -> list[np.ndarray]:
    """Indices of the finite ``values`` sorted ascending (stable) and cut into ``num_bins``
    groups whose sizes differ by at most one; fewer values than bins give one bin per value."""
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    values = np.asarray(values, np.float64)
    finite = np.flatnonzero(np.isfinite(values))
    ordered = finite[np.argsort(values[finite], kind="stable")]
    return [b for b in np.array_split(ordered, min(num_bins, len(ordered))) if len(b)]


def change_word_queries(ids: np.ndarray, id_to_word: Mapping[int, str]) -> np.ndarray:
    """The decoder query positions that generated the change words of one decoded caption
    ``ids`` (START first; 0 from END on). Query t predicts token t + 1."""
    positions: list[int] = []
    for t, token in enumerate(np.asarray(ids).tolist()[1:], start=1):
        if token == 0:
            break
        if id_to_word.get(int(token)) in CHANGE_WORDS:
            positions.append(t - 1)
        elif positions:
            break
    return np.asarray(positions, np.int64)


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


def score_pair(maps: tuple[np.ndarray, np.ndarray], boxes: tuple[Box, Box],
               image_size: tuple[int, int]) -> tuple[float, float, int]:
    """(pointing hits, attention in the boxes, boxes scored) of one pair: the before map
    against the before box and the after map against the after box, each box that exists."""
    hits = mass = 0.0
    count = 0
    for heatmap, box in zip(maps, boxes, strict=True):
        if not is_box(box):
            continue
        fractions = cell_fractions(heatmap.shape, image_size, box)
        hits += pointing_score(heatmap, fractions)
        mass += attention_in_box(heatmap, fractions)
        count += 1
    return hits, mass, count
