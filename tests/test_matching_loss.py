"""SCORER's token-wise matching (changecap_jax/models/losses.py): the chunked form equals the naive
one
(values and gradients), both equal a float64 NumPy reading of reference §3.1 step 4 / §3.4, and
8 simulated devices equal one.

Section numbers (§) and quirk ids (S-Q, D-Q, I-Q) refer to docs/official/ (see its README.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from changecap_jax.models import losses


def np_mtm(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """S[a, b] = 1/2 (mean_l max_m R + mean_m max_l R), R = <q[a, l], k[b, m]>, by loops."""
    q, k = q.astype(np.float64), k.astype(np.float64)
    s = np.zeros((len(q), len(k)))
    for a in range(len(q)):
        for b in range(len(k)):
            r = q[a] @ k[b].T  # (N, M)
            s[a, b] = 0.5 * (r.max(axis=1).mean() + r.max(axis=0).mean())
    return s


def np_row_ce(s: np.ndarray) -> float:
    s = s - s.max(1, keepdims=True)
    logp = s - np.log(np.exp(s).sum(1, keepdims=True))
    return float(-np.mean(np.diag(logp)))


def _tokens(seed: int, b: int, n: int, d: int = 8) -> np.ndarray:
    return np.random.RandomState(seed).randn(b, n, d).astype(np.float32)


def test_naive_matches_numpy_and_is_symmetric():
    q, k = _tokens(0, 5, 6), _tokens(1, 7, 4)  # N != M, Bq != Bk
    got = np.asarray(losses.token_matching_similarity_naive(jnp.asarray(q), jnp.asarray(k)))
    want = np_mtm(q, k)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # MTM(q, k)[a, b] == MTM(k, q)[b, a] (the two directions are summed).
    swapped = np.asarray(losses.token_matching_similarity_naive(jnp.asarray(k), jnp.asarray(q)))
    np.testing.assert_allclose(swapped.T, got, rtol=1e-6, atol=1e-6)
    # The test can tell the two directions apart: each alone differs from their mean.
    r = np.einsum("ald,bmd->ablm", q.astype(np.float64), k.astype(np.float64))
    assert np.abs(r.max(-1).mean(-1) - want).max() > 0.1
    assert np.abs(r.max(-2).mean(-1) - want).max() > 0.1


@pytest.mark.parametrize("chunk_size,backward", [
    (1, "argmax"), (3, "argmax"), (4, "argmax"), (7, "argmax"), (20, "argmax"),
    (3, "remat"), (7, "remat"),
])
def test_chunked_equals_naive_values_and_gradients(chunk_size, backward):
    # Bk = 12: 3 and 4 divide it, 7 does not, 20 exceeds it.
    q, k = jnp.asarray(_tokens(2, 5, 6)), jnp.asarray(_tokens(3, 12, 5))
    w = jnp.asarray(np.random.RandomState(4).randn(5, 12).astype(np.float32))

    def weighted(fn, q, k):
        return jnp.sum(w * fn(q, k))

    chunked = functools.partial(losses.token_matching_similarity, chunk_size=chunk_size,
                                backward=backward)
    s_naive = losses.token_matching_similarity_naive(q, k)
    s_chunk = jax.jit(chunked)(q, k)
    assert s_chunk.shape == (5, 12)
    np.testing.assert_allclose(s_chunk, s_naive, rtol=1e-6, atol=1e-6)
    g_naive = jax.grad(functools.partial(weighted, losses.token_matching_similarity_naive),
                       argnums=(0, 1))(q, k)
    g_chunk = jax.jit(jax.grad(functools.partial(weighted, chunked), argnums=(0, 1)))(q, k)
    for gn, gc in zip(g_naive, g_chunk, strict=True):
        assert float(jnp.abs(gn).max()) > 0
        np.testing.assert_allclose(gc, gn, rtol=1e-5, atol=1e-5)


def np_first_max_gradients(q: np.ndarray, k: np.ndarray, w: np.ndarray) -> tuple:
    """d sum(w * MTM(q, k)) / d(q, k) with each max's gradient sent to the FIRST maximal
    entry (np.argmax), by loops in float64."""
    q, k = q.astype(np.float64), k.astype(np.float64)
    dq, dk = np.zeros_like(q), np.zeros_like(k)
    n, m = q.shape[1], k.shape[1]
    for a in range(len(q)):
        for b in range(len(k)):
            r = q[a] @ k[b].T
            dr = np.zeros_like(r)
            dr[np.arange(n), r.argmax(axis=1)] += 0.5 / n
            dr[r.argmax(axis=0), np.arange(m)] += 0.5 / m
            dq[a] += w[a, b] * dr @ k[b]
            dk[b] += w[a, b] * dr.T @ q[a]
    return dq, dk


@pytest.mark.parametrize("chunk_size", [1, 3])
def test_argmax_backward_sends_tied_maxima_gradient_to_the_first(chunk_size):
    # Small integer tokens: the dot products are exact in float32 and many maxima are tied
    # (some tokens are repeated outright), so the tie rule decides which rows get gradient.
    rng = np.random.RandomState(9)
    q = rng.randint(-1, 2, size=(4, 5, 3)).astype(np.float32)
    k = rng.randint(-1, 2, size=(5, 6, 3)).astype(np.float32)
    q[:, 3] = q[:, 1]
    k[:, 4] = k[:, 0]
    w = rng.randn(4, 5).astype(np.float32)
    r = np.einsum("ald,bmd->ablm", q, k)
    assert ((r == r.max(axis=3, keepdims=True)).sum(axis=3) > 1).mean() > 0.2  # many ties
    want = np_first_max_gradients(q, k, w)

    def weighted(q, k):
        return jnp.sum(w * losses.token_matching_similarity(q, k, chunk_size=chunk_size))

    got = jax.jit(jax.grad(weighted, argnums=(0, 1)))(jnp.asarray(q), jnp.asarray(k))
    for g, ref in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), ref, rtol=1e-5, atol=1e-6)


def test_contrastive_loss_matches_numpy_and_naive_flag():
    q, k = _tokens(5, 6, 5), _tokens(6, 6, 5)
    scale = 0.7
    want = np_row_ce(np.exp(scale) * np_mtm(q, k))
    args = (jnp.asarray(q), jnp.asarray(k), jnp.float32(scale))
    got = float(losses.matching_contrastive_loss(*args, chunk_size=4))
    naive = float(losses.matching_contrastive_loss(*args, naive=True))
    assert got == pytest.approx(want, rel=1e-5)
    assert naive == pytest.approx(want, rel=1e-5)
    # The scale is applied as exp(logit_scale): the loss changes with it.
    other = float(losses.matching_contrastive_loss(args[0], args[1], jnp.float32(0.0)))
    assert abs(other - got) > 1e-3
    # CBR's symmetric form: 1/2 (rowCE(S) + rowCE(S^T)), the two directions differ.
    s = np.exp(scale) * np_mtm(q, k)
    assert abs(np_row_ce(s) - np_row_ce(s.T)) > 1e-3
    sym = float(losses.symmetric_matching_contrastive_loss(*args, chunk_size=4))
    assert sym == pytest.approx(0.5 * (np_row_ce(s) + np_row_ce(s.T)), rel=1e-5)


@pytest.mark.parametrize("name", ["rows", "symmetric"])
def test_contrastive_loss_sharded_8_ways_equals_single_device(name):
    assert jax.device_count() >= 8, "conftest forces 8 CPU devices"
    fn = {"rows": losses.matching_contrastive_loss,
          "symmetric": losses.symmetric_matching_contrastive_loss}[name]
    mesh = jax.make_mesh((8,), ("data",))
    q, k = jnp.asarray(_tokens(7, 16, 6)), jnp.asarray(_tokens(8, 16, 6))
    scale = jnp.float32(1.3)

    def loss(q, k, s, axis_name=None):
        # chunk 3 does not divide the gathered 16 rows.
        return fn(q, k, s, axis_name=axis_name, chunk_size=3)

    one = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    sharded = jax.shard_map(functools.partial(loss, axis_name="data"), mesh=mesh,
                            in_specs=(P("data"), P("data"), P()), out_specs=P())
    many = jax.jit(jax.value_and_grad(sharded, argnums=(0, 1, 2)))
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))
    v1, g1 = one(q, k, scale)
    v8, g8 = many(put(q), put(k), scale)
    assert float(v8) == pytest.approx(float(v1), rel=1e-6)
    for a, b in zip(g1, g8, strict=True):
        assert float(jnp.abs(a).max()) > 0
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5,
                                   atol=1e-5 * float(jnp.abs(a).max()))
