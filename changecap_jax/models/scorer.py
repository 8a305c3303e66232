"""SCORER + CBR (Tu et al., ICCV 2023): self-supervised cross-view representation reconstruction
with cross-modal backward reasoning, as the official code ``tuyunbin/SCORER`` computes it.

Section numbers (§) and quirk ids (S-Q) refer to docs/official/ (index: docs/official/README.md);
"paper Eq. N" to the SCORER paper (Tu et al., ICCV 2023).

Method
------
1. Cross-view image pair encoding (paper Eq. 1; §3.1 steps 1-3). Each grid (B, H, W, C)
   (C = 1024 ResNet-101 layer3 channels, + 2 AddSpatialInfo coordinates on CLEVR-Change, §2.3)
   goes through a 1x1 projection to 512 (a Dense over channels), gets the learned 2-D grid
   position embedding added and is flattened row-major to tokens X0 (B, H*W, 512).
2. SCORER layers (paper Eq. 2-6; §3.1 step 4). Each layer projects q/k/v and reconstructs the
   unchanged features by multi-head cross-attention WITHOUT an output projection, followed by
   LN(ctx + x) (eps 1e-6). One layer's weights serve both directions and the update is
   simultaneous: (X1, X2) <- (Layer(X1, X2), Layer(X2, X1)).
3. View-invariant representation learning (paper Eq. 2-4; §3.1 step 4, §3.4). In the LAST layer
   only, the token-wise matching S = exp(logit_scale) * MTM(q, k) is formed over the global
   batch (:func:`changecap_jax.models.losses.matching_contrastive_loss`) for both directions: S1
   with
   the before-queries against the after-keys, S2 with the roles swapped;
   L_sim = 1/2 (rowCE(S1) + rowCE(S2)). MTM sums the heads before the max (S-Q2); the field
   ``matching`` replaces it by a variant of the paper's Fig. 3 (docs/ablations.md).
4. Difference representation (paper Eq. 7; §3.1 step 5): memory = ReLU(Dropout(Linear(
   cat(X1, X2)))), before first.
5. Caption generation (paper Eq. 8; §3.2): :class:`~changecap_jax.models.decoder.Speaker`.
6. CBR (paper Eq. 9-11; §3.3). The sentence vector s = the caption-masked SUM of the last
   decoder layer's output divided by the padded length Lt (S-Q8) is broadcast over the grid and
   concatenated with X0_bef (the features BEFORE the SCORER layers); conv1 (1x1) -> multi-head
   self-attention without biases, residual or LN -> conv2 (1x1) gives the "hallucination" H;
   L_cbr = 1/2 (rowCE(S) + rowCE(S^T)) with S = exp(ls_c) * MTM(query(H), key(X0_aft)), one
   matching whose transpose gives the second direction
   (:func:`changecap_jax.models.losses.symmetric_matching_contrastive_loss`).
7. Objective (§3.4). CLEVR-Change: the model runs on (before, after_semantic, change_caption) and
   (before, after_distractor, no_change_caption); each aux loss is the mean of the two pairs and
   the trainer adds cap + 0.1 sim + 0.001 cbr. The official optimiser never updates CBR (S-Q1):
   its params form the top-level group ``cbr``, which the paper presets freeze
   (``optim.frozen=("cbr",)``); the loss still trains the encoder and decoder through it. After
   every update :meth:`SCORERCBR.post_update` clamps the last layer's logit scale (and CBR's) to
   <= ln 100; the earlier layers' scales are never used (S-Q3).

Plug-in: ``medic`` (``config.model.medic``; docs/models.md "MEDIC on SCORER+CBR",
docs/adding_a_model.md "Plug-ins") switches on MEDIC (:mod:`changecap_jax.models.medic`). Its
router and experts read X1 and X2, the outputs of the last SCORER layer: the paired features
just before SCORER fuses them into one memory (step 4), as DIRL's diff_bef / diff_aft are just
before its ``embed_fc``. Its expert features join the fusion as in MEDIC's
``models/CCR_expert.py``, by concatenation: memory = ReLU(Dropout(Linear(cat(X1, X2, expert_bef,
expert_aft)))), so ``encoder/embed_fc_0`` reads 4 x hidden; its losses join ``aux_losses``. The
CBR target and X0 are untouched. Without ``medic`` the model is exactly the one above.

Official checkpoints (tuyunbin/SCORER) convert with ``changecap_jax/convert/models/scorer.py``.

Kernel row c of ``img_0`` is input channel c; with coordinates, rows C and C + 1 are the x and
y channels (the AddSpatialInfo order). Rows 0-511 of ``cbr/conv1/kernel`` read X0_bef and rows
512-1023 the sentence vector. ``decoder/embed/embedding`` row 0 must get a zero gradient (torch
``padding_idx=0``; the presets set ``optim.zero_grad_rows``); its value is NOT zero (S-Q7).

Decoding protocol (used by :mod:`changecap_jax.decoding.search`): ``encode``, ``init_cache``,
``decode_step``; ``decode`` is the full-recompute reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from changecap_jax.data import streams
from changecap_jax.models import contract, losses, medic
from changecap_jax.models.base import ModelOutput
from changecap_jax.models.decoder import DelegatedDecoding, multi_head_attend, speaker_for
from changecap_jax.models.dropout import Dropout
from changecap_jax.models.layers import (
    TorchDense,
    attention_context,
    attention_scores,
    embed_grid,
    grid_input,
    grid_position_embedding,
    in_proj_xavier_uniform,
    torch_layer_norm,
)
from changecap_jax.models.precision import at_least_float32

Array = jax.Array

LOGIT_SCALE_MAX = math.log(100.0)  # §3.4: exp(logit_scale) <= 100
LOGIT_SCALE_INIT = 1.0  # §3.5: torch.ones([]), i.e. a multiplier of e


def _scalar_init(value: float) -> Any:
    return lambda key, shape, dtype=jnp.float32: jnp.full(shape, value, dtype)


class MatchInputs(NamedTuple):
    """What one token-wise matching direction needs: S = exp(logit_scale) * MTM(query, key)."""

    query: Array  # (B, N, D) query projection of the query-side tokens
    key: Array  # (B, M, D) key projection of the other view's tokens
    logit_scale: Array  # () log of the multiplier


# --------------------------------------------------------------------------------------------
# Encoder ChangeDetector (§3.1)
# --------------------------------------------------------------------------------------------


class ScorerAttention(nn.Module):
    """torch ``scorer.{l}.attention``: q/k/v projections, the matching inputs with this layer's
    learnable ``logit_scale``, multi-head reconstruction without an output projection (paper
    Eq. 5), out = LN(ctx + x_q) (paper Eq. 6)."""

    hidden_dim: int
    num_heads: int
    dropout_rate: float = 0.1
    layer_norm_eps: float = 1e-6

    def setup(self) -> None:
        if self.hidden_dim % self.num_heads:
            raise ValueError(f"hidden_dim {self.hidden_dim} is not divisible by num_heads "
                             f"{self.num_heads}")
        self.logit_scale = self.param("logit_scale", _scalar_init(LOGIT_SCALE_INIT), ())
        self.query = TorchDense(self.hidden_dim)
        self.key = TorchDense(self.hidden_dim)
        self.value = TorchDense(self.hidden_dim)
        self.layer_norm = torch_layer_norm(self.layer_norm_eps)
        self.dropout = Dropout(self.dropout_rate)

    def __call__(
        self, x_q: Array, x_kv: Array, *, deterministic: bool = True
    ) -> tuple[Array, MatchInputs]:
        q, k, v = self.query(x_q), self.key(x_kv), self.value(x_kv)
        ctx = multi_head_attend(q, k, v, self.num_heads, dropout=self.dropout,
                                deterministic=deterministic)
        return self.layer_norm(ctx + x_q), MatchInputs(q, k, self.logit_scale)


class ScorerLayer(nn.Module):
    """torch ``scorer.{l}``: a wrapper holding ``attention``."""

    hidden_dim: int
    num_heads: int
    dropout_rate: float = 0.1
    layer_norm_eps: float = 1e-6

    def setup(self) -> None:
        self.attention = ScorerAttention(self.hidden_dim, self.num_heads, self.dropout_rate,
                                         self.layer_norm_eps)

    def __call__(
        self, x_q: Array, x_kv: Array, *, deterministic: bool = True
    ) -> tuple[Array, MatchInputs]:
        return self.attention(x_q, x_kv, deterministic=deterministic)


class EncoderOutput(NamedTuple):
    memory: Array  # (B, HW, hidden) difference representation, the decoder memory
    tokens_before: Array  # (B, HW, hidden) X0_bef: projected + PE, before the SCORER layers
    tokens_after: Array  # (B, HW, hidden) X0_aft
    # Last layer's matching inputs: (before-queries vs after-keys, after-queries vs before-keys).
    matching: tuple[MatchInputs, MatchInputs]


class ChangeDetector(nn.Module):
    """SCORER encoder (torch ``change_detector``), torch-default init (§3.5)."""

    hidden_dim: int = 512
    num_heads: int = 8
    num_layers: int = 2
    dropout_rate: float = 0.1
    layer_norm_eps: float = 1e-6

    def setup(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"SCORER needs at least one layer, got {self.num_layers}")
        self.img_0 = TorchDense(self.hidden_dim)  # 1x1 conv as a Dense over channels
        self.pos_embedding = grid_position_embedding(self.hidden_dim)
        self.scorer = [
            ScorerLayer(self.hidden_dim, self.num_heads, self.dropout_rate, self.layer_norm_eps)
            for _ in range(self.num_layers)
        ]
        self.embed_fc_0 = TorchDense(self.hidden_dim)
        self.dropout = Dropout(self.dropout_rate)

    def embed(self, grid: Array) -> Array:
        """(B, H, W, C) -> X0 (B, H*W, hidden): 1x1 projection + grid PE (paper Eq. 1)."""
        return embed_grid(self.img_0, self.pos_embedding, grid)

    def __call__(self, before: Array, after: Array, *, train: bool,
                 join: Callable[[Array, Array], Array] | None = None) -> EncoderOutput:
        """``before`` comes embedded, X0_bef (:meth:`embed`): the model embeds it once for both
        pairs of an example; ``after`` is a grid (B, H, W, C). ``join(X1, X2)``: features a
        plug-in concatenates to cat(X1, X2) before the fusion (MEDIC's experts), or None."""
        deterministic = not train
        x1_0 = before
        x2_0 = self.embed(after)
        x1, x2 = x1_0, x2_0
        for layer in self.scorer:
            # Simultaneous update: both directions read the previous layer's (x1, x2). Only the
            # last layer's matching inputs are used (S-Q3); the official code also computes the
            # earlier layers' S and discards it, which changes no output or gradient.
            (x1, match1), (x2, match2) = (
                layer(x1, x2, deterministic=deterministic),
                layer(x2, x1, deterministic=deterministic),
            )
        paired = [x1, x2] if join is None else [x1, x2, join(x1, x2)]
        fused = self.embed_fc_0(jnp.concatenate(paired, axis=-1))
        memory = nn.relu(self.dropout(fused, deterministic=deterministic))
        return EncoderOutput(memory, x1_0, x2_0, (match1, match2))


# --------------------------------------------------------------------------------------------
# CBR (§3.3)
# --------------------------------------------------------------------------------------------


class BiasFreeSelfAttention(nn.Module):
    """torch ``nn.MultiheadAttention(D, H, bias=False)``, dropout 0, as self-attention: the
    in-projection (xavier over the stacked (3D, D) matrix) and the output projection have no
    biases; q is scaled by 1/sqrt(D/H) after its projection, as torch does."""

    embed_dim: int
    num_heads: int

    def setup(self) -> None:
        if self.embed_dim % self.num_heads:
            raise ValueError(f"embed_dim {self.embed_dim} is not divisible by num_heads "
                             f"{self.num_heads}")
        proj = lambda: TorchDense(self.embed_dim, kernel_init=in_proj_xavier_uniform,
                                  use_bias=False)
        self.q_proj, self.k_proj, self.v_proj = proj(), proj(), proj()
        self.out_proj = TorchDense(self.embed_dim, use_bias=False)

    def __call__(self, x: Array) -> Array:
        b, n, e = x.shape
        dh = e // self.num_heads
        split = lambda y: y.reshape(b, n, self.num_heads, dh)
        q = split(self.q_proj(x)) * (1.0 / math.sqrt(dh))
        k, v = split(self.k_proj(x)), split(self.v_proj(x))
        scores = at_least_float32(attention_scores(q, k))  # softmax in >= f32
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        ctx = attention_context(probs, v).reshape(b, n, e)
        return self.out_proj(ctx)


class ContraAttention(nn.Module):
    """torch ``contra``: query/key projections and the learnable ``logit_scale``."""

    hidden_dim: int

    def setup(self) -> None:
        self.logit_scale = self.param("logit_scale", _scalar_init(LOGIT_SCALE_INIT), ())
        self.query = TorchDense(self.hidden_dim)
        self.key = TorchDense(self.hidden_dim)

    def __call__(self, hallucination: Array, after: Array) -> MatchInputs:
        return MatchInputs(self.query(hallucination), self.key(after), self.logit_scale)


class CBR(nn.Module):
    """Cross-modal backward reasoning (torch ``generator``, §3.3), torch-default init.

    ``mean_by_length=True`` is a fix of S-Q8: divide the masked sentence sum by the caption
    length (the paper's "mean-pooling") instead of the padded length Lt.
    """

    hidden_dim: int = 512
    num_heads: int = 8
    mean_by_length: bool = False

    def setup(self) -> None:
        self.conv1 = TorchDense(self.hidden_dim)
        self.mh_att = BiasFreeSelfAttention(self.hidden_dim, self.num_heads)
        self.conv2_0 = TorchDense(self.hidden_dim)
        self.contra = ContraAttention(self.hidden_dim)

    def sentence(self, sent: Array, mask: Array) -> Array:
        """(B, Lt, D), mask (B, Lt) -> s (B, D): the masked sum over Lt / Lt (S-Q8)."""
        mask = mask.astype(sent.dtype)[..., None]
        total = jnp.sum(sent * mask, axis=1)
        if self.mean_by_length:
            return total / jnp.maximum(jnp.sum(mask, axis=1), 1.0)
        return total / sent.shape[1]

    def hallucinate(self, before: Array, sent: Array, mask: Array) -> Array:
        """Paper Eq. 9-10: X0_bef (B, N, D), decoder output (B, Lt, D) -> H (B, N, D)."""
        s = self.sentence(sent, mask)
        s = jnp.broadcast_to(s[:, None, :], before.shape)
        h = self.conv1(jnp.concatenate([before, s], axis=-1))  # before = channels 0..D-1
        return self.conv2_0(self.mh_att(h))  # no residual, no LN

    def __call__(
        self, before: Array, sent: Array, after: Array, mask: Array, *,
        axis_name: losses.AxisName = None, chunk_size: int = 8,
    ) -> Array:
        """Paper Eq. 11: L_cbr = 1/2 (rowCE(S) + rowCE(S^T)), S = exp(ls_c) MTM(q(H), k(X0_aft))
        over the global batch; S^T is S transposed, not a second matching (§3.4 item 7)."""
        match = self.contra(self.hallucinate(before, sent, mask), after)
        return losses.symmetric_matching_contrastive_loss(
            match.query, match.key, match.logit_scale, axis_name=axis_name,
            chunk_size=chunk_size)


# --------------------------------------------------------------------------------------------
# Top module
# --------------------------------------------------------------------------------------------


def clamp_params(params: Any, paths: list[tuple[str, ...]], maximum: float) -> Any:
    """A copy of ``params`` with the leaves at ``paths`` clamped to <= ``maximum``."""

    def clamp(tree: Any, path: tuple[str, ...]) -> Any:
        if len(path) == 1:
            return {**tree, path[0]: jnp.minimum(tree[path[0]], maximum)}
        return {**tree, path[0]: clamp(tree[path[0]], path[1:])}

    for path in paths:
        params = clamp(params, path)
    return params


class SCORERCBR(contract.TrunkModel, DelegatedDecoding):
    """SCORER encoder + Speaker decoder + CBR; every hyperparameter is a field (defaults = the
    official CLEVR-Change config, transformer.yaml).

    The input feature width and the grid size are read from the batch. ``pairs="both"``
    trains on the semantic and the distractor pair (CLEVR-Change), ``"semantic_only"`` on the
    semantic pair alone. Ablations of the paper's Table 6: ``use_sim=False`` drops L_sim (RR),
    ``use_cbr=False`` drops CBR; ``config.loss_weights`` must then name the remaining losses
    (and ``optim.frozen`` must not name "cbr" when there is no CBR).
    ``match_chunk_size``: columns of the batch-wide matching per step (memory vs speed only).
    ``cbr_mean_by_length``: fix of S-Q8 (official: False).
    ``matching``: L_sim's similarity, the paper's Fig. 3 ablation (:data:`losses.MATCHINGS`,
    equations in :func:`changecap_jax.models.losses.matching_similarity`); "official" (S-Q2) is the
    official code's. CBR's matching stays the official one: Fig. 3 ablates the cross-view
    matching of view-invariant representation learning.
    ``encoder_heads``: heads of the SCORER layers (paper Fig. 4 sweeps "the head number of MTM
    and MHCA"; the decoder keeps ``num_heads``, paper §4.3, and so does CBR's MHSA); None =
    ``num_heads``. Under "official" matching the heads change only the MHCA.
    """

    # The decoder memory holds one slot per grid cell, from both images (models/base.py).
    MEMORY_LAYOUT: ClassVar[str] = "shared_grid"
    capabilities: ClassVar[frozenset[str]] = frozenset({
        contract.POST_UPDATE, contract.CHECK_DATASET, contract.CLASSIFY_CHANGE})

    vocab_size: int
    max_len: int
    pairs: str = "both"
    use_coordinates: bool = True
    hidden_dim: int = 512
    num_heads: int = 8
    encoder_layers: int = 2
    decoder_layers: int = 2
    word_dim: int = 300
    dropout_rate: float = 0.1
    layer_norm_eps: float = 1e-6
    use_sim: bool = True
    use_cbr: bool = True
    cbr_mean_by_length: bool = False
    match_chunk_size: int = 8
    matching: str = "official"
    encoder_heads: int | None = None
    # Plug-in (module docstring): MEDIC's fields and ``dataset_types``, or None (off).
    medic: Any = None

    @property
    def scorer_heads(self) -> int:
        """Heads of the SCORER layers (MHCA and, per subspace, MTM); None = ``num_heads``."""
        return self.num_heads if self.encoder_heads is None else self.encoder_heads

    def setup(self) -> None:
        streams.check_pairs(self.pairs)
        if self.matching not in losses.MATCHINGS:
            raise ValueError(f"matching must be one of {losses.MATCHINGS}, got "
                             f"{self.matching!r}")
        self.encoder = ChangeDetector(
            hidden_dim=self.hidden_dim,
            num_heads=self.scorer_heads,
            num_layers=self.encoder_layers,
            dropout_rate=self.dropout_rate,
            layer_norm_eps=self.layer_norm_eps,
        )
        self.decoder = speaker_for(self)
        self.plugin = medic.from_config(self.medic, self.hidden_dim)
        if self.use_cbr:
            self.cbr = CBR(self.hidden_dim, self.num_heads, self.cbr_mean_by_length)

    def _features(self, x: Array) -> Array:
        return grid_input(x, self.use_coordinates)

    def __call__(
        self, batch: dict[str, Array], *, train: bool, axis_name: losses.AxisName = None
    ) -> ModelOutput:
        streams.validate_batch(batch, self.streams, model=type(self).__name__)
        # The before image is the same in both pairs: embedded once per example
        # (docs/models.md, "The before image once per example").
        before = self.encoder.embed(self._features(batch["before"]))
        match_loss = lambda m: losses.matching_contrastive_loss(
            m.query, m.key, m.logit_scale, axis_name=axis_name, chunk_size=self.match_chunk_size,
            matching=self.matching, num_heads=self.scorer_heads)
        logits, targets, sim, cbr, plugin = {}, {}, [], [], []
        for stream, after, ids in streams.stream_pairs(batch, self.streams):
            labels = None if self.plugin is None else medic.stream_labels(
                batch, self.medic, stream, self.plugin.type_names)
            enc, plugin_losses, _ = self._encode(before, self._features(after), labels,
                                                 train=train, axis_name=axis_name)
            plugin.append(plugin_losses)
            logits[stream], sentence = self.decoder(enc.memory, ids, train=train)
            targets[stream] = streams.make_caption_targets(ids)
            if self.use_sim:
                s1, s2 = enc.matching
                sim.append(0.5 * (match_loss(s1) + match_loss(s2)))
            if self.use_cbr:
                cbr.append(self.cbr(enc.tokens_before, sentence, enc.tokens_after,
                                    streams.caption_mask(ids), axis_name=axis_name,
                                    chunk_size=self.match_chunk_size))
        # Equal-weight mean of the pairs: 1/2 pos + 1/2 neg on CLEVR-Change (§3.4).
        aux = {}
        if self.use_sim:
            aux["sim"] = sum(sim) / len(sim)
        if self.use_cbr:
            aux["cbr"] = sum(cbr) / len(cbr)
        for name in plugin[0]:  # MEDIC's losses, the same mean of the pairs
            aux[name] = sum(p[name] for p in plugin) / len(plugin)
        return ModelOutput(caption_logits=logits, caption_targets=targets, aux_losses=aux)

    def _encode(self, before: Array, after: Array, labels: Array | None, *, train: bool,
                axis_name: losses.AxisName = None
                ) -> tuple[EncoderOutput, dict[str, Array], medic.MEDICOutput | None]:
        """The encoder; with the plug-in, MEDIC on (X1, X2) joins the fusion (module
        docstring), and its losses and outputs come back too."""
        if self.plugin is None:
            return self.encoder(before, after, train=train), {}, None
        grid_hw, out = tuple(after.shape[1:3]), []

        def experts(x1: Array, x2: Array) -> Array:
            out.append(self.plugin(x1, x2, grid_hw, labels, train=train, axis_name=axis_name))
            return out[0].features

        enc = self.encoder(before, after, train=train, join=experts)
        return enc, out[0].losses, out[0]

    @property
    def change_type_names(self) -> tuple[str, ...]:
        """Capability ``classify_change``: MEDIC's type names; empty without the plug-in."""
        return medic.type_names(self.medic)

    def classify_change(self, before: Array, after: Array) -> tuple[Array, Array]:
        """Capability ``classify_change``: MEDIC's router on (X1, X2) (eval mode): change
        logits (B, 2), 1 = change, and type logits (B, K)."""
        if self.plugin is None:
            raise ValueError("classify_change needs model.medic (this SCORER has no router)")
        embedded = self.encoder.embed(self._features(before))
        out = self._encode(embedded, self._features(after), None, train=False)[2]
        return out.change_logits, out.type_logits

    def check_dataset(self, meta: Any) -> None:
        """Capability ``check_dataset``: MEDIC refuses a dataset without its change types."""
        medic.check_host_dataset(self.medic, meta)

    @nn.nowrap
    def post_update(self, params: Any) -> Any:
        """§3.4 / train.py:219-226: after each update clamp the LAST SCORER layer's
        ``logit_scale`` and CBR's ``contra.logit_scale`` to <= ln 100 (no lower bound)."""
        paths = [("encoder", f"scorer_{self.encoder_layers - 1}", "attention", "logit_scale")]
        if self.use_cbr:
            paths.append(("cbr", "contra", "logit_scale"))
        return clamp_params(params, paths, LOGIT_SCALE_MAX)

    # ---- decoding protocol (init_cache, decode_step, decode: DelegatedDecoding) -------

    def encode(self, before: Array, after: Array, *, train: bool = False) -> Array:
        """(B, H, W, C) before/after features -> decoder memory (B, H*W, hidden)."""
        return self._encode(self.encoder.embed(self._features(before)), self._features(after),
                            None, train=train)[0].memory
