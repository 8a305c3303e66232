"""The transformer caption decoder family.

:class:`Speaker` is SCORER's caption decoder (official ``models/transformer_decoder.py``,
notes ``docs/official/scorer.md`` §3.2; §N below: sections of docs/official/); the Subtraction
baseline uses it unchanged. It is a 2-layer post-LN transformer decoder with the official
code's quirks reproduced:

* word vectors: ``embed`` (V, 300) + a fixed sinusoid PE(300), then ``fc`` = Linear 300 -> 512
  -> Dropout -> LayerNorm (eps 1e-6);
* attention blocks have q/k/v projections but NO output projection (S-Q5), and masks are
  additive ``(1 - A) * -10000`` (S-Q6), A[b, i, j] = mask[b, j] * [j <= i]; the cross-attention
  to the visual memory has no mask;
* the FFN residual adds the GELU output, not the sub-layer input (S-Q4):
  g = GELU_erf(dense(a2)), out = LN(Dropout(dense(g)) + g), which needs FFN width == hidden;
* init (§3.5): every Linear / Embedding weight ~ N(0, 0.02^2) (this overwrites the padding row,
  S-Q7), biases 0, LayerNorm 1/0.

Parameter paths (torch key of ``speaker_state`` with ``core.`` dropped; Linear weights
transposed, LayerNorm weight -> scale) are in the key table of SCORER's converter,
``changecap_jax/convert/models/scorer.py``.

Incremental decoding (:meth:`Speaker.init_cache` / :meth:`Speaker.step`) keeps per-layer
self-attention keys/values and the cross-attention keys/values of the memory in the 'cache'
collection; it equals rerunning the whole decoder on the growing prefix (§3.7).

The functions :func:`teacher_forced_words`, :func:`init_layer_caches` and :func:`cached_step`
serve every caption decoder of the models (Speaker, DIRL's CCR decoder, CHEERS's gated
decoder) that has the layout :class:`TextDecoder` describes: word inputs from
``embed_words(ids, pe, deterministic)``, a fixed sinusoid table ``pe``, a list of layers
``layer`` with ``init_cache`` / ``step`` and the output projection ``logit``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from changecap_jax.data.streams import caption_mask
from changecap_jax.models.base import ATTENTION
from changecap_jax.models.dropout import Dropout
from changecap_jax.models.layers import (
    HEADS_FIRST,
    TOKEN_MAJOR,
    Initializer,
    TorchDense,
    attention_context,
    attention_scores,
    heads_first,
    sinusoid_table,
    torch_layer_norm,
)
from changecap_jax.models.precision import at_least_float32

Array = jax.Array

MASK_VALUE = -10000.0  # additive mask value of the official attention (S-Q6)
speaker_init: Initializer = nn.initializers.normal(stddev=0.02)  # §3.5 init_weights


class TextDecoder(Protocol):
    """The layout the shared decoder functions below rely on (module docstring)."""

    max_len: int
    pe: np.ndarray  # (max_len, word_dim) fixed sinusoid table, float64
    layer: Sequence[Any]  # decoder layers with init_cache(memory, max_len) and step(h, index)

    def embed_words(self, ids: Array, pe: Array, deterministic: bool) -> Array: ...

    def logit(self, h: Array) -> Array: ...


def teacher_forced_words(decoder: TextDecoder, ids: Array, deterministic: bool) -> Array:
    """The decoder's word inputs for ids (B, Lt), position p getting PE row p."""
    lt = ids.shape[1]
    if lt > decoder.max_len:
        raise ValueError(f"caption length {lt} exceeds max_len {decoder.max_len} (PE rows)")
    return decoder.embed_words(ids, jnp.asarray(decoder.pe[:lt])[None], deterministic)


def check_decode_length(max_len: int, limit: int) -> None:
    """Decoding ``max_len`` positions needs that many PE rows."""
    if max_len > limit:
        raise ValueError(f"decode length {max_len} exceeds max_len {limit} (PE rows)")


def init_layer_caches(decoder: TextDecoder, memory: Any, max_len: int) -> None:
    """Creates every layer's 'cache' entries for decoding ``max_len`` positions on ``memory``."""
    check_decode_length(max_len, decoder.max_len)
    for layer in decoder.layer:
        layer.init_cache(memory, max_len)


def cached_step(decoder: TextDecoder, token: Array, index: Array) -> Array:
    """token (B,) int32 at position ``index`` -> next-token logits (B, V); eval mode."""
    pe = jnp.asarray(decoder.pe)[index][None, None]
    h = decoder.embed_words(token[:, None], pe, True)
    for layer in decoder.layer:
        h = layer.step(h, index)
    return decoder.logit(h[:, 0])


def multi_head_attend(
    q: Array,
    k: Array,
    v: Array,
    num_heads: int,
    *,
    additive_mask: Array | None = None,
    dropout: Dropout | None = None,
    deterministic: bool = True,
    sow_to: nn.Module | None = None,
    kv_layout: str = TOKEN_MAJOR,
) -> Array:
    """softmax(Q_h K_h^T / sqrt(d_h) [+ mask]) -> dropout -> . V_h, heads merged; no output
    projection (the official SCORER encoder and decoder attention, §3.1 step 4 / §3.2).

    q (B, Lq, E), k/v (B, Lk, E), or with ``kv_layout=HEADS_FIRST`` already split into heads as
    (B, H, E/H, Lk) (the decoding cache, :func:`split_heads_first`); ``additive_mask``
    broadcastable to (B, Lq, Lk).
    """
    b, lq, e = q.shape
    dh = e // num_heads
    qh = q.reshape(b, lq, num_heads, dh)
    if kv_layout == HEADS_FIRST:
        kh, vh = k, v
    else:
        kh = k.reshape(b, k.shape[1], num_heads, dh)
        vh = v.reshape(b, v.shape[1], num_heads, dh)
    # Scores, mask and softmax in at least float32 whatever the compute dtype
    # (changecap_jax/models/precision.py).
    scores = at_least_float32(attention_scores(qh, kh, kv_layout)) / math.sqrt(dh)
    if additive_mask is not None:
        scores = scores + additive_mask[:, None]
    probs = jax.nn.softmax(scores, axis=-1).astype(vh.dtype)
    # A decoder's cross-attention (models/base.py ATTENTION); not at init, which would keep it.
    if sow_to is not None and not sow_to.is_initializing():
        sow_to.sow(ATTENTION, "probs", probs)
    if dropout is not None:
        probs = dropout(probs, deterministic=deterministic)
    return attention_context(probs, vh, kv_layout).reshape(b, lq, e)


def split_heads_first(x: Array, num_heads: int) -> Array:
    """(B, L, E) -> (B, H, E/H, L): keys or values split into heads, in the decoding caches'
    layout (``layers.heads_first``)."""
    b, length, e = x.shape
    return heads_first(x.reshape(b, length, num_heads, e // num_heads))


def speaker_self_mask(ids: Array) -> Array:
    """§3.2 step 1: additive (B, Lt, Lt) mask (1 - A) * -10000, A[b, i, j] = mask[b, j] [j <= i],
    mask = the caption mask of §2.5 item 5 (START..END)."""
    lt = ids.shape[1]
    causal = jnp.tril(jnp.ones((lt, lt), jnp.float32))
    allowed = caption_mask(ids).astype(jnp.float32)[:, None, :] * causal[None]
    return (1.0 - allowed) * MASK_VALUE


class SpeakerAttention(nn.Module):
    """torch ``self_attention`` / ``dec_enc_attention``: q/k/v Linear, no output projection,
    attention dropout; with a key/value cache for incremental decoding."""

    hidden_dim: int
    num_heads: int
    dropout_rate: float = 0.1
    sow_probs: bool = False  # the decoder-encoder attention exposes its probabilities

    def setup(self) -> None:
        if self.hidden_dim % self.num_heads:
            raise ValueError(f"hidden_dim {self.hidden_dim} is not divisible by num_heads "
                             f"{self.num_heads}")
        dense = lambda: TorchDense(self.hidden_dim, kernel_init=speaker_init, bias_init="zeros")
        self.query, self.key, self.value = dense(), dense(), dense()
        self.dropout = Dropout(self.dropout_rate)

    def __call__(
        self, x_q: Array, x_kv: Array, additive_mask: Array | None = None, *,
        deterministic: bool = True,
    ) -> Array:
        return multi_head_attend(
            self.query(x_q), self.key(x_kv), self.value(x_kv), self.num_heads,
            additive_mask=additive_mask, dropout=self.dropout, deterministic=deterministic,
            sow_to=self if self.sow_probs else None)

    # ---- incremental decoding (eval mode) -------------------------------------------------

    # Keys and values are cached split into heads, (B, H, E/H, positions): split_heads_first().
    def init_self_cache(self, batch_size: int, max_len: int) -> None:
        shape = (batch_size, self.num_heads, self.hidden_dim // self.num_heads, max_len)
        self.put_variable("cache", "cached_key", jnp.zeros(shape, jnp.float32))
        self.put_variable("cache", "cached_value", jnp.zeros(shape, jnp.float32))

    def init_cross_cache(self, memory: Array) -> None:
        heads = self.num_heads
        self.put_variable("cache", "memory_key", split_heads_first(self.key(memory), heads))
        self.put_variable("cache", "memory_value", split_heads_first(self.value(memory), heads))

    def step_self(self, x: Array, index: Array) -> Array:
        """x (B, 1, E) at position ``index`` attends to positions 0..index (full-recompute row
        ``index`` of the causal mask; later positions get the additive -10000)."""
        cached_keys = self.get_variable("cache", "cached_key")
        cached_values = self.get_variable("cache", "cached_value")
        new_key = split_heads_first(self.key(x), self.num_heads).astype(cached_keys.dtype)
        new_value = split_heads_first(self.value(x), self.num_heads).astype(cached_values.dtype)
        keys = jax.lax.dynamic_update_slice(cached_keys, new_key, (0, 0, 0, index))
        values = jax.lax.dynamic_update_slice(cached_values, new_value, (0, 0, 0, index))
        self.put_variable("cache", "cached_key", keys)
        self.put_variable("cache", "cached_value", values)
        visible = (jnp.arange(keys.shape[-1]) <= index).astype(jnp.float32)
        mask = ((1.0 - visible) * MASK_VALUE)[None, None, :]
        return multi_head_attend(self.query(x), keys, values, self.num_heads, additive_mask=mask,
                                 kv_layout=HEADS_FIRST)

    def step_cross(self, x: Array) -> Array:
        keys = self.get_variable("cache", "memory_key")
        values = self.get_variable("cache", "memory_value")
        return multi_head_attend(self.query(x), keys, values, self.num_heads,
                                 sow_to=self if self.sow_probs else None, kv_layout=HEADS_FIRST)


class Intermediate(nn.Module):
    """torch ``hidden_intermediate``: g = GELU_erf(dense(x)) (exact erf GELU, §1.2)."""

    features: int

    @nn.compact
    def __call__(self, x: Array) -> Array:
        dense = TorchDense(self.features, kernel_init=speaker_init, bias_init="zeros",
                           name="dense")
        return jax.nn.gelu(dense(x), approximate=False)


class Output(nn.Module):
    """torch ``output``: LayerNorm(Dropout(dense(g)) + g), the residual is g itself (S-Q4)."""

    features: int
    dropout_rate: float = 0.1
    layer_norm_eps: float = 1e-6

    @nn.compact
    def __call__(self, g: Array, *, deterministic: bool = True) -> Array:
        if g.shape[-1] != self.features:
            raise ValueError(f"the Speaker FFN residual adds the GELU output (width "
                             f"{g.shape[-1]}) to the FFN output (width {self.features}); "
                             "they must be equal")
        y = TorchDense(self.features, kernel_init=speaker_init, bias_init="zeros",
                       name="dense")(g)
        y = Dropout(self.dropout_rate)(y, deterministic=deterministic)
        return torch_layer_norm(self.layer_norm_eps, name="LayerNorm")(y + g)


class SpeakerLayer(nn.Module):
    """One post-LN decoder layer, torch ``core.layer.{l}`` (§3.2 steps 1-4)."""

    hidden_dim: int
    num_heads: int
    dropout_rate: float = 0.1
    layer_norm_eps: float = 1e-6

    def setup(self) -> None:
        attention = lambda **kw: SpeakerAttention(self.hidden_dim, self.num_heads,
                                                  self.dropout_rate, **kw)
        self.self_attention = attention()
        self.norm1 = torch_layer_norm(self.layer_norm_eps)
        self.dec_enc_attention = attention(sow_probs=True)
        self.hidden_intermediate = Intermediate(self.hidden_dim)
        self.norm2 = torch_layer_norm(self.layer_norm_eps)
        self.output = Output(self.hidden_dim, self.dropout_rate, self.layer_norm_eps)

    def __call__(
        self, h: Array, memory: Array, self_mask: Array, *, deterministic: bool = True
    ) -> Array:
        a1 = self.norm1(self.self_attention(h, h, self_mask, deterministic=deterministic) + h)
        a2 = self.norm2(a1 + self.dec_enc_attention(a1, memory, deterministic=deterministic))
        return self.output(self.hidden_intermediate(a2), deterministic=deterministic)

    def init_cache(self, memory: Array, max_len: int) -> None:
        self.self_attention.init_self_cache(memory.shape[0], max_len)
        self.dec_enc_attention.init_cross_cache(memory)

    def step(self, h: Array, index: Array) -> Array:
        a1 = self.norm1(self.self_attention.step_self(h, index) + h)
        a2 = self.norm2(a1 + self.dec_enc_attention.step_cross(a1))
        return self.output(self.hidden_intermediate(a2))


class Speaker(nn.Module):
    """SCORER's caption decoder (torch ``Speaker``: ``core`` + ``logit``, §3.2)."""

    vocab_size: int
    max_len: int
    hidden_dim: int = 512
    num_heads: int = 8
    num_layers: int = 2
    word_dim: int = 300
    dropout_rate: float = 0.1
    layer_norm_eps: float = 1e-6

    def setup(self) -> None:
        self.embed = nn.Embed(self.vocab_size, self.word_dim, embedding_init=speaker_init)
        # Fixed buffer core.position_enc.pe: a constant, never trained.
        self.pe = sinusoid_table(self.max_len, self.word_dim, np.float64)
        self.fc_0 = TorchDense(self.hidden_dim, kernel_init=speaker_init, bias_init="zeros")
        self.fc_2 = torch_layer_norm(self.layer_norm_eps)
        self.dropout = Dropout(self.dropout_rate)
        self.layer = [
            SpeakerLayer(self.hidden_dim, self.num_heads, self.dropout_rate, self.layer_norm_eps)
            for _ in range(self.num_layers)
        ]
        self.logit = TorchDense(self.vocab_size, kernel_init=speaker_init, bias_init="zeros")

    def embed_words(self, ids: Array, pe: Array, deterministic: bool) -> Array:
        """``fc``(embed(ids) + pe): Linear -> Dropout -> LayerNorm."""
        words = self.embed(ids)
        x = self.dropout(self.fc_0(words + pe.astype(words.dtype)), deterministic=deterministic)
        return self.fc_2(x)

    def __call__(self, memory: Array, ids: Array, *, train: bool) -> tuple[Array, Array]:
        """Teacher-forced pass: ids (B, Lt) (START at 0) -> (logits (B, Lt, V), the last layer's
        output (B, Lt, hidden), which is CBR's sentence input)."""
        deterministic = not train
        h = teacher_forced_words(self, ids, deterministic)
        self_mask = speaker_self_mask(ids)
        for layer in self.layer:
            h = layer(h, memory, self_mask, deterministic=deterministic)
        return self.logit(h), h

    def init_cache(self, memory: Array, max_len: int) -> None:
        init_layer_caches(self, memory, max_len)

    def step(self, token: Array, index: Array) -> Array:
        """token (B,) at position ``index`` -> next-token logits (B, V); eval mode."""
        return cached_step(self, token, index)


class DelegatedDecoding(nn.Module):
    """``init_cache``, ``decode_step`` and ``decode`` of a model whose submodule ``decoder``
    (a Speaker or DIRL's CCR decoder) does the decoding: ``decoder.init_cache(memory, max_len)``,
    ``decoder.step(token, index)`` and ``decoder(memory, ids, train=...)[0]`` (the logits).
    The model defines ``encode`` itself (changecap_jax/decoding/search.py)."""

    def init_cache(self, memory: Array, max_len: int) -> None:
        """Create the 'cache' collection: per layer, zeroed self-attention keys/values for
        ``max_len`` positions and the cross-attention keys/values of ``memory``."""
        self.decoder.init_cache(memory, max_len)

    def decode_step(self, token: Array, index: Array) -> Array:
        """Incremental step (eval mode): token (B,) int at position ``index`` -> logits (B, V)."""
        return self.decoder.step(jnp.asarray(token, jnp.int32), index)

    def decode(self, memory: Array, ids: Array, *, train: bool = False) -> Array:
        """Full recompute: logits (B, L, V) for all positions of ``ids`` (B, L)."""
        return self.decoder(memory, jnp.asarray(ids, jnp.int32), train=train)[0]


def speaker_for(model: Any) -> Speaker:
    """The Speaker of a model with SCORER's decoder fields (``vocab_size``, ``max_len``,
    ``hidden_dim``, ``num_heads``, ``decoder_layers``, ``word_dim``, ``dropout_rate``,
    ``layer_norm_eps``); call it in the model's ``setup``."""
    return Speaker(
        vocab_size=model.vocab_size,
        max_len=model.max_len,
        hidden_dim=model.hidden_dim,
        num_heads=model.num_heads,
        num_layers=model.decoder_layers,
        word_dim=model.word_dim,
        dropout_rate=model.dropout_rate,
        layer_norm_eps=model.layer_norm_eps,
    )
