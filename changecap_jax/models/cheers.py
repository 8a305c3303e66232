"""CHEERS (2025): change entity-guided heterogeneous representation disentangling.

Written from the paper alone (Li et al., 2025, method in paper §3); no code was released.
Equation numbers (Eq. n) are the paper's. Where the paper is silent we chose, say so here, and
expose the choice as a field.

Method
------
0. Inputs. Each image's grid (B, H, W, C) goes through a 1x1 projection to ``hidden_dim`` plus
   the learned 2-D grid position embedding of the trunk (as SCORER/DIRL), giving F_bef, F_aft
   (B, N, d), N = H*W. The k retrieved change entities of the pair (paper §3.1, made by
   ``data_prep.retrieval``; CLIP text embeddings in the paper) come in as (B, k, D_e) and are
   projected to d by one Linear: E (B, k, d). [choice: a projection is needed because CRE/DRE
   compare E with image features position by position.]
1. CRE / DRE (paper §3.2.1-3.2.2), one module :class:`RepresentationEnhancement` with a ``mode``.
   For a target T (B, Nt, d) and a source S (B, Ns, d):
     Sim(i, j) = cos(T_i, S_j);  P(i, j) = softmax_j Sim(i, j)                           (Eq. 2)
     P_hat(i) = Linear(max_j P(i, j))          [CRE, "common"]                           (Eq. 3)
     P_hat(i) = Linear(1 - max_j P(i, j))      [DRE, "difference"]                       (Eq. 5)
     T' = LN(sigmoid(P_hat) * T + T)                                                     (Eq. 4)
   The Linear maps the scalar to d channels ("expanded to the same dimensions as F_target").
   We read Eq. 2's normaliser as the sum over the source positions of row i (a softmax per
   target position). ``similarity_scale`` multiplies Sim before the softmax (1 = as printed).
   As printed, cosines in [-1, 1] over N = 64 source positions keep max_j P(i, j) within
   [1/64, 0.105], and the trained synthetic model's CRE/DRE gates vary over positions by a
   std of ~5e-4 (against ~0.11 over channels): a fixed per-channel gain before the LN
   (docs/ablations.md, "CHEERS, measured piece by piece"). A larger scale spreads them; its
   effect on the captions is not measured yet, so the presets keep 1.
2. One HRD layer (paper §3.2.3, :class:`HRDLayer`), the module call CRE(source, target):
     C_i = CRE(F_j, F_i),  C'_i = DRE(E, F_i)                                            (Eq. 6)
     L_C = MSE(P_hat of CRE, P_hat of DRE)                                               (Eq. 7)
     C~_i = MHCA(C_i, C_j)                                                               (Eq. 8)
     L_I = InfoNCE(q, k+)                                                                (Eq. 9)
     D_i = DRE(F_i, F_i - C~_i),  D'_i = CRE(E, F_i - C~_i)                              (Eq. 10)
     L_D = MSE(P_hat of DRE, P_hat of CRE)                                               (Eq. 11)
   "Each HRD layer includes two CRE and two DRE" (Fig. 2): one CRE and one DRE act on
   image-image pairs, one of each on image-entity pairs; each is shared by the before and the
   after direction, as DIRL/SCORER share their cross layers. C'_i and D'_i serve only their
   probability maps (the paper: "instead of directly using the output features"). The MSE
   terms are averaged over the two directions.
   Choices: MHCA (Eq. 8) is the trunk's cross-attention sub-layer LN(x + Dropout(MHA(x, y)))
   (``attention_residual``; False = the bare MHA output). Eq. 9 does not say what q and k+ are:
   we take q = the mean over positions of C~_bef and k+ = that of C~_aft of the same pair
   (the two views of one scene, as in SCORER's cross-view contrast the paper cites), the other
   pairs' k in the GLOBAL batch are the negatives, cosine similarity, temperature
   ``infonce_temperature`` (0.07, CLIP's initial value, which SCORER also starts from).
   Stacked layers (``hrd_layers``, Fig. 6) feed D_bef, D_aft on as the next layer's F; the
   losses are averaged over layers.
3. Fusion: F_diff = Linear(Concat[D_bef; D_aft]) over channels, then dropout        (Eq. 12).
   ``fusion_activation="relu"`` adds a ReLU after the dropout, as the DIRL/SCORER memory
   (Linear -> dropout -> ReLU) that CHEERS otherwise follows; "none" is Eq. 12 as printed.
4. Gated decoder (paper §3.3, :class:`GatedDecoderLayer`): word embedding + fixed sinusoid PE, a
   Linear to d, then per layer
     H' = LN(H + SelfAttention(H))          (causal; the residual + LN is our choice)
     H^T = MHCA(H', E, E),  H^V = MHCA(H', F_diff, F_diff)                               (Eq. 13)
     alpha = g(Linear(Concat[H'; H^T])),  beta = g(Linear(Concat[H'; H^V]))        (Eq. 14-15)
     H^F = alpha * H^T + beta * H^V                                                     (Eq. 16)
     H_n = LN(H^F + H')                                                                 (Eq. 17)
   followed by the usual FFN sub-layer LN(x + FFN(x)) (``decoder_ffn``; the paper does not
   mention it, Vaswani's layer has it). alpha and beta are one scalar per position; g is the
   ``gate_activation``: "sigmoid" (default: each gate in (0, 1), independent), "softmax"
   (alpha + beta = 1) or "identity" (as printed, no activation).
5. Loss (Eq. 19): L = L_S + lambda_v (L_C + L_D) + lambda_m L_I. The model returns
   ``consistency`` = L_C + L_D and ``infonce`` = L_I; the config's loss_weights carry lambda_v
   = 0.75 and lambda_m = 0.50 (Table 5's best).

Ablations (Table 4) are switches: ``use_cre`` (Eq. 6 left: C_i = F_i when off), ``use_dre``
(Eq. 10 left: D_i = F_i - C~_i when off), ``entity_consistency`` (the image-entity CRE/DRE and
L_C, L_D; needs both) and ``use_gate`` (off: H_n = LN(H^V + H'), no entity attention). With
``entity_consistency`` off the ``consistency`` loss is a constant 0. A model that uses neither
entity path reads no entities at all.

Streams: like DIRL, ``pairs="both"`` trains on the semantic and the distractor pair of
CLEVR-Change style data (each with its own retrieved entities); aux losses are their means.
"""

from __future__ import annotations

from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from changecap_jax.data import streams
from changecap_jax.models import contract, losses
from changecap_jax.models.base import ModelOutput
from changecap_jax.models.decoder import cached_step, check_decode_length, teacher_forced_words
from changecap_jax.models.dropout import Dropout
from changecap_jax.models.layers import (
    GridPositionEmbedding,
    MultiheadAttention,
    TorchDense,
    embed_grid,
    grid_input,
    make_attention_mask,
    model_input,
    sinusoid_table,
    torch_layer_norm,
)

Array = jax.Array

MODES = ("common", "difference")
GATE_ACTIVATIONS = ("sigmoid", "softmax", "identity")
FUSION_ACTIVATIONS = ("none", "relu")


def cosine_similarity(a: Array, b: Array, eps: float = 1e-8) -> Array:
    """(B, Na, d), (B, Nb, d) -> (B, Na, Nb) cosine similarities."""
    norm = lambda x: x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), eps)
    return jnp.einsum("bid,bjd->bij", norm(a), norm(b))


class RepresentationEnhancement(nn.Module):
    """CRE (``mode="common"``, Eq. 2-4) or DRE (``mode="difference"``, Eq. 5 for Eq. 3).

    Called as ``(source, target)``; returns (T', P_hat), P_hat (B, Nt, d) before the sigmoid.
    """

    hidden_dim: int
    mode: str
    similarity_scale: float = 1.0
    layer_norm_eps: float = 1e-5

    def setup(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        self.expand = TorchDense(self.hidden_dim)  # Eq. 3 / 5: scalar -> d channels
        self.norm = torch_layer_norm(self.layer_norm_eps)

    def __call__(self, source: Array, target: Array) -> tuple[Array, Array]:
        similarity = cosine_similarity(target, source).astype(jnp.float32)  # softmax in f32
        probs = jax.nn.softmax(self.similarity_scale * similarity, -1).astype(target.dtype)
        strongest = jnp.max(probs, axis=-1, keepdims=True)  # (B, Nt, 1)
        if self.mode == "difference":
            strongest = 1.0 - strongest
        p_hat = self.expand(strongest)
        return self.norm(jax.nn.sigmoid(p_hat) * target + target), p_hat


class CrossAttentionBlock(nn.Module):
    """MHCA(x, y): LN(x + Dropout(MHA(q=x, k=v=y))), or the bare MHA without ``residual``."""

    hidden_dim: int
    num_heads: int
    dropout_rate: float
    residual: bool = True
    layer_norm_eps: float = 1e-5

    def setup(self) -> None:
        self.attention = MultiheadAttention(self.hidden_dim, self.num_heads,
                                            dropout_rate=self.dropout_rate)
        if self.residual:
            self.norm = torch_layer_norm(self.layer_norm_eps)
        self.dropout = Dropout(self.dropout_rate)

    def __call__(self, x: Array, y: Array, *, deterministic: bool) -> Array:
        attended = self.attention(x, y, deterministic=deterministic)
        if not self.residual:
            return attended
        return self.norm(x + self.dropout(attended, deterministic=deterministic))


class HRDLayer(nn.Module):
    """One heterogeneous representation disentangling layer (Eq. 6-11); see the module doc.

    Returns (D_bef, D_aft, L_C + L_D, (q, k) for Eq. 9).
    """

    hidden_dim: int
    num_heads: int
    dropout_rate: float
    use_cre: bool = True
    use_dre: bool = True
    entity_consistency: bool = True
    attention_residual: bool = True
    similarity_scale: float = 1.0
    layer_norm_eps: float = 1e-5

    def setup(self) -> None:
        enhancement = lambda mode: RepresentationEnhancement(
            self.hidden_dim, mode, self.similarity_scale, self.layer_norm_eps)
        if self.use_cre:
            self.image_cre = enhancement("common")  # Eq. 6: C_i = CRE(F_j, F_i)
        if self.use_dre:
            self.image_dre = enhancement("difference")  # Eq. 10: D_i = DRE(F_i, F_i - C~_i)
        if self.entity_consistency:
            self.entity_dre = enhancement("difference")  # Eq. 6: C'_i = DRE(E, F_i)
            self.entity_cre = enhancement("common")  # Eq. 10: D'_i = CRE(E, F_i - C~_i)
        self.mhca = CrossAttentionBlock(self.hidden_dim, self.num_heads, self.dropout_rate,
                                        self.attention_residual, self.layer_norm_eps)

    def __call__(self, f_bef: Array, f_aft: Array, entities: Array | None, *,
                 deterministic: bool, axis_name: str | None = None,
                 ) -> tuple[Array, Array, Array, tuple[Array, Array]]:
        consistency = jnp.zeros((), jnp.float32)
        mse = lambda a, b: losses.mean_squared_error(a, b, axis_name=axis_name)
        # Eq. 6-7: highlight what the two images share; the entities agree on where that is.
        if self.use_cre:
            c_bef, p_bef = self.image_cre(f_aft, f_bef)
            c_aft, p_aft = self.image_cre(f_bef, f_aft)
        else:
            c_bef, c_aft = f_bef, f_aft
        if self.entity_consistency:
            _, pe_bef = self.entity_dre(entities, f_bef)
            _, pe_aft = self.entity_dre(entities, f_aft)
            consistency += (mse(p_bef, pe_bef) + mse(p_aft, pe_aft)) / 2  # L_C
        # Eq. 8: the images attend to each other's common features (one block, both ways).
        ct_bef = self.mhca(c_bef, c_aft, deterministic=deterministic)
        ct_aft = self.mhca(c_aft, c_bef, deterministic=deterministic)
        contrast = (jnp.mean(ct_bef, axis=1), jnp.mean(ct_aft, axis=1))  # Eq. 9's q, k+
        # Eq. 10-11: what is left after removing the common part, enhanced as a difference.
        r_bef, r_aft = f_bef - ct_bef, f_aft - ct_aft
        if self.use_dre:
            d_bef, q_bef = self.image_dre(f_bef, r_bef)
            d_aft, q_aft = self.image_dre(f_aft, r_aft)
        else:
            d_bef, d_aft = r_bef, r_aft
        if self.entity_consistency:
            _, qe_bef = self.entity_cre(entities, r_bef)
            _, qe_aft = self.entity_cre(entities, r_aft)
            consistency += (mse(q_bef, qe_bef) + mse(q_aft, qe_aft)) / 2  # L_D
        return d_bef, d_aft, consistency, contrast


class GatedDecoderLayer(nn.Module):
    """Eq. 13-17 (+ FFN); ``use_gate=False`` is Table 4's decoder without entities."""

    hidden_dim: int
    num_heads: int
    ffn_dim: int
    dropout_rate: float
    use_gate: bool = True
    gate_activation: str = "sigmoid"
    ffn: bool = True
    layer_norm_eps: float = 1e-5

    def setup(self) -> None:
        if self.gate_activation not in GATE_ACTIVATIONS:
            raise ValueError(f"gate_activation must be one of {GATE_ACTIVATIONS}, got "
                             f"{self.gate_activation!r}")
        attention = lambda **kw: MultiheadAttention(self.hidden_dim, self.num_heads,
                                                    dropout_rate=self.dropout_rate, **kw)
        self.self_att = attention()
        self.visual_att = attention(sow_probs=True)  # the heatmap hook (models/base.py)
        if self.use_gate:
            self.entity_att = attention()
            self.alpha = TorchDense(1)  # Eq. 14
            self.beta = TorchDense(1)  # Eq. 15
        self.norm1 = torch_layer_norm(self.layer_norm_eps)
        self.norm2 = torch_layer_norm(self.layer_norm_eps)
        if self.ffn:
            self.linear1 = TorchDense(self.ffn_dim)
            self.linear2 = TorchDense(self.hidden_dim)
            self.norm3 = torch_layer_norm(self.layer_norm_eps)
        self.dropout = Dropout(self.dropout_rate)

    def gates(self, h1: Array, h_text: Array, h_vis: Array) -> tuple[Array, Array]:
        """alpha, beta (B, L, 1) from Eq. 14-15 and the chosen activation."""
        a = self.alpha(jnp.concatenate([h1, h_text], axis=-1))
        b = self.beta(jnp.concatenate([h1, h_vis], axis=-1))
        if self.gate_activation == "sigmoid":
            return jax.nn.sigmoid(a), jax.nn.sigmoid(b)
        if self.gate_activation == "softmax":
            both = jax.nn.softmax(jnp.concatenate([a, b], axis=-1).astype(jnp.float32),
                                  axis=-1).astype(a.dtype)
            return both[..., :1], both[..., 1:]
        return a, b

    def _fuse(self, h1: Array, h_vis: Array, h_text: Array | None, deterministic: bool) -> Array:
        if self.use_gate:
            alpha, beta = self.gates(h1, h_text, h_vis)
            fused = alpha * h_text + beta * h_vis  # Eq. 16
        else:
            fused = h_vis
        h = self.norm2(h1 + self.dropout(fused, deterministic=deterministic))  # Eq. 17
        if not self.ffn:
            return h
        inner = self.dropout(nn.relu(self.linear1(h)), deterministic=deterministic)
        return self.norm3(h + self.dropout(self.linear2(inner), deterministic=deterministic))

    def __call__(self, h: Array, visual: Array, entities: Array | None, self_mask: Array, *,
                 deterministic: bool) -> Array:
        sa = self.self_att(h, h, mask=self_mask, deterministic=deterministic)
        h1 = self.norm1(h + self.dropout(sa, deterministic=deterministic))
        h_vis = self.visual_att(h1, visual, deterministic=deterministic)  # Eq. 13
        h_text = (self.entity_att(h1, entities, deterministic=deterministic)
                  if self.use_gate else None)
        return self._fuse(h1, h_vis, h_text, deterministic)

    def init_cache(self, visual: Array, entities: Array | None, max_len: int) -> None:
        self.self_att.init_self_cache(visual.shape[0], max_len)
        self.visual_att.init_cross_cache(visual)
        if self.use_gate:
            self.entity_att.init_cross_cache(entities)

    def step(self, h: Array, index: Array) -> Array:
        h1 = self.norm1(h + self.self_att.step_self(h, index))
        h_vis = self.visual_att.step_cross(h1)
        h_text = self.entity_att.step_cross(h1) if self.use_gate else None
        return self._fuse(h1, h_vis, h_text, True)


class CHEERS(contract.TrunkModel, nn.Module):
    """The full model: grid embedding, entity projection, HRD layers, fusion, gated decoder.

    The input feature width and grid size come from the batch; the entities' count and width
    are fields (``num_entities``, ``entity_dim``), since they shape the parameters.
    """

    # Decoder memory slot n is grid cell n of both images (F_diff fuses them per position).
    MEMORY_LAYOUT: ClassVar[str] = "shared_grid"
    capabilities: ClassVar[frozenset[str]] = frozenset()

    vocab_size: int
    max_len: int
    pairs: str = "both"
    use_coordinates: bool = False
    hidden_dim: int = 512
    num_heads: int = 8
    hrd_layers: int = 2
    decoder_layers: int = 2
    word_dim: int = 300
    ffn_dim: int = 2048
    dropout_rate: float = 0.1
    num_entities: int = 3
    entity_dim: int = 768
    # Table 4 switches
    use_cre: bool = True
    use_dre: bool = True
    entity_consistency: bool = True
    use_gate: bool = True
    # The paper's silences (module docstring)
    gate_activation: str = "sigmoid"
    attention_residual: bool = True
    decoder_ffn: bool = True
    similarity_scale: float = 1.0
    infonce_temperature: float = 0.07
    fusion_activation: str = "none"
    layer_norm_eps: float = 1e-5

    def setup(self) -> None:
        streams.check_pairs(self.pairs)
        if self.fusion_activation not in FUSION_ACTIVATIONS:
            raise ValueError(f"fusion_activation must be one of {FUSION_ACTIVATIONS}, got "
                             f"{self.fusion_activation!r}")
        if self.entity_consistency and not (self.use_cre and self.use_dre):
            raise ValueError("entity_consistency compares the image CRE and DRE maps with the "
                             "entity ones (Eq. 7, 11): it needs use_cre=True and use_dre=True")
        self.img = TorchDense(self.hidden_dim)
        self.pos_embedding = GridPositionEmbedding(self.hidden_dim)
        if self.reads_entities:
            self.entity_proj = TorchDense(self.hidden_dim)
        self.hrd = [
            HRDLayer(self.hidden_dim, self.num_heads, self.dropout_rate, self.use_cre,
                     self.use_dre, self.entity_consistency, self.attention_residual,
                     self.similarity_scale, self.layer_norm_eps)
            for _ in range(self.hrd_layers)
        ]
        self.fusion = TorchDense(self.hidden_dim)  # Eq. 12
        self.embed = nn.Embed(self.vocab_size, self.word_dim)
        self.pe = sinusoid_table(self.max_len, self.word_dim)  # fixed, not a parameter
        self.word_fc = TorchDense(self.hidden_dim)
        self.layer = [
            GatedDecoderLayer(self.hidden_dim, self.num_heads, self.ffn_dim, self.dropout_rate,
                              self.use_gate, self.gate_activation, self.decoder_ffn,
                              self.layer_norm_eps)
            for _ in range(self.decoder_layers)
        ]
        self.logit = TorchDense(self.vocab_size)
        self.dropout = Dropout(self.dropout_rate)

    @property
    def reads_entities(self) -> bool:
        return self.entity_consistency or self.use_gate

    @property
    def conditioning_shapes(self) -> dict[str, tuple[int, ...]]:
        """The per-pair inputs beside the images (models/base.py): the retrieved entities."""
        return {"entities": (self.num_entities, self.entity_dim)} if self.reads_entities else {}

    # ---- encoder ----------------------------------------------------------------------------

    def _embed_grid(self, grid: Array) -> Array:
        return embed_grid(self.img, self.pos_embedding, grid_input(grid, self.use_coordinates))

    def _entities(self, entities: Array | None) -> Array | None:
        if not self.reads_entities:
            return None
        want = (self.num_entities, self.entity_dim)
        if entities is None or tuple(entities.shape[1:]) != want:
            got = None if entities is None else tuple(entities.shape)
            raise ValueError(f"CHEERS reads retrieved entities of shape (B, {want[0]}, "
                             f"{want[1]}) (num_entities, entity_dim); got {got}")
        return self.entity_proj(model_input(entities))

    def _encode(self, before: Array, after: Array, entities: Array | None, *, train: bool,
                axis_name: str | None = None) -> tuple[tuple[Array, Array | None], dict]:
        """Embedded before tokens (:meth:`_embed_grid`), after grid -> ((F_diff, E),
        {"consistency", "infonce"})."""
        deterministic = not train
        e = self._entities(entities)
        f_bef, f_aft = before, self._embed_grid(after)
        consistency, infonce = [], []
        for layer in self.hrd:
            f_bef, f_aft, c, (q, k) = layer(f_bef, f_aft, e, deterministic=deterministic,
                                            axis_name=axis_name)
            consistency.append(c)
            infonce.append(losses.cosine_infonce_loss(q, k, self.infonce_temperature,
                                                      axis_name=axis_name))
        f_diff = self.fusion(jnp.concatenate([f_bef, f_aft], axis=-1))
        f_diff = self.dropout(f_diff, deterministic=deterministic)
        if self.fusion_activation == "relu":
            f_diff = nn.relu(f_diff)
        aux = {"consistency": sum(consistency) / len(consistency),
               "infonce": sum(infonce) / len(infonce)}
        return (f_diff, e), aux

    # ---- decoder ----------------------------------------------------------------------------

    def embed_words(self, ids: Array, pe: Array, deterministic: bool) -> Array:
        words = self.embed(ids)
        x = self.word_fc(words + pe.astype(words.dtype))
        return self.dropout(x, deterministic=deterministic)

    def _decode(self, memory: tuple[Array, Array | None], ids: Array, *, train: bool) -> Array:
        visual, entities = memory
        h = teacher_forced_words(self, ids, not train)
        self_mask = make_attention_mask(ids.shape[1], streams.caption_mask(ids), causal=True)
        for layer in self.layer:
            h = layer(h, visual, entities, self_mask, deterministic=not train)
        return self.logit(h)

    def __call__(self, batch: dict[str, Array], *, train: bool,
                 axis_name: str | None = None) -> ModelOutput:
        streams.validate_batch(batch, self.streams, model="CHEERS", check_ranks=False)
        logits, targets, aux = {}, {}, []
        # The before image is the same in both pairs: embedded once per example
        # (docs/models.md, "The before image once per example").
        before = self._embed_grid(batch["before"])
        for stream, after, ids in streams.stream_pairs(batch, self.streams):
            memory, stream_aux = self._encode(
                before, after, batch.get(f"entities_{stream}"),
                train=train, axis_name=axis_name)
            logits[stream] = self._decode(memory, ids, train=train)
            targets[stream] = streams.make_caption_targets(ids)
            aux.append(stream_aux)
        mean_aux = {k: sum(a[k] for a in aux) / len(aux) for k in aux[0]}
        return ModelOutput(caption_logits=logits, caption_targets=targets, aux_losses=mean_aux)

    # ---- decoding protocol (changecap_jax/decoding/search.py) ---

    def encode(self, before: Array, after: Array, *, train: bool = False,
               entities: Array | None = None) -> tuple[Array, Array | None]:
        """-> memory (F_diff (B, N, d), projected entities (B, k, d) or None)."""
        return self._encode(self._embed_grid(before), after, entities, train=train)[0]

    def init_cache(self, memory: tuple[Array, Array | None], max_len: int) -> None:
        check_decode_length(max_len, self.max_len)
        visual, entities = memory
        for layer in self.layer:
            layer.init_cache(visual, entities, max_len)

    def decode_step(self, token: Array, index: Array) -> Array:
        return cached_step(self, jnp.asarray(token, jnp.int32), index)

    def decode(self, memory: tuple[Array, Array | None], ids: Array, *,
               train: bool = False) -> Array:
        return self._decode(memory, jnp.asarray(ids, jnp.int32), train=train)
