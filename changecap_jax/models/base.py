"""What every model on the trunk returns to the trainer.

A model is a Flax module whose ``__call__(batch, *, train, axis_name=None)`` returns a
:class:`ModelOutput`. The trainer turns each caption stream into a cross-entropy averaged over
the GLOBAL count of real target tokens, averages the streams, and adds every auxiliary loss
times ``config.loss_weights[name]``. It never looks at which model produced the output.
"""

from __future__ import annotations

import flax.struct
import jax

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


def pair_streams(pairs: str) -> tuple[str, ...]:
    """The caption streams a model trains on: both pairs, or the semantic pair only."""
    return ("semantic", "distractor") if pairs == "both" else ("semantic",)
