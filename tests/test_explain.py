"""Attention heatmaps (changecap_jax/decoding/attention_maps.py) through the one hook of
models/base.py.

The teacher-forced heatmap of a decoded caption must equal the mean of the cross-attention
the cached decoder actually used at each generated position, for every model on the trunk.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from changecap_jax import models
from changecap_jax.decoding import attention_maps, search
from changecap_jax.models.base import ATTENTION

B, H, W, C, L, V = 5, 3, 4, 6, 9, 14
SIZES = {
    "dirl": dict(hidden_dim=32, num_heads=4, word_dim=12, ffn_dim=64, mlp_hidden_dim=64),
    "scorer": dict(hidden_dim=32, num_heads=4, word_dim=12, encoder_layers=1),
    "subtraction": dict(hidden_dim=32, num_heads=4, word_dim=12),
}


def _model_and_params(name: str, seed: int = 0, end_bias: float = 2.0):
    import importlib

    config = importlib.import_module(f"configs.{name}").get_config("synthetic").model
    config.update(SIZES[name], pairs="semantic_only", dropout_rate=0.0)
    model = models.build(config, vocab_size=V, max_len=L)
    r = np.random.RandomState(seed)
    batch = {"before": jnp.asarray(2 * r.randn(B, H, W, C), jnp.float32),
             "after_semantic": jnp.asarray(2 * r.randn(B, H, W, C), jnp.float32),
             "change_caption": jnp.zeros((B, L), jnp.int32).at[:, 0].set(2)}
    params = model.init({"params": jax.random.key(seed)}, batch, train=False)["params"]
    # Random weights decode nearly alike for every input; as in test_beam_search: a louder
    # memory (cross-attention kernels x3), a sharper output layer, no PAD / START, some END.
    flat = flax.traverse_util.flatten_dict(params)
    for path in flat:
        if path[-1] == "kernel" and {"cross_att", "dec_enc_attention"} & set(path):
            flat[path] = flat[path] * 3.0
    logit = ("decoder", "logit")
    flat[logit + ("kernel",)] = flat[logit + ("kernel",)] * 2.0
    flat[logit + ("bias",)] = flat[logit + ("bias",)].at[jnp.array([0, 2])].set(-1e4).at[3].add(
        end_bias)
    params = flax.traverse_util.unflatten_dict(flat)
    return model, {"params": params}, batch["before"], batch["after_semantic"]


def _stepwise_attention(model, variables, before, after, ids) -> np.ndarray:
    """(B, H*W): the cached decoder's cross-attention at each position that predicted a word
    or END, sown during decode_step, averaged over layers, heads and those positions."""
    memory = model.apply(variables, before, after, method="encode")
    _, state = model.apply(variables, memory, L, method="init_cache", mutable=["cache"])
    cache = state["cache"]
    words = (np.asarray(ids)[:, 1:] != 0).sum(axis=1)
    n_queries = np.minimum(words + 1, L - 1)
    total = np.zeros((B, memory.shape[1]))
    for k in range(int(n_queries.max())):
        _, mutated = model.apply({**variables, "cache": cache}, jnp.asarray(ids[:, k]), k,
                                 method="decode_step", mutable=["cache", ATTENTION])
        cache = mutated["cache"]
        probs = jax.tree_util.tree_leaves(mutated[ATTENTION])  # (B, heads, 1, M) per layer
        step = np.mean([np.asarray(p)[:, :, 0].mean(axis=1) for p in probs], axis=0)
        total += step * (k < n_queries)[:, None]
    return total / n_queries[:, None]


@pytest.mark.parametrize("name", sorted(SIZES))
def test_heatmap_is_the_cached_decoders_attention(name):
    model, variables, before, after = _model_and_params(name)
    assert type(model).MEMORY_LAYOUT == "shared_grid"
    # Captions of 0 to L-1 words (the last never ended: no END within max_len), as decoding
    # writes them: START, words, zeros from END on.
    rng = np.random.default_rng(1)
    ids = np.zeros((B, L), np.int32)
    ids[:, 0] = search.START_ID
    for row, words in enumerate([0, 2, 5, 3, L - 1]):
        ids[row, 1:1 + words] = rng.integers(4, V, size=words)
    maps = attention_maps.attention_maps(model, variables, before, after, ids)
    expected = _stepwise_attention(model, variables, before, after, ids).reshape(B, H, W)
    assert maps.before.shape == (B, H, W)
    np.testing.assert_allclose(maps.before, expected, atol=1e-5)
    np.testing.assert_array_equal(maps.before, maps.after)  # one grid for both images
    np.testing.assert_allclose(maps.before.sum(axis=(1, 2)), 1.0, atol=1e-5)
    assert np.ptp(maps.before) > 1e-3  # not uniform: the check above can tell layouts apart


def test_model_without_layout_is_refused(monkeypatch):
    model, variables, before, after = _model_and_params("dirl")
    monkeypatch.setattr(type(model), "MEMORY_LAYOUT", "somewhere")
    with pytest.raises(ValueError, match="MEMORY_LAYOUT is 'somewhere'"):
        attention_maps.attention_maps(model, variables, before, after, np.zeros((B, L), np.int32))


def test_localization_is_the_pointing_game_on_the_union_of_the_boxes():
    # A 4 x 4 grid over a 100 x 200 (h x w) image: cells 25 high and 50 wide. The before box
    # [60, 30, 80, 20] covers 0.8 x 0.8 = 0.64 of cells (1, 1) and (1, 2); the after box
    # [150, 0, 50, 25] is exactly cell (0, 3).
    heat = np.full((4, 4, 4), 0.01, np.float32)
    heat[0, 1, 2] = 1.0  # peak in a cell 64 % inside the before box
    heat[1, 3, 0] = 1.0  # peak outside both boxes
    heat[2, 0, 3] = 1.0  # peak on the after box only (the object was added)
    heat[3] = 1.0        # uniform: every cell ties at the peak
    absent = np.array([-1, -1, -1, -1], np.float32)
    boxes_before = np.array([[60, 30, 80, 20], [60, 30, 80, 20], absent, [0, 0, 100, 50]],
                            np.float32)
    boxes_after = np.array([absent, absent, [150, 0, 50, 25], [50, 0, 100, 50]], np.float32)
    result = attention_maps.localization(heat, boxes_before, boxes_after, (100, 200))
    # Pair 3's boxes overlap: their union is rows 0-1, columns 0-2, 6 of 16 cells.
    assert result.num_pairs == 4
    assert result.hit_rate == pytest.approx((0.64 + 0 + 1 + 6 / 16) / 4)
    assert result.uniform_rate == pytest.approx((0.08 + 0.08 + 1 / 16 + 6 / 16) / 4)


def test_overlay_keeps_size_and_marks_the_peak():
    image = np.full((40, 60, 3), 128, np.uint8)
    heat = np.zeros((2, 3), np.float32)
    heat[1, 2] = 1.0
    out = attention_maps.overlay(image, heat)
    assert out.shape == image.shape and out.dtype == np.uint8
    # The peak's corner turns towards the ramp's bright end, the opposite corner stays dark.
    assert out[35, 55].astype(int).sum() > out[5, 5].astype(int).sum() + 100
