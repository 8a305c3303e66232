"""What every model on the trunk returns to the trainer.

A model is a Flax module whose ``__call__(batch, *, train, axis_name=None)`` returns a
:class:`ModelOutput`. The trainer turns each caption stream into a cross-entropy averaged over
the GLOBAL count of real target tokens, averages the streams, and adds every auxiliary loss
times ``config.loss_weights[name]``. It never looks at which model produced the output.

Where a model looked (the one hook ``changecap_jax.explain`` uses for heatmaps, for every
model): each cross-attention of the decoder to its memory sows its probabilities
(B, heads, Lq, M) into the collection :data:`ATTENTION` when that collection is mutable
(``model.apply(..., method="decode", mutable=[ATTENTION])``), and the model class states in
``MEMORY_LAYOUT`` how its M memory slots lie on the images:

* ``"shared_grid"``: slot n is grid cell n (row-major H x W) of both images, because the
  memory is built per grid position from the before and after features together (DIRL,
  SCORER, Subtraction);
* ``"before_after"``: slots 0..N-1 are the before grid, N..2N-1 the after grid;
* any extra slots after those (e.g. retrieved entities) are not on an image and are left out
  of the heatmaps.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax

ATTENTION = "attention"  # the collection decoders sow cross-attention probabilities into
MEMORY_LAYOUTS = ("shared_grid", "before_after")
IGNORE_INDEX = -1  # target id that the caption loss skips (torch's ignore_index=-1)


@flax.struct.dataclass
class ModelOutput:
    """Outputs of one training forward pass.

    Attributes:
      caption_logits: stream name -> (B, L, V) logits; position t predicts the token at t + 1.
      caption_targets: stream name -> (B, L) int32 targets, ``IGNORE_INDEX`` where no loss applies.
      aux_losses: loss name -> scalar, already reduced over the global batch (identical on every
        device when computed inside ``shard_map``).
    """

    caption_logits: dict[str, jax.Array]
    caption_targets: dict[str, jax.Array]
    aux_losses: dict[str, jax.Array]


def conditioning_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """Extra per-pair inputs a model reads beside the two images: name -> per-example shape.

    A model declares them with a ``conditioning_shapes`` property (e.g. ``{"entities": (k,
    D)}``); its batch then holds ``<name>_<stream>`` for each caption stream, and ``encode``
    takes them as keyword arguments. Most models read none.
    """
    return dict(getattr(model, "conditioning_shapes", None) or {})


def pair_streams(pairs: str) -> tuple[str, ...]:
    """The caption streams a model trains on: both pairs, or the semantic pair only."""
    return ("semantic", "distractor") if pairs == "both" else ("semantic",)
