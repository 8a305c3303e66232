"""What every model on the trunk returns to the trainer (the full contract, what the trunk may
call on a model, is ``models/contract.py``; docs/model_contract.md).

A model is a Flax module whose ``__call__(batch, *, train, axis_name=None)`` returns a
:class:`ModelOutput`. The trainer turns each caption stream into a cross-entropy averaged over
the GLOBAL count of real target tokens (or summed over the global batch, when the output says
``caption_reduction="sum"``), averages (or sums) the streams, and adds every auxiliary loss
times ``config.loss_weights[name]``. It never looks at which model produced the output.

Randomness in training: the rng stream ``"dropout"`` differs per device; ``"inputs"`` is the
same step key on every device, for input corruption (e.g. masked-LM masks) that must not
depend on how the batch is split: fold the example's GLOBAL index into it.

Decoding rules: a model whose token conventions differ from the trunk vocabulary's (start id,
end id, which ids are banned, whether a row stops at its end token) says so with a
``decoding_rules`` property (:class:`DecodingRules`); ids the vocabulary does not hold (e.g. an
appended [MASK] row) are named by an ``extra_tokens`` property {id: text}.

Where a model looked (the one hook ``changecap_jax.decoding.attention_maps`` uses for heatmaps,
for every model): each cross-attention of the decoder to its memory sows its probabilities
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

from typing import Any, NamedTuple

import flax.struct
import jax

# Re-exported: the caption-stream conventions live in the data layer (data/streams.py), which
# both the input pipeline and the models import.
from changecap_jax.data.streams import IGNORE_INDEX as IGNORE_INDEX
from changecap_jax.data.streams import pair_streams as pair_streams

# The "inputs" rng of a training step is fold_in(step key, INPUTS_FOLD) (module docstring).
INPUTS_FOLD = 0x1A9B7

ATTENTION = "attention"  # the collection decoders sow cross-attention probabilities into
MEMORY_LAYOUTS = ("shared_grid", "before_after")
CAPTION_REDUCTIONS = ("mean", "sum")


@flax.struct.dataclass
class ModelOutput:
    """Outputs of one training forward pass.

    Attributes:
      caption_logits: stream name -> (B, L, V) logits, aligned with the targets (for a
        left-to-right decoder, position t predicts the token at t + 1).
      caption_targets: stream name -> (B, L) int32 targets, ``IGNORE_INDEX`` where no loss applies.
      aux_losses: loss name -> scalar, already reduced over the global batch (identical on every
        device when computed inside ``shard_map``).
      caption_reduction: "mean" (per-token mean over the global batch, then the mean of the
        streams) or "sum" (every stream's token losses summed over the global batch).
    """

    caption_logits: dict[str, jax.Array]
    caption_targets: dict[str, jax.Array]
    aux_losses: dict[str, jax.Array]
    caption_reduction: str = flax.struct.field(pytree_node=False, default="mean")


class DecodingRules(NamedTuple):
    """Token conventions of the decoding loops (``changecap_jax.decoding.search``). The defaults
    are
    the trunk vocabulary's and the SCORER / DIRL ``sample()``: START 2, END 3, UNK (1) banned,
    a row stops at END and is written as 0 from there on. With ``stop_at_end=False`` greedy and
    sampling run all ``max_len - 1`` steps and keep the raw ids after END (beam search always
    finishes a beam at END)."""

    start_id: int = 2
    end_id: int = 3
    banned_ids: tuple[int, ...] = (1,)
    stop_at_end: bool = True


def decoding_rules(model: Any) -> DecodingRules:
    """The model's :class:`DecodingRules` (the trunk defaults unless it declares its own)."""
    return getattr(model, "decoding_rules", None) or DecodingRules()


def extra_tokens(model: Any) -> dict[int, str]:
    """Ids a model can emit beyond the dataset vocabulary, with their text (usually none)."""
    return dict(getattr(model, "extra_tokens", None) or {})


def conditioning_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """Extra per-pair inputs a model reads beside the two images: name -> per-example shape.

    A model declares them with a ``conditioning_shapes`` property (e.g. ``{"entities": (k,
    D)}``); its batch then holds ``<name>_<stream>`` for each caption stream, and ``encode``
    takes them as keyword arguments. Most models read none.
    """
    return dict(getattr(model, "conditioning_shapes", None) or {})
