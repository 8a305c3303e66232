"""Losses of the change-captioning models, written for the GLOBAL batch.

Every function takes an optional ``axis_name``. With ``None`` the arrays are the whole batch.
Otherwise the function must run inside ``jax.shard_map`` (or ``pmap``) over a mesh axis of that
name with the batch split over its devices; cross-device statistics then go through ``psum`` or
``all_gather`` so that one device and N devices give the same value and the same gradients (up to
float rounding), and the result is identical on every device.

Reference: ``docs/official/`` §4.1 step 2 (Barlow-style DIRL loss), §4.2 step 3
(CCR InfoNCE), §3.2 / §4.2 step 4 (caption cross-entropy).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from changecap_jax.data.streams import IGNORE_INDEX

Array = jax.Array
AxisName = str | tuple[str, ...] | None

# The Barlow and InfoNCE statistics are small matmuls whose result the loss is sensitive to
# (reference §7: "note its sensitivity"); keep them in full float32 even on TPU/GPU.
_HIGHEST = jax.lax.Precision.HIGHEST


def _psum(x: Array, axis_name: AxisName) -> Array:
    return x if axis_name is None else jax.lax.psum(x, axis_name)


def _axis_size(axis_name: AxisName) -> int:
    return 1 if axis_name is None else jax.lax.axis_size(axis_name)


def _float(x: Array) -> Array:
    # At least float32 (float64 stays float64, so the tests can run in x64).
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def barlow_correlation_loss(
    y1: Array,
    y2: Array,
    *,
    off_diagonal_weight: float = 0.003,
    on_diagonal_weight: float = 1.0,
    axis_name: AxisName = None,
) -> Array:
    """DIRL loss (§4.1 step 2): Barlow-style channel cross-correlation of two MLP outputs.

    Args:
      y1, y2: (B, T, D) (or (N, D)) MLP outputs of the before / after tokens; rows are (b, t).
      off_diagonal_weight: alpha, 0.003 in the official code.
      on_diagonal_weight: the weight of the first (diagonal) term, 1 in the official code;
        0 keeps the off-diagonal term alone (docs/ablations.md).
      axis_name: mesh axis the batch is split over, or None.

    Each channel is z-scored over all N = B*T rows of the global batch with the mean and the
    Bessel-corrected (N - 1) std; C = Z1^T Z2 / N; loss = w_on * sum_i (C_ii - 1)^2
    + alpha * sum_{i != j} C_ij^2 (w_on = on_diagonal_weight). Only sums cross devices (psum),
    never the rows.
    """
    if y1.shape != y2.shape:
        raise ValueError(f"y1 and y2 must have the same shape, got {y1.shape} and {y2.shape}")
    d = y1.shape[-1]
    y1 = _float(y1).reshape(-1, d)
    y2 = _float(y2).reshape(-1, d)
    n = y1.shape[0] * _axis_size(axis_name)

    def zscore(y: Array) -> Array:
        mean = _psum(jnp.sum(y, axis=0), axis_name) / n
        centred = y - mean
        # Two-pass variance (centre first) for the same numerics as torch's std.
        var = _psum(jnp.sum(centred * centred, axis=0), axis_name) / (n - 1)
        return centred / jnp.sqrt(var)

    z1, z2 = zscore(y1), zscore(y2)
    c = _psum(jnp.matmul(z1.T, z2, precision=_HIGHEST), axis_name) / n
    diag = jnp.diagonal(c)
    on_diag = jnp.sum((diag - 1.0) ** 2)
    off_diag = jnp.sum(c * c) - jnp.sum(diag * diag)
    return on_diagonal_weight * on_diag + off_diagonal_weight * off_diag


def ccr_infonce_loss(t: Array, v: Array, *, axis_name: AxisName = None) -> Array:
    """CCR loss (§4.2 step 3): InfoNCE with logits S + S^T, S = t v^T (raw dot products).

    Args:
      t: (B, D) sequence means of the last decoder layer's self-attention output (local rows).
      v: (B, D) sequence means of its cross-attention output (local rows).
      axis_name: mesh axis the batch is split over, or None.

    Returns mean over the global rows a of -log softmax_b(S[a, b] + S[b, a])[a]. Both inputs are
    gathered over the batch; each device computes only its own rows of the (symmetric) logits
    and the row losses are summed with psum.
    """
    if t.ndim != 2 or t.shape != v.shape:
        raise ValueError(f"t and v must both be (B, D), got {t.shape} and {v.shape}")
    t, v = _float(t), _float(v)
    b_local = t.shape[0]
    if axis_name is None:
        t_all, v_all, offset = t, v, 0
    else:
        t_all = jax.lax.all_gather(t, axis_name, tiled=True)
        v_all = jax.lax.all_gather(v, axis_name, tiled=True)
        offset = jax.lax.axis_index(axis_name) * b_local
    # Rows [offset, offset + b_local) of S + S^T: S[a, :] = t_a v_all^T, S^T[a, :] = v_a t_all^T.
    logits = jnp.matmul(t, v_all.T, precision=_HIGHEST) + jnp.matmul(v, t_all.T, precision=_HIGHEST)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    rows = jnp.arange(b_local)
    nll = -log_probs[rows, offset + rows]
    return _psum(jnp.sum(nll), axis_name) / (b_local * _axis_size(axis_name))


def caption_cross_entropy(logits: Array, targets: Array, *, axis_name: AxisName = None,
                          reduction: str = "mean") -> Array:
    """torch ``CrossEntropyLoss(ignore_index=-1)`` over the global batch.

    Args:
      logits: (..., V) caption logits.
      targets: (...) int targets, ``IGNORE_INDEX`` where no loss applies.
      axis_name: mesh axis the batch is split over, or None.
      reduction: "mean" or "sum" (torch's ``reduction``).

    The sum of the token NLLs over targets != IGNORE_INDEX (psum-ed), divided for "mean" by the
    global count of such tokens. Like torch, a mean over a batch without any target is NaN.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {logits.shape} and targets {targets.shape} disagree on the leading axes"
        )
    log_probs = jax.nn.log_softmax(_float(logits), axis=-1)
    valid = targets != IGNORE_INDEX
    safe = jnp.where(valid, targets, 0)
    nll = -jnp.take_along_axis(log_probs, safe[..., None].astype(jnp.int32), axis=-1)[..., 0]
    total = _psum(jnp.sum(jnp.where(valid, nll, 0.0)), axis_name)
    if reduction == "sum":
        return total
    count = _psum(jnp.sum(valid), axis_name)
    return total / count


def cosine_infonce_loss(q: Array, k: Array, temperature: float, *,
                        axis_name: AxisName = None) -> Array:
    """InfoNCE over cosine similarities (CHEERS Eq. 9), negatives from the GLOBAL batch.

    Row a's positive is k[a]; its negatives are every other row of k in the global batch (k is
    gathered over ``axis_name``). Returns the mean over the global rows of
    -log softmax_b(cos(q_a, k_b) / temperature)[a].
    """
    if q.ndim != 2 or q.shape != k.shape:
        raise ValueError(f"q and k must both be (B, D), got {q.shape} and {k.shape}")
    normalise = lambda x: x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-8)
    q, k = normalise(_float(q)), normalise(_float(k))
    k_all, offset = _gather_batch(k, axis_name)
    logits = jnp.matmul(q, k_all.T, precision=_HIGHEST) / temperature
    return _diagonal_nll_mean(logits, offset, axis_name)


def mean_squared_error(a: Array, b: Array, *, axis_name: AxisName = None) -> Array:
    """torch ``MSELoss()`` (mean over every element) over the GLOBAL batch."""
    if a.shape != b.shape:
        raise ValueError(f"mean_squared_error: shapes {a.shape} and {b.shape} differ")
    sq = jnp.square(_float(a) - _float(b))
    return _psum(jnp.sum(sq), axis_name) / (sq.size * _axis_size(axis_name))


# ---------------------------------------------------------------------------------------------
# Token-wise matching (SCORER §3.1 step 4, §3.3 step 3, §3.4)
# ---------------------------------------------------------------------------------------------


def _check_tokens(q: Array, k: Array) -> None:
    if q.ndim != 3 or k.ndim != 3 or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must be (B, N, D) and (B', M, D) token sets, got {q.shape} and {k.shape}"
        )


def _similarities(q: Array, k: Array, precision: jax.lax.PrecisionLike) -> Array:
    """R[a, l, b, m] = <q[a, l], k[b, m]>, in the layout of the matmul (Bq N) x (Bk M): taking
    the maxima from it needs no transposed copy of R."""
    return jnp.einsum("ald,bmd->albm", q, k, precision=precision)


def _mtm(q: Array, k: Array, precision: jax.lax.PrecisionLike) -> Array:
    """S[a, b] = 1/2 (mean_l max_m R + mean_m max_l R), R[a, l, b, m] = <q[a, l], k[b, m]>."""
    r = _similarities(q, k, precision)
    return 0.5 * (jnp.mean(jnp.max(r, axis=3), axis=1) + jnp.mean(jnp.max(r, axis=1), axis=2))


def token_matching_similarity_naive(
    q: Array, k: Array, *, precision: jax.lax.PrecisionLike = None
) -> Array:
    """SCORER's token-wise matching (MTM) with the whole (Bq, Bk, N, M) tensor R in memory.

    For tests and measurement only (2.5 GB at Bq = Bk = 128, N = M = 196 in float32); the
    training path is :func:`token_matching_similarity`.
    """
    _check_tokens(q, k)
    return _mtm(q, k, precision)


def _max_and_first_argmax(r: Array, axis: int) -> tuple[Array, Array]:
    """The maximum over ``axis`` and the first index holding it (``jnp.argmax``'s rule for
    ties), as two plain reductions: XLA on CPU runs argmax's (value, index) reduction several
    times slower than a max and a min (docs/performance.md "SCORER+CBR: the batch-wide
    matching")."""
    top = jnp.max(r, axis=axis, keepdims=True)
    # A float iota: the min reduction vectorises; indices up to 2^24 are exact.
    position = jax.lax.broadcasted_iota(jnp.float32, r.shape, axis)
    first = jnp.min(jnp.where(r == top, position, r.shape[axis] - 1), axis=axis)
    return jnp.squeeze(top, axis), first.astype(jnp.int32)


def _mtm_chunk(q: Array, kc: Array, precision: jax.lax.PrecisionLike) -> tuple[Array, ...]:
    """One chunk of columns: S (Bq, c) and where the maxima are: for each query token the key
    token, (Bq, c, N), and for each key token the query token, (Bq, c, M)."""
    r = _similarities(q, kc, precision)  # (Bq, N, c, M)
    row_max, row_arg = _max_and_first_argmax(r, 3)  # (Bq, N, c)
    col_max, col_arg = _max_and_first_argmax(r, 1)  # (Bq, c, M)
    s = 0.5 * (jnp.mean(row_max, axis=1) + jnp.mean(col_max, axis=2))
    return s, jnp.swapaxes(row_arg, 1, 2), col_arg


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _mtm_chunked(q: Array, k_chunks: Array, precision: jax.lax.PrecisionLike) -> Array:
    """(Bq, N, D) x (C, c, M, D) chunks -> S (C, Bq, c), with a sparse backward pass."""
    return jax.lax.map(lambda kc: _mtm(q, kc, precision), k_chunks)  # no argmax unless needed


def _mtm_chunked_fwd(q: Array, k_chunks: Array, precision: jax.lax.PrecisionLike) -> tuple:
    s, row_arg, col_arg = jax.lax.map(lambda kc: _mtm_chunk(q, kc, precision), k_chunks)
    # Residuals: the positions of the maxima, (C, Bq, c, N + M) int32, instead of R.
    return s, (q, k_chunks, row_arg, col_arg)


def _by_column(x: Array) -> Array:
    """(C, Bq, c, ...) per-chunk results -> (C * c, Bq, ...), one entry per column b."""
    x = jnp.moveaxis(x, 2, 1)
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _by_row(x: Array) -> Array:
    """(C, Bq, c, ...) per-chunk results -> (Bq, C * c, ...), one entry per row a."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _mtm_chunked_bwd(precision: jax.lax.PrecisionLike, res: tuple, g: Array) -> tuple:
    # dS[a, b] / dR[a, l, b, m] = 1/(2N) [m = row_arg[a, b, l]] + 1/(2M) [l = col_arg[a, b, m]]:
    # R's gradient has N + M nonzeros per (a, b) out of N * M, so instead of two dense matmuls
    # the size of the forward one, token rows are gathered and scatter-added:
    #   dq[a, l]               += g/(2N) k[b, row_arg[a, b, l]]   (gather)
    #   dq[a, col_arg[a, b, m]] += g/(2M) k[b, m]                  (scatter-add)
    #   dk[b, row_arg[a, b, l]] += g/(2N) q[a, l]                  (scatter-add)
    #   dk[b, m]               += g/(2M) q[a, col_arg[a, b, m]]   (gather)
    # The first three run one column b per step, the last one row a per step: each gather
    # then reads a small (N, D) block and adds into the accumulator, which XLA fuses; the
    # temporaries stay (B, N, D) (docs/performance.md "SCORER+CBR: the batch-wide matching").
    q, k_chunks, row_arg, col_arg = res
    n, m = q.shape[1], k_chunks.shape[2]
    rows = jnp.arange(q.shape[0])[:, None]

    def column(dq: Array, xs: tuple) -> tuple[Array, Array]:
        k_b, row_arg_b, col_arg_b, g_b = xs  # (M, D), (Bq, N), (Bq, M), (Bq,)
        w_row = ((0.5 / n) * g_b)[:, None, None]
        w_col = ((0.5 / m) * g_b)[:, None, None]
        dq = dq + w_row * k_b[row_arg_b]
        dq = dq.at[jnp.broadcast_to(rows, col_arg_b.shape), col_arg_b].add(w_col * k_b)
        dk_b = jnp.zeros(k_b.shape, q.dtype).at[row_arg_b].add(w_row * q)
        return dq, dk_b

    def row(dk: Array, xs: tuple) -> tuple[Array, None]:
        q_a, col_arg_a, g_a = xs  # (N, D), (Bk, M), (Bk,)
        return dk + ((0.5 / m) * g_a)[:, None, None] * q_a[col_arg_a], None

    columns = (k_chunks.reshape(-1, *k_chunks.shape[2:]), _by_column(row_arg),
               _by_column(col_arg), _by_column(g))
    dq, dk = jax.lax.scan(column, jnp.zeros_like(q), columns)
    dk, _ = jax.lax.scan(row, dk, (q, _by_row(col_arg), _by_row(g)))
    return dq, dk.reshape(k_chunks.shape)


_mtm_chunked.defvjp(_mtm_chunked_fwd, _mtm_chunked_bwd)


def token_matching_similarity(
    q: Array,
    k: Array,
    *,
    chunk_size: int = 8,
    precision: jax.lax.PrecisionLike = None,
    backward: str = "argmax",
) -> Array:
    """SCORER's token-wise matching similarity, (Bq, N, D) x (Bk, M, D) -> (Bq, Bk).

    S[a, b] = 1/2 ((1/N) sum_l max_m R[a, b, l, m] + (1/M) sum_m max_l R[a, b, l, m]) with raw
    dot products R[a, b, l, m] = <q[a, l], k[b, m]> over all D channels: no 1/sqrt(d), heads
    summed before the max (official ``models/SCORER.py:60-70``, S-Q2). The logit scale is the
    caller's.

    Memory: ``k`` is processed ``chunk_size`` rows at a time (``jax.lax.map``) and each chunk's
    token maxima are reduced at once, so at most one (Bq, chunk_size, N, M) block of R exists
    at a time instead of the whole (Bq, Bk, N, M). ``chunk_size`` need not divide Bk (k is
    zero-padded; the padded columns are dropped before anything reads them).

    Backward pass: ``"argmax"`` (default) keeps only where each maximum is (int32, Bq*Bk*(N+M))
    and sends the gradient there (a custom VJP: one dense pass forward; backward, gathers and
    scatter-adds of the token rows at the maxima, column by column and row by row of S, instead
    of two dense passes; nothing recomputed). ``"remat"`` differentiates the chunked forward with
    ``jax.checkpoint`` (each chunk recomputed; ``jnp.max``'s rule, which splits the gradient
    between exactly tied maxima where "argmax" gives it to the first). Same values otherwise.
    """
    _check_tokens(q, k)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if backward not in ("argmax", "remat"):
        raise ValueError(f"backward must be 'argmax' or 'remat', got {backward!r}")
    bk = k.shape[0]
    chunk_size = min(chunk_size, bk)
    num_chunks = -(-bk // chunk_size)
    k = jnp.pad(k, ((0, num_chunks * chunk_size - bk), (0, 0), (0, 0)))
    k_chunks = k.reshape(num_chunks, chunk_size, *k.shape[1:])
    if backward == "argmax":
        s = _mtm_chunked(q, k_chunks, precision)
    else:
        s = jax.lax.map(jax.checkpoint(lambda kc: _mtm(q, kc, precision)), k_chunks)
    return _by_row(s)[:, :bk]  # (num_chunks, Bq, chunk_size) -> (Bq, Bk)


# The matching variants of SCORER's Fig. 3 ablation (paper §4.5 "Ablation Study of MTM").
MATCHINGS = ("official", "per_subspace", "max_pool", "mean_pool", "tokenwise_single_head")


def subspace_matching_similarity(
    q: Array,
    k: Array,
    num_heads: int,
    *,
    chunk_size: int = 8,
    precision: jax.lax.PrecisionLike = None,
    backward: str = "argmax",
) -> Array:
    """The paper's multi-head token-wise matching, one TM per head subspace, heads summed.

    S[a, b] = sum_h TM(q_h[a], k_h[b]), q_h = q[..., h*d:(h+1)*d] with d = D / num_heads (the
    head split of the attention, ``multi_head_attend``). Each head is
    :func:`token_matching_similarity` of its d channels (the same ``chunk_size`` chunking and
    backward pass), and ``jax.lax.map`` runs the heads one after another, so at most one
    (Bq, chunk_size, N, M) block of similarities exists at a time, as in the official form.
    """
    _check_tokens(q, k)
    d = q.shape[-1]
    if num_heads < 1 or d % num_heads:
        raise ValueError(f"the width {d} is not divisible into {num_heads} heads")
    split = lambda x: jnp.moveaxis(x.reshape(*x.shape[:2], num_heads, d // num_heads), 2, 0)
    per_head = jax.lax.map(
        lambda qk: token_matching_similarity(qk[0], qk[1], chunk_size=chunk_size,
                                             precision=precision, backward=backward),
        (split(q), split(k)))
    return jnp.sum(per_head, axis=0)


def pooled_similarity(
    q: Array, k: Array, pool: str, *, precision: jax.lax.PrecisionLike = None
) -> Array:
    """Global-feature similarity: S[a, b] = <pool_l q[a, l], pool_m k[b, m]>, pool = max or
    mean over the tokens (channel-wise), a raw dot product as TM's."""
    _check_tokens(q, k)
    reduce = {"max": jnp.max, "mean": jnp.mean}[pool]
    return jnp.einsum("ad,bd->ab", reduce(q, axis=1), reduce(k, axis=1), precision=precision)


def matching_similarity(
    q: Array,
    k: Array,
    *,
    matching: str = "official",
    num_heads: int = 1,
    chunk_size: int = 8,
    naive: bool = False,
    precision: jax.lax.PrecisionLike = None,
    backward: str = "argmax",
) -> Array:
    """(Bq, N, D) x (Bk, M, D) -> (Bq, Bk) similarity of one of SCORER's Fig. 3 variants.

    With R[a, b, l, m] = <q[a, l], k[b, m]> and TM(q, k) = 1/2 ((1/N) sum_l max_m R
    + (1/M) sum_m max_l R) (paper Eq. 2):

    - ``"official"``: TM over all D channels; the official code sums the heads before the max
      (S-Q2), so its "multi-head" matching is one full-width TM.
    - ``"tokenwise_single_head"``: TM without the multi-head operation (paper Fig. 3's "TM"),
      TM(q, k) over all D channels: the same function as ``"official"``.
    - ``"per_subspace"``: the paper's MTM (Eq. 3), one TM per head subspace,
      S = sum_h TM(q_h, k_h) (:func:`subspace_matching_similarity`). Eq. 3 concatenates the
      per-head scores; summing them is our reading (with one head it is TM, and it is what the
      official code would compute with the max taken per head).
    - ``"max_pool"`` / ``"mean_pool"``: S = <pool_l q[a, l], pool_m k[b, m]>
      (:func:`pooled_similarity`), the global features of paper Fig. 3.

    ``num_heads`` is read by ``"per_subspace"`` only; ``naive`` (tests) holds the whole R for
    the token-wise forms; ``chunk_size``, ``precision``, ``backward``: see
    :func:`token_matching_similarity`.
    """
    if matching not in MATCHINGS:
        raise ValueError(f"matching must be one of {MATCHINGS}, got {matching!r}")
    if matching in ("max_pool", "mean_pool"):
        return pooled_similarity(q, k, matching.removesuffix("_pool"), precision=precision)
    if matching == "per_subspace":
        if naive:
            return subspace_matching_similarity(q, k, num_heads, chunk_size=k.shape[0],
                                                precision=precision, backward=backward)
        return subspace_matching_similarity(q, k, num_heads, chunk_size=chunk_size,
                                            precision=precision, backward=backward)
    if naive:
        return token_matching_similarity_naive(q, k, precision=precision)
    return token_matching_similarity(q, k, chunk_size=chunk_size, precision=precision,
                                     backward=backward)


def _gather_batch(x: Array, axis_name: AxisName) -> tuple[Array, Array | int]:
    """All rows of the global batch and the offset of this device's rows in it."""
    if axis_name is None:
        return x, 0
    gathered = jax.lax.all_gather(x, axis_name, tiled=True)
    return gathered, jax.lax.axis_index(axis_name) * x.shape[0]


def _matching_rows(
    q: Array,
    k: Array,
    logit_scale: Array,
    axis_name: AxisName,
    chunk_size: int,
    naive: bool,
    precision: jax.lax.PrecisionLike,
    backward: str,
    matching: str = "official",
    num_heads: int = 1,
) -> tuple[Array, Array | int]:
    """This device's rows of S = exp(logit_scale) * MTM(q, k_all) (k gathered over the batch)
    and the offset of those rows in the global batch."""
    _check_tokens(q, k)
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must hold the same rows, got {q.shape[0]} and {k.shape[0]}")
    q, k = _float(q), _float(k)
    k_all, offset = _gather_batch(k, axis_name)
    sim = matching_similarity(q, k_all, matching=matching, num_heads=num_heads,
                              chunk_size=chunk_size, naive=naive, precision=precision,
                              backward=backward)
    return jnp.exp(_float(jnp.asarray(logit_scale))) * sim, offset


def _diagonal_nll_mean(logits: Array, offset: Array | int, axis_name: AxisName) -> Array:
    """Mean over the global rows a of -log softmax(logits[a])[a]; local rows start at offset."""
    b_local = logits.shape[0]
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    rows = jnp.arange(b_local)
    nll = -log_probs[rows, offset + rows]
    return _psum(jnp.sum(nll), axis_name) / (b_local * _axis_size(axis_name))


def matching_contrastive_loss(
    q: Array,
    k: Array,
    logit_scale: Array,
    *,
    axis_name: AxisName = None,
    chunk_size: int = 8,
    naive: bool = False,
    precision: jax.lax.PrecisionLike = None,
    backward: str = "argmax",
    matching: str = "official",
    num_heads: int = 1,
) -> Array:
    """Row InfoNCE over S = exp(logit_scale) * MTM(q, k) on the GLOBAL batch (§3.4 ``CrossEn``).

    Args:
      q: (B, N, D) query tokens of this device's rows a (e.g. the last SCORER layer's query
        projection of the "before" tokens).
      k: (B, M, D) key tokens of this device's rows; gathered over ``axis_name`` so that every
        global row b is a candidate column.
      logit_scale: scalar log of the multiplier (the official learnable ``logit_scale``).
      axis_name: mesh axis the batch is split over, or None.
      chunk_size, precision, backward: see :func:`token_matching_similarity`.
      naive: use :func:`token_matching_similarity_naive` (tests / measurement only).
      matching, num_heads: the similarity in place of MTM (SCORER's Fig. 3 ablation), see
        :func:`matching_similarity`; "official" is the official MTM.

    Returns mean over the global rows a of -log softmax_b(S[a, b])[a]. Each device computes only
    its rows of S (its own q against the gathered k) and the row losses are summed with psum.
    """
    logits, offset = _matching_rows(q, k, logit_scale, axis_name, chunk_size, naive, precision,
                                    backward, matching, num_heads)
    return _diagonal_nll_mean(logits, offset, axis_name)


def symmetric_matching_contrastive_loss(
    q: Array,
    k: Array,
    logit_scale: Array,
    *,
    axis_name: AxisName = None,
    chunk_size: int = 8,
    naive: bool = False,
    precision: jax.lax.PrecisionLike = None,
    backward: str = "argmax",
) -> Array:
    """1/2 [rowCE(S) + rowCE(S^T)], S = exp(logit_scale) * MTM(q, k), on the GLOBAL batch (CBR's
    loss, §3.3 step 4), from ONE matching computation as the official code.

    Arguments as :func:`matching_contrastive_loss`. Each device computes its rows of S, the
    (B, B) matrix is gathered (B^2 floats), and each device takes the row losses of S^T for its
    own rows b, i.e. the columns b of S.
    """
    logits, offset = _matching_rows(q, k, logit_scale, axis_name, chunk_size, naive, precision,
                                    backward)
    full = logits if axis_name is None else jax.lax.all_gather(logits, axis_name, tiled=True)
    transposed = jax.lax.dynamic_slice_in_dim(full, offset, logits.shape[0], axis=1).T
    return 0.5 * (_diagonal_nll_mean(logits, offset, axis_name)
                  + _diagonal_nll_mean(transposed, offset, axis_name))
