"""Shared building blocks with PyTorch-compatible behaviour.

Everything here is batch-first and channels-last. The blocks reproduce the torch modules that the
official SCORER / DIRL / IDC code uses (``docs/official/common.md`` §1), so that a converted
state_dict gives the same numbers:

* initialisers that draw from the same distributions as torch's defaults and ``xavier_uniform_``
  (§1.2, §4.4);
* :class:`TorchDense` - ``nn.Linear`` (and a 1x1 ``nn.Conv2d`` applied to tokens), with the bias
  drawn from U(+-1/sqrt(fan_in)) like torch, which ``flax.linen.Dense`` cannot express;
* :func:`torch_layer_norm` - ``nn.LayerNorm`` with an explicit epsilon and torch's variance;
* :class:`MultiheadAttention` - ``nn.MultiheadAttention`` with separate q/k/v/out projections,
  additive ``-inf`` masks, independent attention-dropout masks and a key/value cache for
  incremental decoding;
* :func:`add_spatial_coordinates` - AddSpatialInfo (§2.3);
* :class:`GridPositionEmbedding` - the learned 2-D grid position embedding (§3.1 step 2),
  and :func:`embed_grid`, a grid's projected tokens with it added;
* :func:`sinusoid_table` - the fixed sinusoid position table of the caption decoders (§3.2).

Conversion of ``nn.MultiheadAttention`` weights (§1.1): ``in_proj_weight`` (3E, E) stacks
[W_q; W_k; W_v]; the Flax kernels are ``q_proj/kernel = W_q.T``, ``k_proj/kernel = W_k.T``,
``v_proj/kernel = W_v.T`` (each (E, E)), biases are the matching thirds of ``in_proj_bias``, and
``out_proj/kernel = out_proj.weight.T``. Head h owns output columns h*E/H:(h+1)*E/H.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from changecap_jax.models.base import ATTENTION
from changecap_jax.models.dropout import Dropout
from changecap_jax.models.linear import linear
from changecap_jax.models.precision import at_least_float32

Array = jax.Array
Initializer = Callable[..., Array]

# --------------------------------------------------------------------------------------------
# Initialisers (§1.2). Flax kernels are (in, out); torch weights are (out, in).
# --------------------------------------------------------------------------------------------

# torch nn.Linear / nn.Conv2d default (kaiming_uniform with a=sqrt(5)): U(+-1/sqrt(fan_in)).
# variance_scaling(1/3, fan_in, uniform) has bound sqrt(3 * (1/3) / fan_in) = 1/sqrt(fan_in).
torch_default_kernel_init: Initializer = nn.initializers.variance_scaling(
    1.0 / 3.0, "fan_in", "uniform"
)

# torch xavier_uniform_: bound sqrt(6 / (fan_in + fan_out)); symmetric in the two fans, so the
# transposed Flax layout and an Embedding table (V, D) give the same bound as in torch.
xavier_uniform: Initializer = nn.initializers.xavier_uniform()


def uniform_init(bound: float) -> Initializer:
    """U(-bound, bound), the shape of every torch uniform initialiser."""

    def init(key: Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> Array:
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def in_proj_xavier_uniform(key: Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> Array:
    """xavier_uniform of torch's stacked ``in_proj_weight`` (3E, E), for one (E, E) slice.

    torch draws the three projections as ONE (3E, E) matrix, so the bound is
    sqrt(6 / (E + 3E)) (0.05413 for E = 512), not the per-slice xavier bound.
    """
    fan_in, fan_out = shape[0], shape[1]
    bound = math.sqrt(6.0 / (fan_in + 3 * fan_out))
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def normal_zero_pad_init(key: Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> Array:
    """torch ``nn.Embedding(..., padding_idx=0)`` default: N(0, 1) with row 0 set to zero."""
    table = jax.random.normal(key, shape, dtype)
    return table.at[0].set(0.0)


# --------------------------------------------------------------------------------------------
# Dense and LayerNorm
# --------------------------------------------------------------------------------------------


class TorchDense(nn.Module):
    """``nn.Linear`` over the last axis, params ``kernel`` (in, out) and ``bias`` (out,).

    ``bias_init="torch"`` draws U(+-1/sqrt(fan_in)) as torch's Linear/Conv do; the fan-in is read
    from the input, which is why this is not a plain ``nn.Dense``. ``"zeros"`` gives zero bias
    (the biases of ``nn.MultiheadAttention``).
    """

    features: int
    kernel_init: Initializer = torch_default_kernel_init
    bias_init: str = "torch"
    use_bias: bool = True

    @nn.compact
    def __call__(self, x: Array) -> Array:
        fan_in = x.shape[-1]
        kernel = self.param("kernel", self.kernel_init, (fan_in, self.features), jnp.float32)
        y = linear(x, kernel.astype(x.dtype))
        if self.use_bias:
            if self.bias_init == "torch":
                init = uniform_init(1.0 / math.sqrt(fan_in))
            elif self.bias_init == "zeros":
                init = nn.initializers.zeros
            else:
                raise ValueError(f"bias_init must be 'torch' or 'zeros', got {self.bias_init!r}")
            bias = self.param("bias", init, (self.features,), jnp.float32)
            y = y + bias.astype(y.dtype)
        return y


def torch_layer_norm(epsilon: float, *, name: str | None = None) -> nn.LayerNorm:
    """``nn.LayerNorm`` with torch's numerics: explicit epsilon, var = mean((x - mu)^2).

    Flax's fast-variance path computes E[x^2] - E[x]^2, which differs from torch in float32.
    """
    return nn.LayerNorm(epsilon=epsilon, use_fast_variance=False, name=name)


# --------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------


def make_attention_mask(
    query_len: int, key_valid: Array | None = None, *, causal: bool = False
) -> Array | None:
    """Boolean mask (B or 1, 1, Lq, Lk), True where attention is allowed.

    ``key_valid`` (B, Lk) is the complement of torch's ``key_padding_mask``; ``causal`` is torch's
    ``attn_mask`` with -inf above the diagonal. Returns None when nothing is masked.
    """
    mask = None
    if causal:
        if key_valid is not None and key_valid.shape[-1] != query_len:
            raise ValueError("a causal mask needs as many keys as queries")
        mask = jnp.tril(jnp.ones((query_len, query_len), dtype=bool))[None, None]
    if key_valid is not None:
        pad = key_valid.astype(bool)[:, None, None, :]
        mask = pad if mask is None else jnp.logical_and(mask, pad)
    return mask


# Layouts of attention keys/values, as einsum operands: token-major (B, L, H, D), and heads
# first (B, H, D, L), the layout of the decoding caches.
TOKEN_MAJOR = "bkhd"
HEADS_FIRST = "bhdk"


def attention_scores(q: Array, k: Array, kv_layout: str = TOKEN_MAJOR) -> Array:
    """q (B, Lq, H, D) . k (B, Lk, H, D) or (B, H, D, Lk) -> scores (B, H, Lq, Lk).

    Token-major operands are moved heads first before the dot: XLA CPU's batched dots over
    (B, H) run 2-6x faster on contiguous (Lq, D) / (Lk, D) blocks than on the interleaved
    token-major layout, transposes included (docs/performance.md "Attention layout")."""
    if kv_layout == TOKEN_MAJOR:
        return jnp.einsum("bhqd,bhkd->bhqk", jnp.swapaxes(q, 1, 2), jnp.swapaxes(k, 1, 2))
    return jnp.einsum(f"bqhd,{kv_layout}->bhqk", q, k)


def attention_context(probs: Array, v: Array, kv_layout: str = TOKEN_MAJOR) -> Array:
    """probs (B, H, Lq, Lk) . v (B, Lk, H, D) or (B, H, D, Lk) -> context (B, Lq, H, D), heads
    first for the dot as :func:`attention_scores`."""
    if kv_layout == TOKEN_MAJOR:
        return jnp.swapaxes(jnp.einsum("bhqk,bhkd->bhqd", probs, jnp.swapaxes(v, 1, 2)), 1, 2)
    return jnp.einsum(f"bhqk,{kv_layout}->bqhd", probs, v)


def heads_first(x: Array) -> Array:
    """(B, L, H, D) -> (B, H, D, L): keys or values in the layout the decoding step's dots read.
    The decoding caches keep them so: in the token-major layout every decoding step transposed
    the whole cache again (XLA does not hoist such a transpose out of the decoding loop)."""
    return jnp.transpose(x, (0, 2, 3, 1))


class MultiheadAttention(nn.Module):
    """torch ``nn.MultiheadAttention`` (batch-first), with an optional key/value cache.

    Parameters: ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj`` (each ``kernel`` (E, E) and
    ``bias`` (E,)). As in torch: q is scaled by 1/sqrt(E/H) after its bias; masked scores are
    -inf (a fully masked row gives NaN, as in torch); dropout acts on the attention
    probabilities with an independent mask per element; in-projection and output biases start
    at zero; the in-projection is xavier_uniform over the stacked (3E, E) matrix.

    Cache (collection ``'cache'``, used by incremental decoding):
      * :meth:`init_self_cache` / :meth:`step_self`: self-attention over a growing prefix; keys and
        values of the positions decoded so far are kept in ``cached_key`` / ``cached_value``
        (B, H, E/H, max_len) and each step writes one position.
      * :meth:`init_cross_cache` / :meth:`step_cross`: cross-attention to a fixed memory whose
        keys and values (``memory_key`` / ``memory_value``, (B, H, E/H, N)) are projected once.
    """

    embed_dim: int
    num_heads: int
    dropout_rate: float = 0.0
    qkv_kernel_init: Initializer = in_proj_xavier_uniform
    out_kernel_init: Initializer = torch_default_kernel_init
    sow_probs: bool = False  # a decoder's cross-attention: expose it (models/base.py ATTENTION)

    def setup(self) -> None:
        if self.embed_dim % self.num_heads:
            raise ValueError(
                f"embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}"
            )
        dense = lambda init: TorchDense(self.embed_dim, kernel_init=init, bias_init="zeros")
        self.q_proj = dense(self.qkv_kernel_init)
        self.k_proj = dense(self.qkv_kernel_init)
        self.v_proj = dense(self.qkv_kernel_init)
        self.out_proj = dense(self.out_kernel_init)
        # broadcast_dims=() -> independent masks, like torch's F.dropout on the probabilities.
        self.attn_dropout = Dropout(self.dropout_rate, broadcast_dims=())

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    def _split(self, x: Array) -> Array:
        return x.reshape(*x.shape[:-1], self.num_heads, self.head_dim)

    def project_query(self, x: Array) -> Array:
        """The scaled per-head query of ``x`` (B, L, E) -> (B, L, H, E/H), for ``query=``."""
        # torch: q = (x W_q^T + b_q) * head_dim**-0.5, the scale applied after the bias.
        return self._split(self.q_proj(x)) * (1.0 / math.sqrt(self.head_dim))

    def project_key_value(self, x: Array) -> tuple[Array, Array]:
        """The per-head keys and values of ``x``, for ``key_value=``."""
        return self._split(self.k_proj(x)), self._split(self.v_proj(x))

    def _attend(
        self, q: Array, k: Array, v: Array, mask: Array | None, deterministic: bool,
        kv_layout: str = TOKEN_MAJOR,
    ) -> Array:
        """q (B, Lq, H, D); k, v (B, Lk, H, D), or (B, H, D, Lk) with ``kv_layout=HEADS_FIRST``."""
        scores = attention_scores(q, k, kv_layout)
        if mask is not None:
            scores = jnp.where(mask, scores, -jnp.inf)
        probs = jax.nn.softmax(at_least_float32(scores), axis=-1).astype(q.dtype)
        if self.sow_probs and not self.is_initializing():  # init would keep them as variables
            self.sow(ATTENTION, "probs", probs)  # a no-op unless ATTENTION is mutable
        probs = self.attn_dropout(probs, deterministic=deterministic)
        ctx = attention_context(probs, v, kv_layout)
        return self.out_proj(ctx.reshape(*ctx.shape[:-2], self.embed_dim))

    def __call__(
        self,
        inputs_q: Array,
        inputs_kv: Array,
        *,
        mask: Array | None = None,
        deterministic: bool = True,
        query: Array | None = None,
        key_value: tuple[Array, Array] | None = None,
    ) -> Array:
        """Attend from ``inputs_q`` (B, Lq, E) to ``inputs_kv`` (B, Lk, E).

        ``mask``: boolean, broadcastable to (B, H, Lq, Lk), True = may attend
        (see :func:`make_attention_mask`). ``query`` / ``key_value``: the projections of
        ``inputs_q`` / ``inputs_kv`` (:meth:`project_query`, :meth:`project_key_value`), when
        the caller already made them for an input it attends with more than once.
        """
        k, v = self.project_key_value(inputs_kv) if key_value is None else key_value
        q = self.project_query(inputs_q) if query is None else query
        return self._attend(q, k, v, mask, deterministic)

    # ---- incremental decoding -------------------------------------------------------------

    # Both caches are stored heads first, (B, H, E/H, positions): heads_first().
    def init_self_cache(self, batch_size: int, max_len: int) -> None:
        shape = (batch_size, self.num_heads, self.head_dim, max_len)
        self.put_variable("cache", "cached_key", jnp.zeros(shape, jnp.float32))
        self.put_variable("cache", "cached_value", jnp.zeros(shape, jnp.float32))

    def init_cross_cache(self, memory: Array) -> None:
        k, v = self.project_key_value(memory)
        self.put_variable("cache", "memory_key", heads_first(k))
        self.put_variable("cache", "memory_value", heads_first(v))

    def step_self(self, inputs_q: Array, index: Array, *, deterministic: bool = True) -> Array:
        """Self-attention of the token at position ``index`` (B, 1, E) over positions 0..index."""
        k_new, v_new = self.project_key_value(inputs_q)
        cached_k = self.get_variable("cache", "cached_key")
        cached_v = self.get_variable("cache", "cached_value")
        start = (0, 0, 0, index)
        keys = jax.lax.dynamic_update_slice(
            cached_k, heads_first(k_new).astype(cached_k.dtype), start)
        values = jax.lax.dynamic_update_slice(
            cached_v, heads_first(v_new).astype(cached_v.dtype), start)
        self.put_variable("cache", "cached_key", keys)
        self.put_variable("cache", "cached_value", values)
        # Causal mask of the full-recompute decoder, row `index`: keys 0..index are visible.
        mask = (jnp.arange(keys.shape[-1]) <= index)[None, None, None, :]
        return self._attend(self.project_query(inputs_q), keys, values, mask, deterministic,
                            kv_layout=HEADS_FIRST)

    def step_cross(self, inputs_q: Array, *, deterministic: bool = True) -> Array:
        """Cross-attention of (B, 1, E) queries to the memory stored by :meth:`init_cross_cache`."""
        keys = self.get_variable("cache", "memory_key")
        values = self.get_variable("cache", "memory_value")
        return self._attend(self.project_query(inputs_q), keys, values, None, deterministic,
                            kv_layout=HEADS_FIRST)


# --------------------------------------------------------------------------------------------
# Positions
# --------------------------------------------------------------------------------------------


def add_spatial_coordinates(x: Array) -> Array:
    """AddSpatialInfo (§2.3) for channels-last grids: (B, H, W, C) -> (B, H, W, C + 2).

    Channel C holds x = j*2/W - 1 (j = column), channel C+1 holds y = i*2/H - 1 (i = row); the
    grid runs from -1 up to but not including +1, as in the official code.
    """
    if x.ndim != 4:
        raise ValueError(f"add_spatial_coordinates expects (B, H, W, C), got shape {x.shape}")
    b, h, w, _ = x.shape
    xs = jnp.arange(w, dtype=x.dtype) * 2.0 / w - 1.0
    ys = jnp.arange(h, dtype=x.dtype) * 2.0 / h - 1.0
    coord_x = jnp.broadcast_to(xs[None, None, :, None], (b, h, w, 1))
    coord_y = jnp.broadcast_to(ys[None, :, None, None], (b, h, w, 1))
    return jnp.concatenate([x, coord_x, coord_y], axis=-1)


class GridPositionEmbedding(nn.Module):
    """Learned 2-D position embedding of SCORER/DIRL (§3.1 step 2), H != W allowed.

    Params ``w_embedding`` (W, dim/2) and ``h_embedding`` (H, dim/2) are torch's
    ``w_embedding.weight`` / ``h_embedding.weight`` unchanged. Returns PE (H, W, dim) with
    PE[i, j] = concat(w_embedding[j], h_embedding[i]). The table sizes come from the call.
    """

    dim: int
    embedding_init: Initializer = xavier_uniform

    @nn.compact
    def __call__(self, height: int, width: int) -> Array:
        if self.dim % 2:
            raise ValueError(f"GridPositionEmbedding needs an even dim, got {self.dim}")
        half = self.dim // 2
        w_emb = self.param("w_embedding", self.embedding_init, (width, half), jnp.float32)
        h_emb = self.param("h_embedding", self.embedding_init, (height, half), jnp.float32)
        w_part = jnp.broadcast_to(w_emb[None, :, :], (height, width, half))
        h_part = jnp.broadcast_to(h_emb[:, None, :], (height, width, half))
        return jnp.concatenate([w_part, h_part], axis=-1)


def grid_position_embedding(dim: int) -> GridPositionEmbedding:
    """SCORER's ``w_embedding`` / ``h_embedding``: ``nn.Embedding`` default init N(0, 1)
    (docs/official/scorer.md §3.5); DIRL and CHEERS keep the xavier default."""
    return GridPositionEmbedding(dim, embedding_init=nn.initializers.normal(stddev=1.0))


def embed_grid(img: nn.Module, pos_embedding: nn.Module, grid: Array) -> Array:
    """(B, H, W, C) -> 1x1 projection ``img`` + grid PE -> tokens (B, H*W, D), token
    t = i*W + j (SCORER paper Eq. 1; docs/official/scorer.md §3.1 steps 1-3)."""
    b, h, w, _ = grid.shape
    x = img(grid) + pos_embedding(h, w)[None]
    return x.reshape(b, h * w, x.shape[-1])


def sinusoid_table(length: int, dim: int, dtype: Any = np.float32) -> np.ndarray:
    """Fixed sinusoid position table (§3.2) as NumPy (length, dim) of ``dtype``.

    Row p, dim pair k: pe[p, 2k] = sin(p * w_k), pe[p, 2k + 1] = cos(p * w_k) with
    w_k = exp(-(2k) * ln(10000) / dim). Evaluated in float64 and rounded once to ``dtype``; the
    official buffer was computed in float32 and agrees to float32 rounding (about 1e-6). The
    decoders keep the float64 table and cast it to their compute dtype (float32: the same
    single rounding).
    """
    pos = np.arange(length, dtype=np.float64)[:, None]
    two_k = np.arange(0, dim, 2, dtype=np.float64)
    angles = pos * np.exp(two_k * (-math.log(10000.0) / dim))
    table = np.zeros((length, dim), dtype=np.float64)
    table[:, 0::2] = np.sin(angles)
    table[:, 1::2] = np.cos(angles[:, : dim // 2])
    return table.astype(dtype)


def model_input(x: jax.Array) -> jax.Array:
    """A stored input as the model computes it: bfloat16 stays bfloat16 (the trunk cast it to
    config.compute_dtype, changecap_jax/models/precision.py), float64 stays float64 (x64 runs, e.g.
    docs/reproduce.md); anything else (float16 features, integer test inputs) becomes
    float32."""
    x = jnp.asarray(x)
    return x if x.dtype in (jnp.bfloat16, jnp.float64) else x.astype(jnp.float32)


def grid_input(x: jax.Array, use_coordinates: bool) -> jax.Array:
    """Stored grid features -> model input (:func:`model_input`), with the two coordinate
    channels where the model uses them (AddSpatialInfo runs on-device, on CLEVR-Change only;
    §2.3)."""
    x = model_input(x)
    return add_spatial_coordinates(x) if use_coordinates else x
