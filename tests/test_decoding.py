"""Cached greedy / sampling decoding (changecap_jax/decoding/search.py) on a tiny random
DIRLCCR."""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from changecap_jax.decoding import search
from changecap_jax.models.dirl import DIRLCCR

B, H, W, C, L, V = 6, 4, 4, 6, 8, 12
MODEL = DIRLCCR(
    vocab_size=V,
    max_len=L,
    hidden_dim=32,
    num_heads=4,
    word_dim=12,
    ffn_dim=64,
    mlp_hidden_dim=64,
    pairs="semantic_only",
)


def _features(seed: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    r = np.random.RandomState(seed)
    return (
        jnp.asarray(r.randn(B, H, W, C), jnp.float32),
        jnp.asarray(r.randn(B, H, W, C), jnp.float32),
    )


def _random_params(seed: int, *, end_bias: float = 5.0, unk_bias: float = 0.0) -> dict:
    """Random DIRLCCR params drawn with NumPy from the model's param shapes (no init compile).

    The logit layer is sharpened so that greedy paths vary with the input, PAD is made
    impossible (a trained model never predicts it; sampling PAD would not end a row), and
    END gets a bias so that rows finish at different steps.
    """
    before, after = _features(0)
    batch = {
        "before": before,
        "after_semantic": after,
        "change_caption": jnp.zeros((B, L), jnp.int32).at[:, 0].set(2),
    }
    shapes = jax.eval_shape(
        lambda b: MODEL.init({"params": jax.random.key(0)}, b, train=False), batch
    )["params"]
    r = np.random.RandomState(seed)
    flat = {}
    for path, s in flax.traverse_util.flatten_dict(shapes).items():
        if path[-1] == "scale":
            value = 1.0 + 0.1 * r.randn(*s.shape)
        elif len(s.shape) == 2:
            value = r.randn(*s.shape) / np.sqrt(s.shape[0])
        else:
            value = 0.1 * r.randn(*s.shape)
        flat[path] = value.astype(np.float32)
    logit = ("decoder", "logit")
    flat[logit + ("kernel",)] *= 4.0
    flat[logit + ("bias",)][0] = -1e4
    flat[logit + ("bias",)][3] += end_bias
    flat[logit + ("bias",)][1] += unk_bias
    params = flax.traverse_util.unflatten_dict({k: jnp.asarray(v) for k, v in flat.items()})
    return {"params": params}


def _check_layout(ids: np.ndarray, log_probs: np.ndarray) -> int:
    """START at 0, no UNK, zeros from END on; returns how many rows ended early."""
    assert ids.shape == (B, L) and log_probs.shape == (B, L)
    assert np.all(ids[:, 0] == search.START_ID)
    assert not np.any(ids == search.UNK_ID)
    early = 0
    for row, lp in zip(ids, log_probs, strict=True):
        zeros = np.flatnonzero(row[1:] == 0)
        assert lp[0] == 0 and np.all(lp[1:][row[1:] != 0] <= 0)
        if zeros.size:
            end = zeros[0] + 1  # END was chosen here and written as 0
            assert np.all(row[end:] == 0)
            assert np.all(lp[end + 1 :] == 0)
            early += 1
    return early


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cached_greedy_equals_full_recompute(seed):
    variables = _random_params(seed)
    before, after = _features(100 + seed)
    fast = search.greedy_decode(MODEL, variables, before, after, max_len=L)
    slow = search.full_recompute_greedy(MODEL, variables, before, after, max_len=L)
    np.testing.assert_array_equal(fast.ids, slow.ids)
    np.testing.assert_allclose(fast.log_probs, slow.log_probs, rtol=1e-5, atol=1e-5)
    ids = np.asarray(fast.ids)
    early = _check_layout(ids, np.asarray(fast.log_probs))
    # The comparison is meaningful: some rows stop early, some run on, words vary.
    assert 0 < early
    assert len(np.unique(ids[:, 1:])) >= 3


def test_sampling_is_deterministic_per_key_and_varies_across_keys():
    variables = _random_params(0, end_bias=0.0)
    before, after = _features(7)
    a = search.sample_decode(MODEL, variables, before, after, jax.random.key(1), max_len=L)
    b = search.sample_decode(MODEL, variables, before, after, jax.random.key(1), max_len=L)
    c = search.sample_decode(MODEL, variables, before, after, jax.random.key(2), max_len=L)
    np.testing.assert_array_equal(a.ids, b.ids)
    np.testing.assert_array_equal(a.log_probs, b.log_probs)
    assert not np.array_equal(a.ids, c.ids)
    for out in (a, c):
        _check_layout(np.asarray(out.ids), np.asarray(out.log_probs))


def test_unk_is_never_emitted_even_when_most_likely():
    # UNK would win every argmax without the ban (-1e10 after the log-softmax).
    variables = _random_params(3, unk_bias=50.0)
    before, after = _features(8)
    greedy = search.greedy_decode(MODEL, variables, before, after, max_len=L)
    sampled = search.sample_decode(MODEL, variables, before, after, jax.random.key(0), max_len=L)
    for out in (greedy, sampled):
        _check_layout(np.asarray(out.ids), np.asarray(out.log_probs))
    # Without the ban it would be chosen: the raw argmax at step 0 is UNK.
    memory = search._encode(MODEL, variables, before, after)
    logits = search._full_logits(MODEL, variables, memory, greedy.ids)
    assert np.all(np.argmax(np.asarray(logits[:, 0]), -1) == search.UNK_ID)


def test_all_rows_finished_stops_with_zeros():
    variables = _random_params(4, end_bias=60.0)  # END everywhere at the first step
    before, after = _features(9)
    out = search.greedy_decode(MODEL, variables, before, after, max_len=L)
    np.testing.assert_array_equal(out.ids[:, 0], search.START_ID)
    np.testing.assert_array_equal(out.ids[:, 1:], 0)
    assert np.all(np.isfinite(np.asarray(out.log_probs[:, 1])))
    np.testing.assert_array_equal(out.log_probs[:, 2:], 0)
