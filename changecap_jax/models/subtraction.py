"""The Subtraction baseline of SCORER's ablations (Tu et al., ICCV 2023, Tables 6-7 and 10-12).

The paper describes it in one sentence: "a transformer-based baseline model which computes
difference features by direct subtraction" (supplement §6.3); no code was released. Our reading,
built from SCORER's own parts (``docs/official/scorer.md`` §3.1-§3.2):

1. Input embedding as SCORER (paper Eq. 1): each grid (B, H, W, C) goes through the shared 1x1
   projection ``img_0`` to ``hidden`` channels (coordinates appended first on CLEVR-Change).
2. Difference by subtraction: D = img(after) - img(before), token-wise. The learned grid
   position embedding is added to D, not to the two images: added to both it would cancel in
   the subtraction (as the projection bias and the coordinate channels do), leaving the decoder
   a position-blind memory and the embedding tables without gradient.
3. Memory (paper Eq. 7 with D in place of cat(X1, X2)): ReLU(Dropout(Linear(D))).
   ``fusion="concat"`` instead feeds cat(X_bef, X_aft, D) (each with the position embedding)
   to the Linear, the DUDA-style variant of a subtraction baseline.
4. The SCORER decoder (:class:`~changecap_jax.models.decoder.Speaker`, §3.2), the caption
   cross-entropy of both pairs (1/2 semantic + 1/2 distractor on CLEVR-Change).

No auxiliary losses: the baseline has neither the cross-view contrastive alignment nor CBR, so
``config.loss_weights`` is empty. Parameter paths equal SCORER's for the shared parts
(``encoder/img_0``, ``encoder/pos_embedding/{w,h}_embedding``, ``encoder/embed_fc_0``, all of
``decoder/``; see :mod:`changecap_jax.models.scorer`); ``encoder/embed_fc_0/kernel`` is
(hidden, hidden) for ``fusion="difference"`` and (3 hidden, hidden) for ``"concat"``.
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
from changecap_jax.models.dropout import Dropout
from changecap_jax.models.layers import TorchDense, grid_input, grid_position_embedding

Array = jax.Array

FUSIONS = ("difference", "concat")


class SubtractionEncoder(nn.Module):
    """Projection, subtraction and fusion into the decoder memory; torch-default init."""

    hidden_dim: int = 512
    dropout_rate: float = 0.1
    fusion: str = "difference"

    def setup(self) -> None:
        if self.fusion not in FUSIONS:
            raise ValueError(f"fusion must be one of {FUSIONS}, got {self.fusion!r}")
        self.img_0 = TorchDense(self.hidden_dim)  # 1x1 conv as a Dense over channels
        self.pos_embedding = grid_position_embedding(self.hidden_dim)
        self.embed_fc_0 = TorchDense(self.hidden_dim)
        self.dropout = Dropout(self.dropout_rate)

    def embed(self, grid: Array) -> Array:
        """The 1x1 projection (B, H, W, C) -> (B, H, W, hidden)."""
        return self.img_0(grid)

    def __call__(self, before: Array, after: Array, *, train: bool) -> Array:
        """``before`` comes projected (:meth:`embed`): the model projects it once for both pairs
        of an example; ``after`` is a grid (B, H, W, C)."""
        b, h, w, _ = before.shape
        x_bef, x_aft = before, self.embed(after)
        pe = self.pos_embedding(h, w)[None]
        diff = x_aft - x_bef + pe
        if self.fusion == "concat":
            diff = jnp.concatenate([x_bef + pe, x_aft + pe, diff], axis=-1)
        tokens = diff.reshape(b, h * w, diff.shape[-1])
        return nn.relu(self.dropout(self.embed_fc_0(tokens), deterministic=not train))


class Subtraction(contract.TrunkModel, DelegatedDecoding):
    """Subtraction encoder + SCORER's Speaker decoder; no auxiliary losses."""

    # The decoder memory holds one slot per grid cell, from both images (models/base.py).
    MEMORY_LAYOUT: ClassVar[str] = "shared_grid"
    capabilities: ClassVar[frozenset[str]] = frozenset()

    vocab_size: int
    max_len: int
    pairs: str = "both"
    use_coordinates: bool = True
    hidden_dim: int = 512
    num_heads: int = 8
    decoder_layers: int = 2
    word_dim: int = 300
    dropout_rate: float = 0.1
    layer_norm_eps: float = 1e-6
    fusion: str = "difference"

    def setup(self) -> None:
        streams.check_pairs(self.pairs)
        self.encoder = SubtractionEncoder(self.hidden_dim, self.dropout_rate, self.fusion)
        self.decoder = speaker_for(self)

    def _features(self, x: Array) -> Array:
        return grid_input(x, self.use_coordinates)

    def __call__(
        self, batch: dict[str, Array], *, train: bool, axis_name: str | None = None
    ) -> ModelOutput:
        del axis_name  # no batch-wide loss
        streams.validate_batch(batch, self.streams, model=type(self).__name__)
        # The before image is the same in both pairs: projected once per example
        # (docs/models.md, "The before image once per example").
        before = self.encoder.embed(self._features(batch["before"]))
        logits, targets = {}, {}
        for stream, after, ids in streams.stream_pairs(batch, self.streams):
            memory = self.encoder(before, self._features(after), train=train)
            logits[stream] = self.decoder(memory, ids, train=train)[0]
            targets[stream] = streams.make_caption_targets(ids)
        return ModelOutput(caption_logits=logits, caption_targets=targets, aux_losses={})

    # ---- decoding protocol (init_cache, decode_step, decode: DelegatedDecoding) -------

    def encode(self, before: Array, after: Array, *, train: bool = False) -> Array:
        """(B, H, W, C) before/after features -> decoder memory (B, H*W, hidden)."""
        return self.encoder(self.encoder.embed(self._features(before)), self._features(after),
                            train=train)
