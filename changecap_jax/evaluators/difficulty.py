"""Captioning and change localization against the amount of viewpoint change (SCORER Fig. 6,
DIRL Fig. 4): the measures behind the difficulty-binned evaluation (``common.py``
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

from collections.abc import Mapping, Sequence

import numpy as np

from changecap_jax.data.boxes import Box, attention_in_box, cell_fractions, is_box, pointing_score
from changecap_jax.data.word_classes import LEXICON

MEASURE = "viewpoint_iou"
CHANGE_WORD_CLASSES = ("colour", "size", "material", "shape", "generic")
CHANGE_WORDS = frozenset(w for cls in CHANGE_WORD_CLASSES for sense in LEXICON[cls][2]
                         for w in sense)

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
