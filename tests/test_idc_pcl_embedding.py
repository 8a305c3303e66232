"""IDC-PCL's embedding-balance switches (models/idc_pcl.py, "Embedding balance"): what each
one changes, that the official values are the paper presets' and the CPU values the synthetic
presets', and that the CPU values give the image content a several times larger share of the
embedded image tokens on synthetic grids."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from changecap_jax.data import pipeline
from changecap_jax.models import idc_pcl
from configs import idc_pcl as idc_config

SIZES = dict(vocab_size=30, hidden_dim=32, image_dim=16, ffn_dim=64, num_heads=4,
             cross_layers=1, dropout_rate=0.0)


def features(b: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random((b, 3, 3, 16), dtype=np.float32)


def init(model: idc_pcl.IDCPCL, x: np.ndarray) -> dict:
    ids = jnp.ones((1, 6), jnp.int32)
    return model.init(jax.random.key(0), x[:1], x[:1], ids, method=model.finetune)


def embed_images(model: idc_pcl.IDCPCL, params: dict, x) -> jax.Array:
    """The embedded image tokens, LN(sigmoid(W (s x) + b) + type_pe + sinusoid) (B, N, d)."""
    return model.apply(params, x, method=lambda m, v: m._image(v, idc_pcl.TYPE_IMG1, True))


def test_image_feature_scale_multiplies_the_features_before_img_project():
    x = features(4, 0)
    ids = np.random.default_rng(1).integers(0, 30, (4, 6)).astype(np.int32)
    scaled = idc_pcl.IDCPCL(image_feature_scale=16.0, **SIZES)
    official = idc_pcl.IDCPCL(**SIZES)
    params = init(official, x)
    run = lambda m, v: m.apply(params, v, v[::-1], ids, method=m.finetune)  # noqa: E731
    # The same parameters: scale 16 on x is the official model on 16 x (img_project's bias is
    # not scaled, so a scale applied after the projection would not match) ...
    np.testing.assert_allclose(run(scaled, x).mlm_logits, run(official, 16.0 * x).mlm_logits,
                               rtol=1e-5, atol=1e-5)
    # ... and it changes what the official model computes on x.
    assert np.max(np.abs(run(scaled, x).mlm_logits - run(official, x).mlm_logits)) > 1e-2


def test_type_embedding_std_is_the_type_pe_init_and_nothing_else():
    x = features(2, 0)
    small = init(idc_pcl.IDCPCL(type_embedding_std=0.02, **SIZES), x)["params"]
    official = init(idc_pcl.IDCPCL(**SIZES), x)["params"]
    type_pe = lambda p: np.asarray(p["position_encoding"]["type_pe"]["embedding"])  # noqa: E731
    # 7 types x 32 dims = 224 draws: the sample std is within ~5 % of the true one.
    assert np.std(type_pe(official)) == pytest.approx(1.0, rel=0.15)
    assert np.std(type_pe(small)) == pytest.approx(0.02, rel=0.15)
    np.testing.assert_allclose(type_pe(small), 0.02 * type_pe(official), rtol=1e-5, atol=1e-8)
    flat_small = jax.tree_util.tree_leaves_with_path(small)
    flat_official = dict(jax.tree_util.tree_leaves_with_path(official))
    for path, leaf in flat_small:
        if "type_pe" not in jax.tree_util.keystr(path):
            np.testing.assert_array_equal(leaf, flat_official[path])


def test_switches_must_be_positive():
    x = features(1, 0)
    for field in ("image_feature_scale", "type_embedding_std"):
        with pytest.raises(ValueError, match="must be positive"):
            init(idc_pcl.IDCPCL(**{field: 0.0}, **SIZES), x)


def test_presets_official_for_papers_cpu_values_for_synthetic():
    for preset in ("finetune/clevr_change", "finetune/birds_to_words", "pretrain/clevr_change",
                   "pretrain/birds_to_words"):
        model = idc_config.get_config(preset).model
        assert (model.image_feature_scale, model.type_embedding_std) == (1.0, 1.0), preset
    for preset in ("finetune", "finetune/synthetic_extreme", "pretrain",
                   "pretrain/synthetic_extreme"):
        config = idc_config.get_config(preset)
        assert (config.model.image_feature_scale, config.model.type_embedding_std) == (
            idc_config.CPU_EMBEDDING["image_feature_scale"],
            idc_config.CPU_EMBEDDING["type_embedding_std"]), preset
        assert tuple(config.dataset.options.feature_shape) == idc_config.CPU_FEATURE_SHAPE
        assert config.model.image_dim == idc_config.CPU_FEATURE_SHAPE[-1]


def test_cpu_embedding_gives_image_content_a_larger_share(small_synthetic):
    """Per-position std over examples of the embedded image tokens (their total std is 1 after
    the LayerNorm): the image-dependent share. On the presets' 4x4x64 grids at the CPU
    model's width it is about 0.05 with the official embedding (type_pe N(0, 1) and the
    sinusoid swamp sigmoid(W x + b)) and about 0.27 with the CPU values; here the test's
    small 4x4x16 grids stand in for them."""
    batch = next(pipeline.eval_batches(small_synthetic.split("train"), global_batch_size=32))
    x = np.asarray(batch["before"], np.float32)
    sizes = {**SIZES, "hidden_dim": 128, "image_dim": x.shape[-1]}
    shares = {}
    for name, fields in (("official", {}), ("cpu", idc_config.CPU_EMBEDDING)):
        model = idc_pcl.IDCPCL(**fields, **sizes)
        tokens = embed_images(model, init(model, x), x)
        assert float(jnp.std(tokens)) == pytest.approx(1.0, abs=0.01)
        shares[name] = float(jnp.mean(jnp.std(tokens, axis=0)))
    assert shares["official"] < 0.1
    assert shares["cpu"] > 3 * shares["official"]
