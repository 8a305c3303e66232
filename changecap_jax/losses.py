"""Losses of the change-captioning models, written for the GLOBAL batch.

Every function takes an optional ``axis_name``. With ``None`` the arrays are the whole batch.
Otherwise the function must run inside ``jax.shard_map`` (or ``pmap``) over a mesh axis of that
name with the batch split over its devices; cross-device statistics then go through ``psum`` or
``all_gather`` so that one device and N devices give the same value and the same gradients (up to
float rounding), and the result is identical on every device.

Reference: ``reference/official_pytorch.md`` §4.1 step 2 (Barlow-style DIRL loss), §4.2 step 3
(CCR InfoNCE), §3.2 / §4.2 step 4 (caption cross-entropy).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from changecap_jax.models.base import IGNORE_INDEX

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
    axis_name: AxisName = None,
) -> Array:
    """DIRL loss (§4.1 step 2): Barlow-style channel cross-correlation of two MLP outputs.

    Args:
      y1, y2: (B, T, D) (or (N, D)) MLP outputs of the before / after tokens; rows are (b, t).
      off_diagonal_weight: alpha, 0.003 in the official code.
      axis_name: mesh axis the batch is split over, or None.

    Each channel is z-scored over all N = B*T rows of the global batch with the mean and the
    Bessel-corrected (N - 1) std; C = Z1^T Z2 / N; loss = sum_i (C_ii - 1)^2
    + alpha * sum_{i != j} C_ij^2. Only sums cross devices (psum), never the rows.
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
    return on_diag + off_diagonal_weight * off_diag


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


def caption_cross_entropy(logits: Array, targets: Array, *, axis_name: AxisName = None) -> Array:
    """torch ``CrossEntropyLoss(ignore_index=-1)`` (mean) over the global batch.

    Args:
      logits: (..., V) caption logits.
      targets: (...) int targets, ``IGNORE_INDEX`` where no loss applies.
      axis_name: mesh axis the batch is split over, or None.

    Sum of the token NLLs over targets != IGNORE_INDEX divided by the global count of such
    tokens (both psum-ed). Like torch, a batch without any target gives NaN.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {logits.shape} and targets {targets.shape} disagree on the leading axes"
        )
    log_probs = jax.nn.log_softmax(_float(logits), axis=-1)
    valid = targets != IGNORE_INDEX
    safe = jnp.where(valid, targets, 0)
    nll = -jnp.take_along_axis(log_probs, safe[..., None].astype(jnp.int32), axis=-1)[..., 0]
    total = _psum(jnp.sum(jnp.where(valid, nll, 0.0)), axis_name)
    count = _psum(jnp.sum(valid), axis_name)
    return total / count
