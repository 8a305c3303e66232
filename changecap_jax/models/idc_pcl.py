"""IDC-PCL (Yao et al., AAAI 2022): image difference captioning with pre-training and
contrastive learning, as the official code ``yaolinli/IDC`` (``clver/``) computes it.

Section numbers (§) and quirk ids (I-Q) refer to docs/official/ (index: docs/official/README.md).

Method
------
1. Image difference encoder (§5.2). Each image's grid (N = 49 ResNet-101 layer4 cells, row-major,
   C = 2048) is projected by ``img_project`` (Linear C -> d, then Sigmoid) and embedded by the
   shared ``position_encoding``: + type embedding (img1 = 2, img2 = 4) + the non-standard sinusoid
   rows 0..N-1, then the custom LayerNorm (eps 1e-12) and dropout. A [CLS] word embedding with
   type 1 / 3 (no sinusoid) is put in front of each image. One shared 1-block single-image
   encoder runs on [CLS1; img1] and on [CLS2; img2]; a 1-block pair encoder runs on their
   concatenation, giving I (B, 2N+2, d) = [CLS1, img1, CLS2, img2].
2. Cross-modal transformer ``encoder`` (3 blocks) over [I; (CLS3, type 5); T], where the text T
   is word_embedding(ids) * sqrt(d) + type 6 + sinusoid rows 0..L-1. Every Transformer here
   applies its LayerNorm at the INPUT, then pre-LN blocks x += Drop(MHA(LN x)),
   x += Drop(FFN(LN x)), and has no final LayerNorm (I-Q3). The LayerNorm is the official custom
   one: unbiased std, eps added to the std (I-Q1).
3. Pre-training (§5.3): the sequence [I; CLS3; T] with no attention mask at all. MLM logits =
   ``output_layer`` at the text positions; MVCL regresses the image-token outputs back to C
   dimensions with ``feat_regress`` (Linear -> GELU(erf) -> LN(1e-12) -> y W^T + b with W TIED to
   ``img_project``'s kernel, I-Q4); FDA compares mean(CLS1, CLS2) with CLS3.
   With a cross-task classification source (paper A.3, ``fgvc_classes`` > 0)
   :meth:`IDCPCL.cross_task_classify` runs the image difference encoder alone: the pooled
   single-image encodings feed ``fgvc_classifier`` (d -> classes), the pooled pair encoding
   ``fgvc_matcher`` (2d -> 2, same class); the losses are in
   ``changecap_jax/trainers/pretraining.py``.
4. Fine-tuning (§5.4): the sequence [I; T] (no CLS3). Every query sees the 2N+2 image/CLS
   tokens, image queries see no text, text is causal. MLM logits at the text positions and the
   distractor logits ``pooler``(cat(CLS1, CLS2)).
5. Decoding (§5.5): after [BOS] + generated words, a [MASK] token is appended and the word is
   predicted at the MASK. Because text is causal and image tokens never see text, the
   generated tokens' keys/values never change; :meth:`IDCPCL.decode_step` feeds the last token
   and a fresh MASK (two queries), caches the token's keys/values and predicts at the MASK.

Embedding balance (the synthetic CPU presets only)
--------------------------------------------------
In the official embedding an image token is LN(sigmoid(W x + b) + type_pe[t] + sinusoid[p]),
type_pe ~ N(0, 1). On the synthetic grids at the CPU width (d = 128) the part that depends on
the image is about 5% of the token (per-position std over examples 0.05, token std 1): the
type and position rows swamp it, and within 1000 steps the model does not learn to compare
the two images. Trained alone (a diagnostic on the synthetic 4x4 grids) to tell an after image
that is a different scene from one with a single change, the distractor classifier stays at
chance for 300 steps; to tell an identical one from a changed one, for 1000. Two fields, 1.0
in the official model, rebalance it:
``image_feature_scale`` multiplies the features before ``img_project`` (so the sigmoid works
over its range, not near 0.5) and ``type_embedding_std`` is type_pe's init std. The CPU
presets' 16 and 0.02 raise the share to about 27%, and the different-scene task reaches 83%
held-out accuracy in 300 steps; either change alone stays near chance (51-52%). The
synthetic set's own task (one changed object vs a viewpoint/lighting distractor) is still not
learnt at the CPU budgets measured (up to 3000 fine-tuning steps): the training loss falls by
memorising the training scenes, the held-out accuracy stays near 50%. Official checkpoints
are converted only with scale 1.0.

Ablations (paper Table 4 lines 5-6, docs/ablations.md; defaults = the full model)
-------------------------------------------------------------------------------------
``use_difference_encoder=False`` (line 5) removes the image difference encoder: I is the
embedded [CLS1; img1; CLS2; img2] (each token as in step 1, before any encoder) and goes
straight into the cross-modal transformer, in both stages; the model then has no
``single_img_encoder`` / ``double_img_encoder`` parameters, and the cross-task FGVC heads read
those embeddings. ``distractor_judging=False`` (line 6) trains fine-tuning without the
distractor classifier's loss: ``aux_losses`` has no ``distractor`` (so
``config.loss_weights`` must not name it); the pooler is still applied, so its parameters exist
and evaluation's held-out distractor accuracy reports an untrained head (chance).

Official checkpoints (yaolinli/IDC) convert with ``changecap_jax/convert/models/idc_pcl.py``.

Memory and attention maps (``models/base.py``): ``encode`` returns I; ``decode`` sows, per
cross-modal block, the attention of the predicting (MASK) queries to the image/CLS keys, with
the key axis reordered to [img1 (N), img2 (N), CLS1, CLS2] so that ``MEMORY_LAYOUT =
"before_after"`` holds (the two CLS slots are the extra slots). These rows do not sum to 1: the
rest of each query's attention is on text keys.

Token ids: BOS = 1 and MASK = 5 are hard-coded by the official decoder (I-Q8); the CLS id is read
from dict.json at run time. Here all four are fields. On the trunk (``"idc_pcl"`` in
``models.MODELS``) the text uses the dataset vocabulary: BOS = <START> (2), EOS = <END> (3), and
[MASK] and [CLS], which the vocabulary lacks, are rows appended after it (``mask_id`` /
``cls_id`` None), so the embedding and output layer have vocab_size + 2 rows. The official
layout is ``bos_id=1, mask_id=5, cls_id=dict["<CLS>"]`` over the whole dict.json.

On the trunk (§5.4): ``__call__`` masks each caption stream as §5.1 (from the ``"inputs"`` rng
and the example's global index, so the masks do not depend on the device count), returns the
masked-LM logits and labels as the caption stream and the distractor classifier's CE as the
auxiliary loss ``distractor`` (label 1 on the semantic pair, 0 on the distractor pair), both
SUMMED over the global batch as ``finetune.py`` does (I-Q10; ``loss_reduction="mean"`` is the
switch). Decoding follows :attr:`IDCPCL.decoding_rules`: no UNK ban, and with
``stop_at_eos=False`` (the paper preset) all max_len - 1 steps with the raw ids kept, as
``Model.greedy`` (§5.5); ``stop_at_eos=True`` stops a batch once every row has emitted EOS,
which changes no caption (text is causal) and saves steps.
"""

from __future__ import annotations

import functools
import math
from typing import ClassVar, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from changecap_jax.data import streams
from changecap_jax.models import contract
from changecap_jax.models.base import ATTENTION, DecodingRules, ModelOutput
from changecap_jax.models.dropout import Dropout
from changecap_jax.models.layers import (
    Initializer,
    TorchDense,
    model_input,
    torch_default_kernel_init,
)
from changecap_jax.models.linear import linear
from changecap_jax.models.precision import at_least_float32

Array = jax.Array

STAGES = ("pretrain", "finetune")
LOSS_REDUCTIONS = ("sum", "mean")
BOS_ID = 1  # the official dict.json layout (I-Q8)
MASK_ID = 5
# caption stream -> (after-image field, caption field, distractor label), from data/streams.py;
# convert/mapping.py reads it for its example batch.
STREAMS = {s.name: (s.after, s.caption, s.distractor_label)
           for s in streams.STREAMS.values()}
TYPE_CLS1, TYPE_IMG1, TYPE_CLS2, TYPE_IMG2, TYPE_CLS3, TYPE_TEXT = 1, 2, 3, 4, 5, 6
NUM_TYPES = 7
PE_LEN = 200  # rows of the official sinusoid buffer
MASKED_SCORE = -1e9  # the official masked_fill value (not -inf)


def idc_sinusoid_table(length: int, dim: int, dtype: np.dtype = np.float32) -> np.ndarray:
    """§5.2 / I-Q2 sinusoid (length, dim): pe[p, i] = sin(p / 10000^(2i/dim)) for even i,
    pe[p, i+1] = cos(p / 10000^(2(i+1)/dim)). The exponent uses 2 * index, so frequencies
    fall twice as fast as in the standard table. Evaluated in float64 like the official Python
    loop, rounded once to ``dtype`` (float32, as the official buffer)."""
    pos = np.arange(length, dtype=np.float64)[:, None]
    even = np.arange(0, dim, 2, dtype=np.float64)
    table = np.zeros((length, dim), np.float64)
    table[:, 0::2] = np.sin(pos / 10000.0 ** (2.0 * even / dim))
    odd = even[: dim // 2] + 1.0
    table[:, 1::2] = np.cos(pos / 10000.0 ** (2.0 * odd / dim))
    return table.astype(dtype)


# --------------------------------------------------------------------------------------------
# Building blocks (§5.2)
# --------------------------------------------------------------------------------------------


class IDCLayerNorm(nn.Module):
    """I-Q1: a_2 * (x - mean) / (std + eps) + b_2 with the UNBIASED std and eps on the std."""

    eps: float = 1e-6

    @nn.compact
    def __call__(self, x: Array) -> Array:
        d = x.shape[-1]
        a_2 = self.param("a_2", nn.initializers.ones, (d,), jnp.float32)
        b_2 = self.param("b_2", nn.initializers.zeros, (d,), jnp.float32)
        # Statistics in float32 whatever the compute dtype (changecap_jax/models/precision.py).
        xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        std = jnp.sqrt(jnp.sum((xf - mean) ** 2, axis=-1, keepdims=True) / (d - 1))
        return (a_2 * (xf - mean) / (std + self.eps) + b_2).astype(x.dtype)


class PositionalEmb(nn.Module):
    """§5.2 PositionalEmb: + type_pe[t] (+ sinusoid rows), LayerNorm(1e-12), dropout."""

    dim: int
    dropout_rate: float
    type_std: float = 1.0  # init std of type_pe: nn.Embedding's N(0, 1) officially

    def setup(self) -> None:
        self.type_pe = nn.Embed(NUM_TYPES, self.dim,
                                embedding_init=nn.initializers.normal(self.type_std))
        self.layernorm = IDCLayerNorm(eps=1e-12)
        self.dropout = Dropout(self.dropout_rate)
        # A constant, never trained; kept in float64 and rounded to the compute dtype (equal
        # to the official float32 buffer in float32, exact in the float64 runs of reproduce).
        self.pe = idc_sinusoid_table(PE_LEN, self.dim, np.float64)

    def __call__(
        self,
        x: Array,
        type_id: int,
        mode: str,
        *,
        positions: Array | None = None,
        deterministic: bool = True,
    ) -> Array:
        """x (B, L, dim); mode "img" / "text" (with sinusoid rows ``positions``, default 0..L-1)
        or "cls" (no sinusoid; text is scaled by sqrt(dim), §5.2)."""
        if mode == "text":
            x = x * math.sqrt(self.dim)  # before the type embedding is added
        x = x + self.type_pe(jnp.asarray(type_id, jnp.int32))
        if mode != "cls":
            if positions is None:
                positions = jnp.arange(x.shape[1])
            table = jnp.asarray(self.pe, jnp.promote_types(x.dtype, jnp.float32))
            x = x + table[positions].astype(x.dtype)
        return self.dropout(self.layernorm(x), deterministic=deterministic)


class MultiHeadAttention(nn.Module):
    """§5.2 attention: q_linear / v_linear / k_linear / out, scores QK^T / sqrt(d_k),
    masked_fill(mask == 0, -1e9), softmax, dropout on the probabilities."""

    dim: int
    num_heads: int
    dropout_rate: float

    def setup(self) -> None:
        self.q_linear = TorchDense(self.dim)
        self.v_linear = TorchDense(self.dim)
        self.k_linear = TorchDense(self.dim)
        self.out = TorchDense(self.dim)
        self.dropout = Dropout(self.dropout_rate, broadcast_dims=())

    def _split(self, x: Array) -> Array:
        return x.reshape(*x.shape[:-1], self.num_heads, self.dim // self.num_heads)

    def key_value(self, x: Array) -> tuple[Array, Array]:
        """(B, L, dim) -> keys, values (B, L, H, d_k)."""
        return self._split(self.k_linear(x)), self._split(self.v_linear(x))

    def attend(
        self, x: Array, k: Array, v: Array, mask: Array | None, deterministic: bool
    ) -> tuple[Array, Array]:
        """Queries from x (B, Lq, dim) to keys/values (B, Lk, H, d_k); ``mask`` broadcastable
        to (B, Lq, Lk), True = attend. Returns the output and the probabilities (B, H, Lq, Lk)."""
        q = self._split(self.q_linear(x))
        # Scale after the product, as the official code does.
        scores = at_least_float32(jnp.einsum("bqhd,bkhd->bhqk", q, k))  # softmax in f32+
        scores = scores / math.sqrt(self.dim // self.num_heads)
        if mask is not None:
            scores = jnp.where(mask[:, None], scores, MASKED_SCORE)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        ctx = jnp.einsum("bhqk,bkhd->bqhd", self.dropout(probs, deterministic=deterministic), v)
        return self.out(ctx.reshape(*ctx.shape[:-2], self.dim)), probs


class PositionwiseFeedForward(nn.Module):
    dim: int
    ffn_dim: int
    dropout_rate: float

    def setup(self) -> None:
        self.w_1 = TorchDense(self.ffn_dim)
        self.w_2 = TorchDense(self.dim)
        self.dropout = Dropout(self.dropout_rate)

    def __call__(self, x: Array, *, deterministic: bool = True) -> Array:
        return self.w_2(self.dropout(nn.relu(self.w_1(x)), deterministic=deterministic))


class SublayerConnection(nn.Module):
    """Holds the pre-LN norm of one residual branch (torch ``sublayer.{i}.norm``)."""

    def setup(self) -> None:
        self.norm = IDCLayerNorm()

    def __call__(self, x: Array) -> Array:
        return self.norm(x)


class EncoderLayer(nn.Module):
    """One pre-LN block: x += Drop(MHA(LN0 x)); x += Drop(FFN(LN1 x))."""

    dim: int
    num_heads: int
    ffn_dim: int
    dropout_rate: float

    def setup(self) -> None:
        self.attn = MultiHeadAttention(self.dim, self.num_heads, self.dropout_rate)
        self.feed_forward = PositionwiseFeedForward(self.dim, self.ffn_dim, self.dropout_rate)
        self.sublayer_0 = SublayerConnection()
        self.sublayer_1 = SublayerConnection()
        self.dropout = Dropout(self.dropout_rate)

    def key_value(self, x: Array) -> tuple[Array, Array]:
        """Keys/values of the block's LN-ed input (what the official decoder caches)."""
        return self.attn.key_value(self.sublayer_0(x))

    def attend(
        self, x: Array, k: Array, v: Array, mask: Array | None, deterministic: bool
    ) -> tuple[Array, Array]:
        """The block for queries x given ready keys/values; returns (output, probabilities)."""
        attended, probs = self.attn.attend(self.sublayer_0(x), k, v, mask, deterministic)
        x = x + self.dropout(attended, deterministic=deterministic)
        ffn = self.feed_forward(self.sublayer_1(x), deterministic=deterministic)
        return x + self.dropout(ffn, deterministic=deterministic), probs

    def __call__(
        self, x: Array, mask: Array | None, *, deterministic: bool = True
    ) -> tuple[Array, Array]:
        k, v = self.key_value(x)
        return self.attend(x, k, v, mask, deterministic)


class Transformer(nn.Module):
    """I-Q3: input LayerNorm ``norm``, then ``num_layers`` pre-LN blocks, no final LN."""

    dim: int
    num_heads: int
    ffn_dim: int
    num_layers: int
    dropout_rate: float

    def setup(self) -> None:
        self.norm = IDCLayerNorm()
        self.layers = [
            EncoderLayer(self.dim, self.num_heads, self.ffn_dim, self.dropout_rate)
            for _ in range(self.num_layers)
        ]

    def __call__(
        self, x: Array, mask: Array | None = None, *, deterministic: bool = True
    ) -> tuple[Array, list[Array]]:
        """Returns the raw residual stream and each block's attention probabilities."""
        x = self.norm(x)
        probs = []
        for layer in self.layers:
            x, p = layer(x, mask, deterministic=deterministic)
            probs.append(p)
        return x, probs


class ImageProjection(nn.Module):
    """``img_project.0`` (Linear C -> d). Its kernel (C, d) is also the tied output map of
    ``feat_regress`` (I-Q4), exposed by :meth:`project_back`."""

    in_features: int
    features: int
    kernel_init: Initializer = torch_default_kernel_init

    def setup(self) -> None:
        bound = 1.0 / math.sqrt(self.in_features)
        self.kernel = self.param(
            "kernel", self.kernel_init, (self.in_features, self.features), jnp.float32
        )
        self.bias = self.param(
            "bias",
            lambda key, shape: jax.random.uniform(key, shape, jnp.float32, -bound, bound),
            (self.features,),
        )

    def __call__(self, x: Array) -> Array:
        return linear(x, self.kernel) + self.bias

    def project_back(self, y: Array) -> Array:
        """y (..., d) -> y W (..., C) with torch's W = weight (d, C) = kernel.T."""
        return y @ self.kernel.T


class FeatRegress(nn.Module):
    """§5.2 ``feat_regress`` minus its tied weight: net = Linear -> GELU(erf) -> LN(1e-12);
    the caller multiplies by the tied kernel and this module adds ``bias`` (C,), init 0."""

    dim: int
    out_features: int

    def setup(self) -> None:
        self.net_0 = TorchDense(self.dim)
        self.net_2 = IDCLayerNorm(eps=1e-12)
        self.bias = self.param("bias", nn.initializers.zeros, (self.out_features,), jnp.float32)

    def __call__(self, x: Array) -> Array:
        return self.net_2(nn.gelu(self.net_0(x), approximate=False))


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------


class PretrainOutput(NamedTuple):
    hidden: Array  # (B, 2N+3+L, d) raw residual stream of the cross-modal encoder
    mlm_logits: Array  # (B, L, V) at the text positions
    regressed: Array  # (B, 2N, C) feat_regress of the image-token outputs (img1 then img2)
    visual: Array  # (B, d) (out[:, CLS1] + out[:, CLS2]) / 2, FDA's visual vector (unnormalised)
    text_cls: Array  # (B, d) out[:, CLS3], FDA's text vector (unnormalised)


class ClassifyOutput(NamedTuple):
    single: Array  # (B, 2, d) the pooled single-image encodings of img1 and img2
    class_logits: Array  # (B, 2, K) fgvc_classifier of each
    match_logits: Array  # (B, 2) fgvc_matcher of the pooled pair encoding: 1 = same class


class FinetuneOutput(NamedTuple):
    hidden: Array  # (B, 2N+2+L, d)
    mlm_logits: Array  # (B, L, V) at every text position (the loss keeps label != -1)
    distractor_logits: Array  # (B, 2): 1 = semantic change, 0 = distractor


def _tokens(x: Array) -> Array:
    """(B, H, W, C) channels-last grid or (B, N, C) tokens -> (B, N, C), row-major, in the
    compute dtype (layers.model_input)."""
    x = model_input(x)
    return x.reshape(x.shape[0], -1, x.shape[-1]) if x.ndim == 4 else x


def mask_caption(
    key: Array, ids: Array, *, eos_id: int, mask_id: int, num_tokens: int,
    word_probability: float = 0.15, eos_probability: float = 0.15,
) -> tuple[Array, Array]:
    """§5.1 ``mask_sent`` on one caption ids (L,) = [BOS, words.., EOS, PAD..] ->
    (masked ids, labels), labels -1 except at the chosen positions.

    Each word is chosen with ``word_probability``; a chosen word becomes MASK (0.8), a uniform
    id of the whole vocabulary, specials included (0.1, I-Q13), or stays (0.1); its label is the
    word. With no word chosen the first word is masked. Then the EOS becomes MASK with label EOS
    with ``eos_probability`` (else it stays, unlabelled)."""
    length = ids.shape[0]
    k_pick, k_kind, k_rand, k_eos = jax.random.split(key, 4)
    pos = jnp.arange(length)
    is_eos = ids == eos_id
    eos_pos = jnp.where(jnp.any(is_eos), jnp.argmax(is_eos), length)
    is_word = (pos >= 1) & (pos < eos_pos)
    chosen = is_word & (jax.random.uniform(k_pick, (length,)) < word_probability)
    chosen = jnp.where(jnp.any(chosen), chosen, is_word & (pos == 1))
    kind = jax.random.uniform(k_kind, (length,))
    random_ids = jax.random.randint(k_rand, (length,), 0, num_tokens, jnp.int32)
    replaced = jnp.where(kind < 0.8, mask_id, jnp.where(kind < 0.9, random_ids, ids))
    masked = jnp.where(chosen, replaced, ids)
    labels = jnp.where(chosen, ids, streams.IGNORE_INDEX)
    eos_masked = (pos == eos_pos) & (jax.random.uniform(k_eos) < eos_probability)
    masked = jnp.where(eos_masked, mask_id, masked)
    labels = jnp.where(eos_masked, eos_id, labels)
    return masked.astype(jnp.int32), labels.astype(jnp.int32)


def finetune_mask(n_img: int, n_text: int) -> Array:
    """§5.2 fine-tuning mask (1, L, L), True = attend: every query sees the n_img image/CLS
    tokens, image queries see no text, text query i sees text keys j <= i."""
    total = n_img + n_text
    key_is_img = jnp.arange(total)[None, :] < n_img
    causal = jnp.arange(total)[None, :] <= jnp.arange(total)[:, None]
    query_is_img = jnp.arange(total)[:, None] < n_img
    return (key_is_img | (causal & ~query_is_img))[None]


class IDCPCL(contract.TrunkModel, nn.Module):
    """The §5.2 model. ``stage="pretrain"`` has ``feat_regress`` and the 3d -> 2 pooler (unused
    by the CLEVR tasks), ``"finetune"`` the 2d -> 2 distractor pooler. :meth:`pretrain` and
    :meth:`finetune` are the stages' forwards on arrays; ``__call__`` is the trunk's fine-tuning
    step on a batch (module docstring)."""

    # Sown attention keys are reordered to [img1, img2, CLS1, CLS2] (module docstring).
    MEMORY_LAYOUT: ClassVar[str] = "before_after"
    capabilities: ClassVar[frozenset[str]] = frozenset({contract.CLASSIFY_DISTRACTOR})

    vocab_size: int  # words of the vocabulary; [MASK] / [CLS] rows are added when their id is None
    max_len: int = 40  # caption ids per row (the trunk passes the dataset's)
    stage: str = "finetune"
    hidden_dim: int = 512
    image_dim: int = 2048
    ffn_dim: int = 2048
    num_heads: int = 8
    cross_layers: int = 3
    dropout_rate: float = 0.2
    pairs: str = "both"  # the official train.json holds semantic and distractor pairs alike
    bos_id: int = 2  # trunk <START>; the official dict.json has BOS = 1
    eos_id: int = 3  # trunk <END>
    mask_id: int | None = None  # None: a row appended after the vocabulary; official 5
    cls_id: int | None = None  # None: appended after [MASK]; official dict.json's "<CLS>"
    loss_reduction: str = "sum"  # finetune.py sums token and sample losses (I-Q10)
    stop_at_eos: bool = False  # Model.greedy always runs max_len - 1 steps (§5.5)
    word_mask_probability: float = 0.15  # §5.1 mask_sent
    eos_mask_probability: float = 0.15
    # Cross-task classification source (A.3, changecap_jax/trainers/pretraining.py): its class
    # count adds
    # the fgvc_classifier (d -> K) and fgvc_matcher (2d -> 2) heads to the pretraining model.
    fgvc_classes: int = 0
    # CPU-preset deviations (module docstring, "Embedding balance"); 1.0 / 1.0 is the official
    # model. Region features are multiplied by image_feature_scale before img_project, and
    # type_pe starts as N(0, type_embedding_std^2).
    image_feature_scale: float = 1.0
    type_embedding_std: float = 1.0
    # Table 4 lines 5 and 6 (module docstring, "Ablations"); True / True is the paper model.
    use_difference_encoder: bool = True
    distractor_judging: bool = True

    # ---- token layout ------------------------------------------------------------------------

    @property
    def mask_token(self) -> int:
        return self.vocab_size if self.mask_id is None else self.mask_id

    @property
    def cls_token(self) -> int:
        if self.cls_id is not None:
            return self.cls_id
        return self.vocab_size + (self.mask_id is None)

    @property
    def num_tokens(self) -> int:
        """Rows of ``word_embedding`` / ``output_layer``: the vocabulary plus appended specials."""
        return self.vocab_size + (self.mask_id is None) + (self.cls_id is None)

    @property
    def extra_tokens(self) -> dict[int, str]:
        """The appended ids the decoder can emit (the official ``transform`` prints them)."""
        extra = {}
        if self.mask_id is None:
            extra[self.mask_token] = "<MASK>"
        if self.cls_id is None:
            extra[self.cls_token] = "<CLS>"
        return extra

    @property
    def decoding_rules(self) -> DecodingRules:
        return DecodingRules(start_id=self.bos_id, end_id=self.eos_id, banned_ids=(),
                             stop_at_end=self.stop_at_eos)

    def setup(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, got {self.stage!r}")
        if self.loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}, got "
                             f"{self.loss_reduction!r}")
        if self.max_len + 1 > PE_LEN:  # decoding puts a MASK at position max_len
            raise ValueError(f"max_len {self.max_len} needs {self.max_len + 1} sinusoid rows; "
                             f"the official table has {PE_LEN}")
        if self.image_feature_scale <= 0 or self.type_embedding_std <= 0:
            raise ValueError("image_feature_scale and type_embedding_std must be positive, got "
                             f"{self.image_feature_scale} and {self.type_embedding_std}")
        d = self.hidden_dim
        self.word_embedding = nn.Embed(
            self.num_tokens, d, embedding_init=nn.initializers.normal(1.0)
        )
        self.img_project_0 = ImageProjection(self.image_dim, d)
        self.position_encoding = PositionalEmb(d, self.dropout_rate, self.type_embedding_std)
        block = functools.partial(
            Transformer, d, self.num_heads, self.ffn_dim, dropout_rate=self.dropout_rate
        )
        if self.use_difference_encoder:
            self.single_img_encoder = block(num_layers=1)
            self.double_img_encoder = block(num_layers=1)
        self.encoder = block(num_layers=self.cross_layers)
        self.output_layer = TorchDense(self.num_tokens)
        self.pooler_0 = TorchDense(2)
        if self.stage == "pretrain":
            self.feat_regress = FeatRegress(d, self.image_dim)
            if self.fgvc_classes > 0:
                self.fgvc_classifier = TorchDense(self.fgvc_classes)
                self.fgvc_matcher = TorchDense(2)

    # ---- embeddings (§5.2) -----------------------------------------------------------------

    def _cls(self, batch: int, type_id: int, deterministic: bool) -> Array:
        emb = self.word_embedding(jnp.full((batch, 1), self.cls_token, jnp.int32))
        return self.position_encoding(emb, type_id, "cls", deterministic=deterministic)

    def _image(self, x: Array, type_id: int, deterministic: bool) -> Array:
        x = _tokens(x)
        if x.shape[-1] != self.image_dim:
            raise ValueError(f"image features have {x.shape[-1]} channels, the model expects "
                             f"image_dim = {self.image_dim} (set --config.model.image_dim)")
        e = nn.sigmoid(self.img_project_0(x * self.image_feature_scale))
        return self.position_encoding(e, type_id, "img", deterministic=deterministic)

    def _text(self, ids: Array, deterministic: bool, positions: Array | None = None) -> Array:
        emb = self.word_embedding(jnp.asarray(ids, jnp.int32))
        return self.position_encoding(
            emb, TYPE_TEXT, "text", positions=positions, deterministic=deterministic
        )

    def image_tokens(self, img1: Array, img2: Array, *, train: bool = False) -> Array:
        """I = pair_encoder([single([CLS1; e1]); single([CLS2; e2])]) (B, 2N+2, d)."""
        return self.encode_images(img1, img2, train=train)[2]

    def encode_images(self, img1: Array, img2: Array, *,
                      train: bool = False) -> tuple[Array, Array, Array]:
        """The single-image encodings [CLS1; img1], [CLS2; img2] (B, N+1, d) and the pair
        encoding I (B, 2N+2, d). Without the difference encoder (Table 4 line 5) both
        encoders are the identity: the embedded tokens and their concatenation."""
        det = not train
        b = img1.shape[0]
        e1 = jnp.concatenate([self._cls(b, TYPE_CLS1, det), self._image(img1, TYPE_IMG1, det)], 1)
        e2 = jnp.concatenate([self._cls(b, TYPE_CLS2, det), self._image(img2, TYPE_IMG2, det)], 1)
        if not self.use_difference_encoder:
            return e1, e2, jnp.concatenate([e1, e2], 1)
        s1, _ = self.single_img_encoder(e1, deterministic=det)
        s2, _ = self.single_img_encoder(e2, deterministic=det)
        out, _ = self.double_img_encoder(jnp.concatenate([s1, s2], 1), deterministic=det)
        return s1, s2, out

    # ---- heads -------------------------------------------------------------------------------

    def regress(self, y: Array) -> Array:
        """feat_regress: net(y) W_imgproj + bias, (..., d) -> (..., C) (I-Q4, tied weight)."""
        return self.img_project_0.project_back(self.feat_regress(y)) + self.feat_regress.bias

    # ---- stage forwards ----------------------------------------------------------------------

    def pretrain(
        self, img1: Array, img2: Array, ids: Array, *, train: bool = False
    ) -> PretrainOutput:
        """§5.2/§5.3: [I; CLS3; T] through the encoder with NO attention mask (PAD included).
        img1/img2 are the (possibly MVM-zeroed) features, ids (B, L) the (masked) caption."""
        if self.stage != "pretrain":
            raise ValueError("pretrain() needs stage='pretrain' (feat_regress)")
        det = not train
        image = self.image_tokens(img1, img2, train=train)
        n_img = image.shape[1]
        n = (n_img - 2) // 2
        x = jnp.concatenate(
            [image, self._cls(ids.shape[0], TYPE_CLS3, det), self._text(ids, det)], 1
        )
        out, _ = self.encoder(x, None, deterministic=det)
        if self.is_initializing():  # the 3d -> 2 pooler exists in the checkpoint; no task uses it
            self.pooler_0(jnp.zeros((1, 3 * self.hidden_dim), out.dtype))
            if self.fgvc_classes > 0:  # the cross-task heads, called by cross_task_classify
                self.fgvc_classifier(jnp.zeros((1, self.hidden_dim), out.dtype))
                self.fgvc_matcher(jnp.zeros((1, 2 * self.hidden_dim), out.dtype))
        img_out = jnp.concatenate([out[:, 1 : 1 + n], out[:, n + 2 : 2 * n + 2]], 1)
        return PretrainOutput(
            hidden=out,
            mlm_logits=self.output_layer(out[:, n_img + 1 :]),
            regressed=self.regress(img_out),
            visual=(out[:, 0] + out[:, n + 1]) / 2,
            text_cls=out[:, n_img],
        )

    def cross_task_classify(self, img1: Array, img2: Array, *, pooling: str = "mean",
                            match_pooling: str = "cls", train: bool = False) -> ClassifyOutput:
        """A.3 FGVC heads on the image difference encoder alone (no text, no cross-modal
        encoder). ``pooling`` of a single-image encoding: "mean" over its N region outputs
        (CLS left out) or "cls" (its CLS output); ``match_pooling`` of the pair encoding: "cls"
        = cat(CLS1, CLS2) outputs (as the fine-tuning pooler) or "mean" = cat(mean of img1's
        regions, mean of img2's)."""
        if self.fgvc_classes <= 0:
            raise ValueError("cross_task_classify needs fgvc_classes > 0 (a classification "
                             "source's class count)")
        s1, s2, out = self.encode_images(img1, img2, train=train)
        n = s1.shape[1] - 1
        if pooling == "mean":
            single = jnp.stack([s1[:, 1:].mean(1), s2[:, 1:].mean(1)], 1)
        elif pooling == "cls":
            single = jnp.stack([s1[:, 0], s2[:, 0]], 1)
        else:
            raise ValueError(f"pooling must be 'mean' or 'cls', got {pooling!r}")
        if match_pooling == "cls":
            pair = jnp.concatenate([out[:, 0], out[:, n + 1]], -1)
        elif match_pooling == "mean":
            pair = jnp.concatenate([out[:, 1 : n + 1].mean(1), out[:, n + 2 :].mean(1)], -1)
        else:
            raise ValueError(f"match_pooling must be 'cls' or 'mean', got {match_pooling!r}")
        return ClassifyOutput(single, self.fgvc_classifier(single), self.fgvc_matcher(pair))

    def finetune(
        self, img1: Array, img2: Array, ids: Array, *, train: bool = False
    ) -> FinetuneOutput:
        """§5.2/§5.4: [I; T] under the fine-tuning mask; MLM logits at every text position and
        the distractor logits pooler(cat(CLS1, CLS2))."""
        det = not train
        image = self.image_tokens(img1, img2, train=train)
        n_img, n_text = image.shape[1], ids.shape[1]
        x = jnp.concatenate([image, self._text(ids, det)], 1)
        out, _ = self.encoder(x, finetune_mask(n_img, n_text), deterministic=det)
        return FinetuneOutput(out, self.output_layer(out[:, n_img:]),
                              self._distractor_logits(out, n_img))

    def _distractor_logits(self, out: Array, n_img: int) -> Array:
        """pooler(cat(CLS1, CLS2)) of the encoder output; CLS2 sits after [CLS1; img1]."""
        n = (n_img - 2) // 2
        return self.pooler_0(jnp.concatenate([out[:, 0], out[:, n + 1]], -1))

    def classify_distractor(self, img1: Array, img2: Array) -> Array:
        """The distractor logits (B, 2) of :meth:`finetune` without a caption: image queries
        never attend text under the fine-tuning mask, so CLS1/CLS2 come from the encoder on I
        alone. Evaluation reports the held-out accuracy from it (the official val pass's
        distractor accuracy, §5.6)."""
        if self.stage != "finetune":
            raise ValueError("the distractor classifier is a fine-tuning head; this model has "
                             f"stage={self.stage!r}")
        image = self.image_tokens(img1, img2)
        out, _ = self.encoder(image, None)
        return self._distractor_logits(out, image.shape[1])

    def __call__(self, batch: dict[str, Array], *, train: bool,
                 axis_name: str | None = None) -> ModelOutput:
        """§5.4 on the trunk: per caption stream, the §5.1-masked caption through
        :meth:`finetune`; the caption stream is the masked LM (logits and labels at every text
        position) and ``distractor`` the classifier's CE (label 1 semantic, 0 distractor)."""
        if self.stage != "finetune":
            raise ValueError("the trunk trains stage='finetune'; pretraining has its own step "
                             "(changecap_jax.trainers.pretraining)")
        # Images may be (B, H, W, C) grids or (B, N, C) tokens: no rank check.
        streams.validate_batch(batch, self.streams, model="IDC-PCL", check_ranks=False)
        local_b = batch["before"].shape[0]
        masked = self.masked_captions(batch, axis_name=axis_name)
        logits, targets, distractor_ce = {}, {}, []
        for stream in self.streams:
            ids, labels = masked[stream]
            out = self.finetune(batch["before"], batch[streams.STREAMS[stream].after], ids,
                                train=train)
            label = streams.STREAMS[stream].distractor_label
            logits[stream], targets[stream] = out.mlm_logits, labels
            ce, _ = token_cross_entropy(out.distractor_logits,
                                        jnp.full((local_b,), label, jnp.int32))
            distractor_ce.append(jnp.sum(ce))
        aux = {}
        # With semantic pairs only there is nothing to classify; Table 4 line 6 trains without.
        if len(self.streams) > 1 and self.distractor_judging:
            total = jnp.sum(jnp.stack(distractor_ce))
            if axis_name is not None:
                total = jax.lax.psum(total, axis_name)
            if self.loss_reduction == "mean":
                count = local_b * len(self.streams)
                total = total / (count if axis_name is None else jax.lax.psum(count, axis_name))
            aux["distractor"] = total
        return ModelOutput(caption_logits=logits, caption_targets=targets, aux_losses=aux,
                           caption_reduction=self.loss_reduction)

    def masked_captions(self, batch: dict[str, Array], *,
                        axis_name: str | None = None) -> dict[str, tuple[Array, Array]]:
        """stream -> (masked ids, labels) by :func:`mask_caption`, from the ``"inputs"`` rng
        (a fixed key without it) folded with the stream and the GLOBAL example index, so the
        masks are the same however the batch is split over devices."""
        local_b = batch["before"].shape[0]
        offset = 0 if axis_name is None else jax.lax.axis_index(axis_name) * local_b
        example = offset + jnp.arange(local_b)
        key = self.make_rng("inputs") if self.has_rng("inputs") else jax.random.key(0)
        mask = functools.partial(
            mask_caption, eos_id=self.eos_id, mask_id=self.mask_token,
            num_tokens=self.num_tokens, word_probability=self.word_mask_probability,
            eos_probability=self.eos_mask_probability)
        masked = {}
        for n, stream in enumerate(self.streams):
            keys = jax.vmap(lambda i, n=n: jax.random.fold_in(jax.random.fold_in(key, n), i))(
                example)
            masked[stream] = jax.vmap(mask)(
                keys, jnp.asarray(batch[streams.STREAMS[stream].caption], jnp.int32))
        return masked

    # ---- decoding protocol (changecap_jax/decoding/search.py; §5.5) ---

    def encode(self, before: Array, after: Array, *, train: bool = False) -> Array:
        """Memory = I (B, 2N+2, d), the image/CLS part of the cross-modal input."""
        return self.image_tokens(before, after, train=train)

    def init_cache(self, memory: Array, max_len: int) -> None:
        """§5.5 step 1: run the encoder on I alone (image queries never see text) and keep
        each block's image keys/values; text keys/values (B, max_len, H, d_k) start at zero."""
        x = self.encoder.norm(memory)
        b = memory.shape[0]
        heads = self.num_heads
        for i, layer in enumerate(self.encoder.layers):
            k, v = layer.key_value(x)
            zeros = jnp.zeros((b, max_len, heads, self.hidden_dim // heads), k.dtype)
            self.put_variable("cache", f"image_key_{i}", k)
            self.put_variable("cache", f"image_value_{i}", v)
            self.put_variable("cache", f"text_key_{i}", zeros)
            self.put_variable("cache", f"text_value_{i}", zeros)
            x, _ = layer.attend(x, k, v, None, True)

    def decode_step(self, token: Array, index: Array) -> Array:
        """token (B,) at text position ``index`` -> logits (B, V) for position index + 1.

        Two queries: the token (its keys/values are written to the cache at ``index``) and a
        [MASK] at index + 1 (written at index + 1, overwritten by the real token next step).
        Under the causal text mask this equals the official recompute of gen + [MASK].
        Needs index <= max_len - 2 (the MASK's slot must exist in the cache)."""
        b = token.shape[0]
        ids = jnp.stack(
            [jnp.asarray(token, jnp.int32), jnp.full((b,), self.mask_token, jnp.int32)], 1)
        positions = index + jnp.arange(2)
        x = self.encoder.norm(self._text(ids, True, positions))
        for i, layer in enumerate(self.encoder.layers):
            k_new, v_new = layer.key_value(x)
            text_k = jax.lax.dynamic_update_slice(
                self.get_variable("cache", f"text_key_{i}"), k_new, (0, index, 0, 0)
            )
            text_v = jax.lax.dynamic_update_slice(
                self.get_variable("cache", f"text_value_{i}"), v_new, (0, index, 0, 0)
            )
            self.put_variable("cache", f"text_key_{i}", text_k)
            self.put_variable("cache", f"text_value_{i}", text_v)
            image_k = self.get_variable("cache", f"image_key_{i}")
            image_v = self.get_variable("cache", f"image_value_{i}")
            n_img = image_k.shape[1]
            # Image keys all visible; text key j visible to the query at position p iff j <= p.
            text_ok = jnp.arange(text_k.shape[1])[None, :] <= positions[:, None]
            mask = jnp.concatenate([jnp.ones((2, n_img), bool), text_ok], 1)[None]
            x, _ = layer.attend(
                x,
                jnp.concatenate([image_k, text_k], 1),
                jnp.concatenate([image_v, text_v], 1),
                mask,
                True,
            )
        return self.output_layer(x[:, 1])

    def decode(self, memory: Array, ids: Array, *, train: bool = False) -> Array:
        """Teacher-forced logits (B, L, V): row t = the prediction of a [MASK] at position t + 1
        after ids[:, :t+1], all rows in ONE pass: the text part is [ids at positions 0..L-1;
        L MASKs at positions 1..L], MASK t sees ids 0..t and itself only. Sows the MASK queries'
        attention to the image/CLS keys (reordered to before_after) into ATTENTION."""
        det = not train
        ids = jnp.asarray(ids, jnp.int32)
        b, length = ids.shape
        n_img = memory.shape[1]
        n = (n_img - 2) // 2
        masks = jnp.full((b, length), self.mask_token, jnp.int32)
        text = jnp.concatenate(
            [self._text(ids, det), self._text(masks, det, jnp.arange(1, length + 1))], 1
        )
        r = jnp.arange(length)
        tok_tok = r[None, :] <= r[:, None]  # token i sees tokens j <= i
        tok_mask = jnp.zeros((length, length), bool)
        mask_tok = r[None, :] <= r[:, None]  # MASK t sees tokens j <= t
        mask_mask = jnp.eye(length, dtype=bool)  # ... and itself only
        text_mask = jnp.block([[tok_tok, tok_mask], [mask_tok, mask_mask]])
        full = jnp.concatenate(
            [
                jnp.concatenate(
                    [jnp.ones((n_img, n_img), bool), jnp.zeros((n_img, 2 * length), bool)], 1
                ),
                jnp.concatenate([jnp.ones((2 * length, n_img), bool), text_mask], 1),
            ],
            0,
        )[None]
        out, probs = self.encoder(jnp.concatenate([memory, text], 1), full, deterministic=det)
        order = np.concatenate([np.arange(1, n + 1), np.arange(n + 2, 2 * n + 2), [0, n + 1]])
        for i, p in enumerate(probs):
            self.sow(ATTENTION, f"encoder_layer_{i}", p[:, :, n_img + length :, order])
        return self.output_layer(out[:, n_img + length :])


# --------------------------------------------------------------------------------------------
# Losses (§5.3, §5.4)
# --------------------------------------------------------------------------------------------


def token_cross_entropy(logits: Array, labels: Array) -> tuple[Array, Array]:
    """Per-position CE (0 where label == -1) and the keep mask."""
    keep = labels != -1
    log_probs = jax.nn.log_softmax(at_least_float32(logits), axis=-1)
    picked = jnp.take_along_axis(log_probs, jnp.where(keep, labels, 0)[..., None], -1)[..., 0]
    return jnp.where(keep, -picked, 0.0), keep


def finetune_loss(
    mlm_logits: Array, labels: Array, distractor_logits: Array, distractor_labels: Array
) -> tuple[Array, Array]:
    """§5.4 / I-Q10: (sum of the per-token MLM CE, sum of the per-sample distractor CE); the
    official loss is their sum, NOT a mean."""
    ce, _ = token_cross_entropy(mlm_logits, labels)
    diff, _ = token_cross_entropy(distractor_logits, distractor_labels)
    return jnp.sum(ce), jnp.sum(diff)


def l2_normalize(x: Array) -> Array:
    """torch F.normalize: x / max(||x||, 1e-12)."""
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def supcon_row_losses(anchors: Array, anchor_labels: Array, anchor_index: Array,
                      columns: Array, column_labels: Array,
                      temperature: float = 1.0) -> tuple[Array, Array]:
    """Supervised contrastive loss (Khosla et al. 2020, L_out) of each anchor: with z the
    L2-normalised vectors, P(i) the columns of i's label other than i itself and A(i) every
    column but i, l_i = -1/|P(i)| sum_{p in P(i)} log(exp(z_i.z_p / t) / sum_{a in A(i)}
    exp(z_i.z_a / t)). ``anchor_index`` (A,) is each anchor's own column (left out of its
    A(i)); the columns may be a whole (gathered) batch. Returns (l_i, 0 where P(i) is empty;
    the has-positive mask)."""
    za = l2_normalize(anchors.astype(jnp.float32))
    zc = l2_normalize(columns.astype(jnp.float32))
    logits = za @ zc.T / temperature
    others = jnp.arange(zc.shape[0])[None, :] != anchor_index[:, None]
    positive = (anchor_labels[:, None] == column_labels[None, :]) & others
    log_prob = logits - jax.nn.logsumexp(jnp.where(others, logits, -jnp.inf), -1,
                                         keepdims=True)
    count = jnp.sum(positive, -1)
    per_row = -jnp.sum(jnp.where(positive, log_prob, 0.0), -1) / jnp.maximum(count, 1)
    return jnp.where(count > 0, per_row, 0.0), count > 0


def transfg_row_losses(anchors: Array, anchor_labels: Array, columns: Array,
                       column_labels: Array, margin: float = 0.4) -> Array:
    """TransFG's contrastive loss (He et al. 2021, the loss A.3 cites) of each anchor, summed
    over the columns: with cos the cosine similarity, sum_j [y_i = y_j] (1 - cos_ij) +
    [y_i != y_j] max(cos_ij - margin, 0); the loss is the sum over anchors / N^2 (N images;
    the anchor's own column adds 0)."""
    za = l2_normalize(anchors.astype(jnp.float32))
    zc = l2_normalize(columns.astype(jnp.float32))
    cos = za @ zc.T
    same = anchor_labels[:, None] == column_labels[None, :]
    return jnp.sum(jnp.where(same, 1.0 - cos, jnp.maximum(cos - margin, 0.0)), -1)
