"""DIRL + CCR (Tu et al., ECCV 2024): distractors-immune representation learning with
cross-modal contrastive regularisation, as the official code ``tuyunbin/DIRL`` computes it.

Section numbers (§) and quirk ids (D-Q) refer to docs/official/ (index: docs/official/README.md).

Method
------
1. Visual embedding (§3.1 steps 1-3, shared with SCORER). Each image's grid (B, H, W, C)
   (C = 1024 ResNet-101 layer3 channels, + 2 coordinate channels from AddSpatialInfo §2.3 on
   CLEVR-Change, ``use_coordinates=True``) goes through a 1x1 projection (a Dense over channels)
   to 512, gets the learned 2-D grid position embedding added, and is flattened row-major to
   tokens X0 (B, H*W, 512), token t = i*W + j.
2. DIRL loss (§4.1 step 2). A 2-layer MLP (512 -> 2048 -> ReLU -> dropout -> 512), shared by
   both images and used only by this loss, maps X0_bef and X0_aft to Y1, Y2. The loss
   (:func:`changecap_jax.models.losses.barlow_correlation_loss`) z-scores each channel over all
   B*H*W
   tokens of the global batch and pushes the cross-correlation matrix towards the identity
   (diagonal to 1: non-perturbation; off-diagonal to 0 with weight 0.003: discrimination).
3. Shared-feature removal (§4.1 steps 3-4, paper Eq. 5-6). Two cross-attention layers
   T(x, y) = LN(x + Dropout(MHA(q=x, k=v=y))), each shared by both directions, update the two
   images SIMULTANEOUSLY: (X1, X2) <- (T(X1, X2), T(X2, X1)). The difference features are
   pre minus post: diff_bef = X0_bef - X1, diff_aft = X0_aft - X2.
4. CCR decoder (§4.2). Memory E = embed_fc(cat(diff_bef, diff_aft)) (Linear 1024 -> 512
   [-> LN on CLEVR-DC] -> dropout -> ReLU; paper Eq. 7). Words: fc(embed(ids) + PE) with a fixed
   sinusoid PE (§3.2). Two post-LN layers: masked self-attention (causal + key padding), cross-
   attention to E, FFN 2048 ReLU. Logits: Linear 512 -> V.
5. CCR loss (§4.2 step 3, paper Eq. 12-14). In the last decoder layer, t = mean over ALL Lt text
   positions (pads included, as the official code does) of the self-attention sub-layer output
   and v = the same mean of the cross-attention sub-layer output;
   :func:`changecap_jax.models.losses.ccr_infonce_loss` applies InfoNCE with logits S + S^T, S = t
   v^T.
6. Objective (§4.3). CLEVR-Change: the model runs on (before, after_semantic, change_caption)
   and (before, after_distractor, no_change_caption); aux losses are the means of the two pairs
   and the trainer adds cap + 0.5 dirl + 0.3 ccr. CLEVR-DC: one pair, cap + 0.03 dirl + 0.05 ccr.

Ablations (paper Tables 6-7, docs/ablations.md; defaults = the full model): ``use_dirl=False``
drops the DIRL loss and its MLP head (no ``encoder/mlp_*`` parameters), ``use_ccr=False`` the
CCR loss (the decoder is the same; t and v are then unused); either loss missing from
``aux_losses`` must be missing from ``config.loss_weights``. ``on_diagonal_weight=0`` keeps
only the off-diagonal (discrimination) term of the DIRL loss, ``off_diagonal_weight=0`` only
the diagonal (non-perturbation) term.

The two decoder variants (§4 table, field ``variant``):
  * ``"clevr_change"`` = ``models/CCR_no_init.py``: no LayerNorms in ``fc`` / ``embed_fc``; torch
    default init (word embedding N(0, 1) with the pad row 0 set to zero).
  * ``"clevr_dc"`` = ``models/CCR.py``: LayerNorm after the Linear in ``fc`` and ``embed_fc``;
    xavier_uniform on every >= 2-D decoder parameter (the pad row is overwritten).
The encoder is the same in both (xavier_uniform on >= 2-D params, §4.4).

Plug-in: ``medic`` (``config.model.medic``, docs/adding_a_model.md "Plug-ins") switches on
MEDIC (:mod:`changecap_jax.models.medic`) on the difference features: its expert features are
concatenated to them, so ``embed_fc`` reads cat(diff_bef, diff_aft, expert_bef, expert_aft)
(4 x hidden, as MEDIC's ``models/CCR_expert.py``), and its losses join ``aux_losses``. Without
``medic`` the model is exactly the one above.

Official checkpoints (tuyunbin/DIRL) convert with ``changecap_jax/convert/models/dirl.py``.

The 1x1 projection's kernel row c is input channel c; with coordinates, rows C and C + 1 are the
x and y channels (same order as AddSpatialInfo). Row 0 of ``decoder/embed/embedding`` must get a
zero gradient (torch ``padding_idx=0``); that mask belongs to the trainer (§1.2).

Decoding protocol (used by :mod:`changecap_jax.decoding.search`): ``encode``, ``init_cache``,
``decode_step``; ``decode`` is the full-recompute reference.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from changecap_jax.data import streams
from changecap_jax.models import contract, losses, medic
from changecap_jax.models.base import ModelOutput
from changecap_jax.models.decoder import (
    DelegatedDecoding,
    cached_step,
    init_layer_caches,
    teacher_forced_words,
)
from changecap_jax.models.dropout import Dropout
from changecap_jax.models.layers import (
    GridPositionEmbedding,
    Initializer,
    MultiheadAttention,
    TorchDense,
    embed_grid,
    grid_input,
    make_attention_mask,
    normal_zero_pad_init,
    sinusoid_table,
    torch_default_kernel_init,
    torch_layer_norm,
    xavier_uniform,
)

Array = jax.Array

VARIANTS = ("clevr_change", "clevr_dc")


class EmbeddedImage(NamedTuple):
    """One image after the per-image layers (§4.1 steps 1-2), with its projections in the first
    cross layer: its query in one direction, its keys and values in the other (every pair with
    this image reads them)."""

    tokens: Array  # (B, HW, hidden): X0, projection + grid PE
    mlp: Array | None  # (B, HW, hidden): DIRL MLP head output, None if not computed
    first_query: Array  # (B, HW, heads, hidden / heads)
    first_key_value: tuple[Array, Array]


class EncoderOutput(NamedTuple):
    diff_before: Array  # (B, HW, hidden): X0_bef - X_bef after the cross layers
    diff_after: Array  # (B, HW, hidden)
    mlp_before: Array | None  # (B, HW, hidden): DIRL MLP head outputs, None if not computed
    mlp_after: Array | None


# --------------------------------------------------------------------------------------------
# Encoder (§4.1)
# --------------------------------------------------------------------------------------------


class CrossAttentionLayer(nn.Module):
    """One DIRL cross layer (torch ``transformer.{l}``): T(x, y) = LN(x + Drop(MHA(x, y, y)))."""

    hidden_dim: int
    num_heads: int
    dropout_rate: float
    layer_norm_eps: float = 1e-5

    def setup(self) -> None:
        self.attention = MultiheadAttention(
            self.hidden_dim,
            self.num_heads,
            dropout_rate=self.dropout_rate,
            out_kernel_init=xavier_uniform,  # DIRL's _reset_parameters: xavier on all >= 2-D
        )
        self.norm1 = torch_layer_norm(self.layer_norm_eps)
        self.dropout = Dropout(self.dropout_rate)

    def __call__(self, x: Array, y: Array, *, deterministic: bool = True,
                 x_query: Array | None = None,
                 y_key_value: tuple[Array, Array] | None = None) -> Array:
        """``x_query`` / ``y_key_value``: x's query / y's keys and values, already projected."""
        attended = self.attention(x, y, deterministic=deterministic, query=x_query,
                                  key_value=y_key_value)
        return self.norm1(x + self.dropout(attended, deterministic=deterministic))


class DIRLEncoder(nn.Module):
    """§4.1: projection + grid PE, the DIRL MLP head, and the shared cross layers."""

    hidden_dim: int = 512
    num_heads: int = 8
    num_layers: int = 2
    mlp_hidden_dim: int = 2048
    dropout_rate: float = 0.1
    layer_norm_eps: float = 1e-5

    def setup(self) -> None:
        # torch img.0 (1x1 conv) as a Dense over channels; xavier weight, default conv bias.
        self.img = TorchDense(self.hidden_dim, kernel_init=xavier_uniform)
        self.pos_embedding = GridPositionEmbedding(self.hidden_dim)
        self.mlp_0 = TorchDense(self.mlp_hidden_dim, kernel_init=xavier_uniform)
        self.mlp_3 = TorchDense(self.hidden_dim, kernel_init=xavier_uniform)
        self.mlp_dropout = Dropout(self.dropout_rate)
        self.transformer = [
            CrossAttentionLayer(
                self.hidden_dim, self.num_heads, self.dropout_rate, self.layer_norm_eps
            )
            for _ in range(self.num_layers)
        ]

    def embed(self, grid: Array) -> Array:
        """(B, H, W, C) -> X0 (B, H*W, hidden), token t = i*W + j (§3.1 steps 1-3)."""
        return embed_grid(self.img, self.pos_embedding, grid)

    def mlp(self, x: Array, *, deterministic: bool = True) -> Array:
        """torch ``mlp``: Linear -> ReLU -> Dropout -> Linear; feeds only the DIRL loss."""
        y = nn.relu(self.mlp_0(x))
        return self.mlp_3(self.mlp_dropout(y, deterministic=deterministic))

    def embed_image(self, grid: Array, *, train: bool, with_mlp: bool = True) -> EmbeddedImage:
        """The per-image layers: X0 and, with ``with_mlp``, the MLP head's output; and X0's
        projections in the first cross layer."""
        tokens = self.embed(grid)
        mlp = self.mlp(tokens, deterministic=not train) if with_mlp else None
        first = self.transformer[0].attention
        return EmbeddedImage(tokens, mlp, first.project_query(tokens),
                             first.project_key_value(tokens))

    def __call__(self, before: EmbeddedImage, after: Array, *, train: bool) -> EncoderOutput:
        """``before`` comes embedded (:meth:`embed_image`): the model embeds it once for both
        pairs of an example; ``after`` is a grid (B, H, W, C), through the MLP head when
        ``before`` was."""
        deterministic = not train
        x1_0, y1 = before.tokens, before.mlp
        x2_0 = self.embed(after)
        y2 = None if y1 is None else self.mlp(x2_0, deterministic=deterministic)
        x1, x2 = x1_0, x2_0
        for i, layer in enumerate(self.transformer):
            # Simultaneous update: both directions read the previous layer's (x1, x2). In the
            # first layer the before image's projections come with it, made once per example.
            x1, x2 = (
                layer(x1, x2, deterministic=deterministic,
                      x_query=before.first_query if i == 0 else None),
                layer(x2, x1, deterministic=deterministic,
                      y_key_value=before.first_key_value if i == 0 else None),
            )
        return EncoderOutput(x1_0 - x1, x2_0 - x2, y1, y2)


# --------------------------------------------------------------------------------------------
# Decoder (§4.2)
# --------------------------------------------------------------------------------------------


class CCRLayer(nn.Module):
    """One post-LN decoder layer (torch ``core.layer.{l}``, class CrossTransformer).

    Returns the layer output and the CCR vectors t (mean of the self-attention sub-layer output
    over all Lt positions) and v (same mean of the cross-attention sub-layer output).
    """

    hidden_dim: int
    num_heads: int
    ffn_dim: int
    dropout_rate: float
    kernel_init: Initializer
    layer_norm_eps: float = 1e-5

    def setup(self) -> None:
        attention = lambda **kw: MultiheadAttention(
            self.hidden_dim,
            self.num_heads,
            dropout_rate=self.dropout_rate,
            out_kernel_init=self.kernel_init,
            **kw,
        )
        self.self_att = attention()
        self.cross_att = attention(sow_probs=True)
        self.norm1 = torch_layer_norm(self.layer_norm_eps)
        self.norm2 = torch_layer_norm(self.layer_norm_eps)
        self.norm3 = torch_layer_norm(self.layer_norm_eps)
        self.linear1 = TorchDense(self.ffn_dim, kernel_init=self.kernel_init)
        self.linear2 = TorchDense(self.hidden_dim, kernel_init=self.kernel_init)
        # One Dropout module; every call draws a fresh mask.
        self.dropout = Dropout(self.dropout_rate)

    def _ffn(self, x: Array, deterministic: bool) -> Array:
        inner = self.dropout(nn.relu(self.linear1(x)), deterministic=deterministic)
        out = self.dropout(self.linear2(inner), deterministic=deterministic)
        return self.norm3(x + out)

    def __call__(
        self, h: Array, memory: Array, self_mask: Array, *, deterministic: bool = True
    ) -> tuple[Array, Array, Array]:
        sa = self.self_att(h, h, mask=self_mask, deterministic=deterministic)
        o1 = self.norm1(h + self.dropout(sa, deterministic=deterministic))
        ca = self.cross_att(o1, memory, deterministic=deterministic)
        o2 = self.norm2(o1 + self.dropout(ca, deterministic=deterministic))
        # Exposed for tests / analysis when 'intermediates' is mutable; a no-op otherwise.
        self.sow("intermediates", "self_att_out", o1)
        self.sow("intermediates", "cross_att_out", o2)
        # CCR means over ALL Lt positions, pads included (official CCR*.py:88,94; D-Q5).
        t = jnp.mean(o1, axis=1)
        v = jnp.mean(o2, axis=1)
        return self._ffn(o2, deterministic), t, v

    def init_cache(self, memory: Array, max_len: int) -> None:
        self.self_att.init_self_cache(memory.shape[0], max_len)
        self.cross_att.init_cross_cache(memory)

    def step(self, h: Array, index: Array) -> Array:
        """One position (B, 1, E) at ``index``, attending to the cached prefix; eval mode."""
        o1 = self.norm1(h + self.self_att.step_self(h, index))
        o2 = self.norm2(o1 + self.cross_att.step_cross(o1))
        return self._ffn(o2, True)


class CCRDecoder(nn.Module):
    """§4.2: ``embed_fc`` memory fusion, word embedding + sinusoid PE -> ``fc``, decoder layers,
    ``logit``. ``variant`` picks CCR_no_init (CLEVR-Change) or CCR (CLEVR-DC)."""

    vocab_size: int
    max_len: int
    variant: str = "clevr_change"
    hidden_dim: int = 512
    num_heads: int = 8
    num_layers: int = 2
    word_dim: int = 300
    ffn_dim: int = 2048
    dropout_rate: float = 0.1
    layer_norm_eps: float = 1e-5

    def setup(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        dc = self.variant == "clevr_dc"
        kernel_init = xavier_uniform if dc else torch_default_kernel_init
        self.embed = nn.Embed(
            self.vocab_size,
            self.word_dim,
            embedding_init=xavier_uniform if dc else normal_zero_pad_init,
        )
        # Fixed buffer core.position_enc.pe: a constant, never trained.
        self.pe = sinusoid_table(self.max_len, self.word_dim, np.float64)
        self.fc_0 = TorchDense(self.hidden_dim, kernel_init=kernel_init)
        self.embed_fc_0 = TorchDense(self.hidden_dim, kernel_init=kernel_init)
        if dc:
            self.fc_1 = torch_layer_norm(self.layer_norm_eps)
            self.embed_fc_1 = torch_layer_norm(self.layer_norm_eps)
        self.dropout = Dropout(self.dropout_rate)
        self.layer = [
            CCRLayer(
                self.hidden_dim,
                self.num_heads,
                self.ffn_dim,
                self.dropout_rate,
                kernel_init,
                self.layer_norm_eps,
            )
            for _ in range(self.num_layers)
        ]
        self.logit = TorchDense(self.vocab_size, kernel_init=kernel_init)

    @property
    def _has_layer_norms(self) -> bool:
        return self.variant == "clevr_dc"

    def memory(self, diff_before: Array, diff_after: Array, *, deterministic: bool = True) -> Array:
        """``embed_fc``: cat(diff_bef, diff_aft) -> Linear [-> LN] -> Dropout -> ReLU."""
        x = self.embed_fc_0(jnp.concatenate([diff_before, diff_after], axis=-1))
        if self._has_layer_norms:
            x = self.embed_fc_1(x)
        return nn.relu(self.dropout(x, deterministic=deterministic))

    def embed_words(self, ids: Array, pe: Array, deterministic: bool) -> Array:
        """``fc``(embed(ids) + pe): Linear [-> LN] -> Dropout."""
        words = self.embed(ids)
        x = self.fc_0(words + pe.astype(words.dtype))  # the PE table is float64
        if self._has_layer_norms:
            x = self.fc_1(x)
        return self.dropout(x, deterministic=deterministic)

    def __call__(self, memory: Array, ids: Array, *, train: bool) -> tuple[Array, Array, Array]:
        """Teacher-forced pass: ids (B, Lt) -> logits (B, Lt, V) and the last layer's (t, v)."""
        deterministic = not train
        h = teacher_forced_words(self, ids, deterministic)
        self_mask = make_attention_mask(ids.shape[1], streams.caption_mask(ids), causal=True)
        t = v = None
        for layer in self.layer:
            # Only the last layer's (t, v) enter the CCR loss (§4.2, D-Q6).
            h, t, v = layer(h, memory, self_mask, deterministic=deterministic)
        return self.logit(h), t, v

    def init_cache(self, memory: Array, max_len: int) -> None:
        init_layer_caches(self, memory, max_len)

    def step(self, token: Array, index: Array) -> Array:
        """token (B,) at position ``index`` -> next-token logits (B, V); eval mode."""
        return cached_step(self, token, index)


# --------------------------------------------------------------------------------------------
# Top module
# --------------------------------------------------------------------------------------------


class DIRLCCR(contract.TrunkModel, DelegatedDecoding):
    """DIRL encoder + CCR decoder; every hyperparameter is a field (defaults = the paper).

    The input feature width (1024 + 2 coordinates on CLEVR-Change) and the grid size are read
    from the batch. ``pairs="both"`` trains on the semantic and the distractor pair
    (CLEVR-Change); ``"semantic_only"`` on the semantic pair alone (CLEVR-DC).
    """

    # The decoder memory holds one slot per grid cell, from both images (models/base.py).
    MEMORY_LAYOUT: ClassVar[str] = "shared_grid"
    capabilities: ClassVar[frozenset[str]] = frozenset({contract.CHECK_DATASET,
                                                        contract.CLASSIFY_CHANGE})

    vocab_size: int
    max_len: int
    variant: str = "clevr_change"
    pairs: str = "both"
    use_coordinates: bool = True
    hidden_dim: int = 512
    num_heads: int = 8
    encoder_layers: int = 2
    decoder_layers: int = 2
    word_dim: int = 300
    ffn_dim: int = 2048
    mlp_hidden_dim: int = 2048
    dropout_rate: float = 0.1
    off_diagonal_weight: float = 0.003
    layer_norm_eps: float = 1e-5
    # Tables 6-7 ablations (module docstring); the defaults are the full model.
    use_dirl: bool = True
    use_ccr: bool = True
    on_diagonal_weight: float = 1.0
    # Plug-in (module docstring): MEDIC's fields and ``dataset_types``, or None (off).
    medic: Any = None

    def setup(self) -> None:
        streams.check_pairs(self.pairs)
        self.plugin = medic.from_config(self.medic, self.hidden_dim)
        self.encoder = DIRLEncoder(
            hidden_dim=self.hidden_dim,
            num_heads=self.num_heads,
            num_layers=self.encoder_layers,
            mlp_hidden_dim=self.mlp_hidden_dim,
            dropout_rate=self.dropout_rate,
            layer_norm_eps=self.layer_norm_eps,
        )
        self.decoder = CCRDecoder(
            vocab_size=self.vocab_size,
            max_len=self.max_len,
            variant=self.variant,
            hidden_dim=self.hidden_dim,
            num_heads=self.num_heads,
            num_layers=self.decoder_layers,
            word_dim=self.word_dim,
            ffn_dim=self.ffn_dim,
            dropout_rate=self.dropout_rate,
            layer_norm_eps=self.layer_norm_eps,
        )

    def _features(self, x: Array) -> Array:
        return grid_input(x, self.use_coordinates)

    def __call__(
        self, batch: dict[str, Array], *, train: bool, axis_name: str | None = None
    ) -> ModelOutput:
        streams.validate_batch(batch, self.streams, model="DIRLCCR")
        # The before image is the same in both pairs: its per-image layers run once per
        # example, not once per pair as in the official loop (docs/models.md, "The before
        # image once per example").
        before = self.encoder.embed_image(self._features(batch["before"]), train=train,
                                          with_mlp=self.use_dirl)
        logits, targets, dirl, ccr, plugin = {}, {}, [], [], []
        for stream, after, ids in streams.stream_pairs(batch, self.streams):
            enc = self.encoder(before, self._features(after), train=train)
            labels = None if self.plugin is None else medic.stream_labels(
                batch, self.medic, stream, self.plugin.type_names)
            if self.use_dirl:
                dirl.append(
                    losses.barlow_correlation_loss(
                        enc.mlp_before,
                        enc.mlp_after,
                        off_diagonal_weight=self.off_diagonal_weight,
                        on_diagonal_weight=self.on_diagonal_weight,
                        axis_name=axis_name,
                    )
                )
            memory, plugin_losses = self._memory(enc, after.shape[1:3], labels, train=train,
                                                 axis_name=axis_name)
            plugin.append(plugin_losses)
            logits[stream], t, v = self.decoder(memory, ids, train=train)
            targets[stream] = streams.make_caption_targets(ids)
            if self.use_ccr:
                ccr.append(losses.ccr_infonce_loss(t, v, axis_name=axis_name))
        # Equal-weight mean of the pairs: 0.5/0.5 on CLEVR-Change, the single pair on DC (§4.3).
        aux = {name: sum(terms) / len(terms) for name, terms in (("dirl", dirl), ("ccr", ccr))
               if terms}
        for name in plugin[0]:  # MEDIC's losses, the same mean of the pairs
            aux[name] = sum(p[name] for p in plugin) / len(plugin)
        return ModelOutput(caption_logits=logits, caption_targets=targets, aux_losses=aux)

    def _memory(self, enc: EncoderOutput, grid_hw: tuple[int, int], labels: Array | None, *,
                train: bool, axis_name: str | None = None) -> tuple[Array, dict[str, Array]]:
        """The decoder memory; with the plug-in, from the difference features and MEDIC's
        expert features (cat(diff_bef, diff_aft) ++ experts), and MEDIC's losses."""
        if self.plugin is None:
            return self.decoder.memory(enc.diff_before, enc.diff_after,
                                       deterministic=not train), {}
        out = self.plugin(enc.diff_before, enc.diff_after, tuple(grid_hw), labels, train=train,
                          axis_name=axis_name)
        paired = jnp.concatenate([enc.diff_before, enc.diff_after], axis=-1)
        return self.decoder.memory(paired, out.features, deterministic=not train), out.losses

    def check_dataset(self, meta: Any) -> None:
        """Capability ``check_dataset``: MEDIC refuses a dataset without its change types."""
        medic.check_host_dataset(self.medic, meta)

    @property
    def change_type_names(self) -> tuple[str, ...]:
        """Capability ``classify_change``: MEDIC's type names; empty without the plug-in."""
        return medic.type_names(self.medic)

    def classify_change(self, before: Array, after: Array) -> tuple[Array, Array]:
        """Capability ``classify_change``: MEDIC's router on the pair's difference features
        (eval mode): change logits (B, 2), 1 = change, and type logits (B, K)."""
        if self.plugin is None:
            raise ValueError("classify_change needs model.medic (this DIRL has no router)")
        embedded = self.encoder.embed_image(self._features(before), train=False, with_mlp=False)
        enc = self.encoder(embedded, self._features(after), train=False)
        return self.plugin.route(enc.diff_before, enc.diff_after, tuple(after.shape[1:3]))

    # ---- decoding protocol (init_cache, decode_step, decode: DelegatedDecoding) -------

    def encode(self, before: Array, after: Array, *, train: bool = False) -> Array:
        """(B, H, W, C) before/after features -> decoder memory (B, H*W, hidden)."""
        embedded = self.encoder.embed_image(self._features(before), train=train, with_mlp=False)
        enc = self.encoder(embedded, self._features(after), train=train)
        return self._memory(enc, after.shape[1:3], None, train=train)[0]
