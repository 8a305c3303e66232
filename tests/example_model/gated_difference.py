"""An example model that lives outside the trunk: the worked example of
docs/adding_a_model.md, trained, evaluated, exported and predicted by
tests/test_example_model.py with no edit to ``changecap_jax``.

Method: both grids are projected to ``hidden_dim`` channels; a gate computed from the two
projections chooses, per cell and channel, between the difference (after - before) and the
after features; the gated cells are the decoder memory, one slot per grid cell. The trunk's
Speaker decoder writes the caption. One auxiliary loss, ``memory_norm`` (the mean squared
memory activation over the global batch), shows how a model hands the trainer an extra loss
that ``config.loss_weights`` weighs.
"""

from __future__ import annotations

from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from changecap_jax.data import streams
from changecap_jax.models import contract
from changecap_jax.models.base import ModelOutput
from changecap_jax.models.decoder import DelegatedDecoding, speaker_for

Array = jax.Array


class GatedDifference(contract.TrunkModel, DelegatedDecoding):
    """Gated difference memory + the trunk's Speaker decoder."""

    MEMORY_LAYOUT: ClassVar[str] = "shared_grid"  # slot n = grid cell n of both images
    capabilities: ClassVar[frozenset[str]] = frozenset()  # no optional capability

    vocab_size: int
    max_len: int
    pairs: str = "both"
    hidden_dim: int = 32
    num_heads: int = 2
    decoder_layers: int = 1
    word_dim: int = 16
    dropout_rate: float = 0.0
    layer_norm_eps: float = 1e-6

    def setup(self) -> None:
        streams.check_pairs(self.pairs)
        self.project = nn.Dense(self.hidden_dim)
        self.gate = nn.Dense(self.hidden_dim)
        self.decoder = speaker_for(self)  # reads the decoder fields above

    def encode(self, before: Array, after: Array, *, train: bool = False) -> Array:
        """(B, H, W, C) grids -> memory (B, H*W, hidden_dim)."""
        b, h, w, _ = before.shape
        x_before, x_after = self.project(before), self.project(after)
        gate = nn.sigmoid(self.gate(jnp.concatenate([x_before, x_after], axis=-1)))
        memory = gate * (x_after - x_before) + (1.0 - gate) * x_after
        return memory.reshape(b, h * w, self.hidden_dim)

    def __call__(self, batch: dict[str, Array], *, train: bool,
                 axis_name: str | None = None) -> ModelOutput:
        streams.validate_batch(batch, self.streams, model=type(self).__name__)
        logits, targets, norms = {}, {}, []
        for stream, after, ids in streams.stream_pairs(batch, self.streams):
            memory = self.encode(batch["before"], after, train=train)
            logits[stream] = self.decoder(memory, ids, train=train)[0]
            targets[stream] = streams.make_caption_targets(ids)
            norms.append(jnp.mean(jnp.square(memory)))
        memory_norm = sum(norms) / len(norms)
        if axis_name is not None:  # a loss over the GLOBAL batch (models/base.py)
            memory_norm = jax.lax.pmean(memory_norm, axis_name)
        return ModelOutput(caption_logits=logits, caption_targets=targets,
                           aux_losses={"memory_norm": memory_norm})
