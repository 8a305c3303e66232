"""The hashed dropout (changecap_jax/models/dropout.py): nn.Dropout's contract, and masks whose
statistics are those of independent Bernoulli draws."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from changecap_jax.models import dropout
from changecap_jax.models.dropout import Dropout, keep_mask

N = 1 << 20  # elements per statistical check: the keep rate's std is ~3e-4 at p = 0.9


def _sigmas(observed: float, expected: float, variance: float, n: int) -> float:
    return abs(observed - expected) / np.sqrt(variance / n)


@pytest.mark.parametrize("keep_prob", [0.9, 0.5, 0.2])
def test_keep_rate_and_neighbour_independence(keep_prob):
    mask = np.asarray(keep_mask(jax.random.key(3), (N,), keep_prob))
    assert _sigmas(mask.mean(), keep_prob, keep_prob * (1 - keep_prob), N) < 5
    # Neighbours (last axis and a row of 196 apart, as in attention maps) are uncorrelated.
    for lag in (1, 196):
        a, b = mask[:-lag].astype(np.float64), mask[lag:].astype(np.float64)
        corr = np.corrcoef(a, b)[0, 1]
        assert abs(corr) < 5 / np.sqrt(N), (lag, corr)


def test_masks_of_different_keys_are_independent():
    p = 0.9
    keys = [jax.random.key(0), jax.random.key(1), jax.random.fold_in(jax.random.key(0), 1)]
    masks = [np.asarray(keep_mask(k, (N,), p)) for k in keys]
    both_agree = p * p + (1 - p) * (1 - p)  # P(same bit) for independent masks
    for i in range(len(masks)):
        for j in range(i + 1, len(masks)):
            agree = np.mean(masks[i] == masks[j])
            assert _sigmas(agree, both_agree, both_agree * (1 - both_agree), N) < 5, (i, j)
    # The same key gives the same mask (a pure function of key and position).
    np.testing.assert_array_equal(masks[0], np.asarray(keep_mask(keys[0], (N,), p)))


def test_module_scales_kept_elements_and_follows_nn_dropout_contract():
    x = jnp.asarray(np.random.RandomState(0).rand(64, 196, 32).astype(np.float32) + 0.5)
    rate = 0.25
    layer = Dropout(rate)
    out = np.asarray(layer.apply({}, x, deterministic=False, rngs={"dropout": jax.random.key(7)}))
    kept = out != 0
    np.testing.assert_allclose(out[kept], np.asarray(x)[kept] / (1 - rate), rtol=1e-6)
    assert _sigmas(kept.mean(), 1 - rate, rate * (1 - rate), kept.size) < 5
    # deterministic and rate 0 return the input; rate 1 zeros everything, as nn.Dropout does.
    np.testing.assert_array_equal(layer.apply({}, x, deterministic=True), x)
    for r in (0.0, 1.0):
        ours = Dropout(r).apply({}, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
        flax = nn.Dropout(r).apply({}, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
        np.testing.assert_array_equal(ours, flax)
    with pytest.raises(ValueError, match="deterministic"):
        layer.apply({}, x)  # neither the field nor the call says


def test_broadcast_dims_share_one_mask_value():
    x = jnp.ones((8, 50, 16), jnp.float32)
    out = np.asarray(Dropout(0.5, broadcast_dims=(1,)).apply(
        {}, x, deterministic=False, rngs={"dropout": jax.random.key(2)}))
    assert np.all(out == out[:, :1, :])  # constant along the broadcast axis
    assert 0 < np.mean(out[:, 0, :] != 0) < 1


def test_keep_probability_resolution():
    """The threshold is round(p * 2**32): p = 1 - 2**-32 still drops nothing in practice, and
    the top of the range cannot overflow the uint32 threshold."""
    mask = np.asarray(keep_mask(jax.random.key(0), (4096,), 1.0 - 1e-12))
    assert mask.all()


def test_masks_under_the_counter_limit_keep_their_bits():
    """The two-word counter leaves a mask under 2**32 elements exactly as the one-word formula
    makes it (the docstring's formula, computed here in numpy)."""
    key, p, shape = jax.random.key(5), 0.8, (3, 7, 11)
    s0, s1 = (np.uint32(v) for v in np.asarray(jax.random.bits(key, (2,), jnp.uint32)))

    def lowbias32(x):
        x = x ^ (x >> 16)
        x = x * np.uint32(0x7FEB352D)
        x = x ^ (x >> 15)
        x = x * np.uint32(0x846CA68B)
        return x ^ (x >> 16)

    i = np.arange(np.prod(shape), dtype=np.uint32).reshape(shape)
    with np.errstate(over="ignore"):
        expected = lowbias32(lowbias32(i * np.uint32(0x9E3779B9) + s0) ^ s1) < np.uint32(
            round(p * 2**32))
    np.testing.assert_array_equal(np.asarray(keep_mask(key, shape, p)), expected)


def test_two_word_counter_blocks(monkeypatch):
    """Over the limit (lowered here to 2**14 so the arrays stay small), block 0 keeps the
    one-word bits and the other blocks are new, independent-looking masks."""
    p, key = 0.9, jax.random.key(4)
    block = (64, 128)  # 2**13 elements, under the lowered limit
    one_word = np.asarray(keep_mask(key, block, p))
    monkeypatch.setattr(dropout, "COUNTER_LIMIT", 2**14)
    mask = np.asarray(keep_mask(key, (128, *block), p))  # 2**20 elements: 128 blocks
    np.testing.assert_array_equal(mask[0], one_word)
    n = mask.size
    assert _sigmas(mask.mean(), p, p * (1 - p), n) < 5
    # A block against the next, and every block against block 0, agree as independent masks
    # (against the one block 0, given its own keep rate q0).
    q0, rest = mask[0].mean(), n - mask[0].size
    for agree, expected in ((np.mean(mask[1:] == mask[:-1]), p * p + (1 - p) * (1 - p)),
                            (np.mean(mask[1:] == mask[:1]), q0 * p + (1 - q0) * (1 - p))):
        assert _sigmas(agree, expected, expected * (1 - expected), rest) < 5
    with pytest.raises(dropout.DropoutSizeError, match="blocks"):
        keep_mask(key, (2**15,), p)  # one dimension over the limit: no block to count


def test_dropout_over_2_32_elements_traces():
    """A global batch whose dropout mask has 2**32 elements or more (the aot check at batch
    262144) traces; abstract evaluation, so nothing that large is allocated."""
    x = jax.ShapeDtypeStruct((2**16, 2**9, 2**8), jnp.bfloat16)  # 2**33 elements
    out = jax.eval_shape(
        lambda v: Dropout(0.1).apply({}, v, deterministic=False,
                                     rngs={"dropout": jax.random.key(0)}), x)
    assert out.shape == x.shape and out.dtype == x.dtype
