"""The caption streams of a training batch, in one place: their field names, the batch check,
the caption targets and the zero example batches used for init and shape inference.

A change-captioning example has one "before" image and up to two pairs: the semantic pair
(after image with a real change, a change caption) and the distractor pair (after image with
only a viewpoint/lighting change, a "no change" caption). A model trains on both pairs
(``pairs="both"``) or on the semantic pair alone (``"semantic_only"``); each pair it trains on
is a caption *stream*. Models, the input pipeline, the trainer, export and the converters read
the field names from :data:`STREAMS`, never spell them out.

This module sits in the data layer and imports nothing from ``changecap_jax.models``, so both
the data layer and the models may import it. Section numbers (§) refer to docs/official/
(index: docs/official/README.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

BEFORE = "before"  # the image both pairs share
IGNORE_INDEX = -1  # target id that the caption loss skips (torch's ignore_index=-1)
PAIRS = ("both", "semantic_only")


@dataclasses.dataclass(frozen=True)
class Stream:
    """The field names of one caption stream.

    Attributes:
      name: "semantic" or "distractor".
      after: the after-image field (dataset records and training batches).
      caption: the caption ids field of a training batch (one caption, (L,) per example).
      record_captions: the caption ids field of a dataset record (all captions, (K, L)).
      references: the reference texts field of an evaluation record.
      id_suffix: appended to the image id in result files ("" or "_n", as the official code).
      distractor_label: the distractor classifier's label, 1 = semantic change (official).
    """

    name: str
    after: str
    caption: str
    record_captions: str
    references: str
    id_suffix: str
    distractor_label: int

    @property
    def semantic(self) -> bool:
        return self.distractor_label == 1


STREAMS: dict[str, Stream] = {
    "semantic": Stream("semantic", "after_semantic", "change_caption", "change_caption_ids",
                       "change_captions", "", 1),
    "distractor": Stream("distractor", "after_distractor", "no_change_caption",
                         "no_change_caption_ids", "no_change_captions", "_n", 0),
}
# The views the trainer and the models have always used, derived from STREAMS.
STREAM_KEYS = {s.name: (s.after, s.caption) for s in STREAMS.values()}  # training batch
STREAM_INPUTS = {s.name: (s.after, s.references, s.id_suffix) for s in STREAMS.values()}
DISTRACTOR_LABELS = {s.name: s.distractor_label for s in STREAMS.values()}


def check_pairs(pairs: str) -> None:
    """Raises ValueError unless ``pairs`` is one of :data:`PAIRS`."""
    if pairs not in PAIRS:
        raise ValueError(f"pairs must be one of {PAIRS}, got {pairs!r}")


def pair_streams(pairs: str) -> tuple[str, ...]:
    """The caption streams a model trains on: both pairs, or the semantic pair only."""
    return ("semantic", "distractor") if pairs == "both" else ("semantic",)


def batch_keys(streams: Iterable[str], conditioning: Iterable[str] = ()) -> tuple[str, ...]:
    """The training-batch fields of ``streams``: ``before``, then per stream its after image,
    its caption ids and ``<name>_<stream>`` for each conditioning input name."""
    conditioning = tuple(conditioning)
    keys = [BEFORE]
    for name in streams:
        keys += [STREAMS[name].after, STREAMS[name].caption]
        keys += [f"{c}_{name}" for c in conditioning]
    return tuple(keys)


def validate_batch(batch: Mapping[str, Any], streams: Iterable[str], *, model: str,
                   check_ranks: bool = True) -> None:
    """Clear errors for a batch a model cannot read: KeyError naming the missing fields,
    ValueError for an image that is not (B, H, W, C) or caption ids that are not (B, L)
    (``check_ranks=False`` for a model that also takes (B, N, C) tokens)."""
    keys = batch_keys(streams)
    missing = [k for k in keys if k not in batch]
    if missing:
        raise KeyError(f"{model} batch is missing {missing}; it has {sorted(batch)}")
    if not check_ranks:
        return
    captions = {STREAMS[s].caption for s in streams}
    for key in keys:
        want = 2 if key in captions else 4
        shape = batch[key].shape
        if len(shape) != want:
            layout = "(B, L) int ids" if want == 2 else "(B, H, W, C) channels-last features"
            raise ValueError(f"{model} batch[{key!r}] must be {layout}, got shape {shape}")


def stream_pairs(batch: Mapping[str, Any],
                 streams: Iterable[str]) -> Iterator[tuple[str, Any, Array]]:
    """(stream, after image, caption ids as int32) for each stream, in order."""
    for name in streams:
        stream = STREAMS[name]
        yield name, batch[stream.after], jnp.asarray(batch[stream.caption], jnp.int32)


def caption_mask(ids: Array) -> Array:
    """True for the first k positions of each row, k = number of non-zero ids in the row (the
    official caption mask, START..END; §2.5 item 5)."""
    length = jnp.sum(ids != 0, axis=-1, keepdims=True)
    return jnp.arange(ids.shape[-1])[None, :] < length


def make_caption_targets(ids: Array) -> Array:
    """target[t] = ids[t + 1] while position t + 1 is inside :func:`caption_mask`, else
    IGNORE_INDEX; the last position is always IGNORE_INDEX (so END as input gets no target;
    §2.5 item 6)."""
    mask = caption_mask(ids)
    shifted = jnp.where(mask[:, 1:], ids[:, 1:], IGNORE_INDEX)
    pad = jnp.full((ids.shape[0], 1), IGNORE_INDEX, dtype=shifted.dtype)
    return jnp.concatenate([shifted, pad], axis=1).astype(jnp.int32)


def example_batch(streams: Iterable[str], feature_shape: tuple[int, ...], caption_len: int, *,
                  conditioning: Mapping[str, tuple[int, ...]] | None = None,
                  start_id: int | None = None, batch_size: int = 1) -> dict[str, np.ndarray]:
    """A batch of zeros with every field a model on ``streams`` reads, for ``model.init`` or
    shape inference: float32 images (B, *feature_shape), int32 caption ids (B, caption_len)
    (with ``start_id`` at position 0 when given) and float32 conditioning inputs
    ``<name>_<stream>`` (B, *shape)."""
    streams, conditioning = tuple(streams), dict(conditioning or {})
    image = np.zeros((batch_size, *feature_shape), np.float32)
    ids = np.zeros((batch_size, caption_len), np.int32)
    if start_id is not None:
        ids[:, 0] = start_id
    batch = {BEFORE: image}
    for name in streams:
        batch[STREAMS[name].after] = image
        batch[STREAMS[name].caption] = ids
        for c, shape in conditioning.items():
            batch[f"{c}_{name}"] = np.zeros((batch_size, *shape), np.float32)
    return batch
