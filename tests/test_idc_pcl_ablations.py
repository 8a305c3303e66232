"""IDC-PCL's paper ablations (Table 4 lines 5-6, docs/ablations.md): every
``configs/idc_pcl.py:STAGE/DATASET/ABLATION`` preset switches exactly the fields it names; without
the image difference encoder the cross-modal transformer reads the embedded image tokens, checked
against a float64 NumPy reference of the embedding (docs/official/idc_pcl.md §5.2), in both
stages; without distractor judging the fine-tuning objective has no distractor term (the full
model's term against a float64 reference) and the caption path is unchanged.

Tiny sizes (hidden 16, 2x2 grid of 6 channels, batch 4, one cross-modal block): a few seconds.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from ablation_helpers import assert_switches_exactly, flatten

from changecap_jax import models
from changecap_jax.models import idc_pcl
from configs import common
from configs import idc_pcl as idc_config

DATASETS = (*idc_config.SYNTHETIC, *idc_config.PAPER_PRESETS)
DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "ablations.md"
B, G, C, L, V, D = 4, 2, 6, 8, 12, 16
TINY = dict(hidden_dim=D, num_heads=2, ffn_dim=32, cross_layers=1, dropout_rate=0.0,
            image_dim=C, image_feature_scale=1.0, type_embedding_std=1.0)


# ---- presets --------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", idc_config.STAGES)
@pytest.mark.parametrize("dataset", DATASETS)
def test_each_ablation_switches_exactly_its_fields(stage, dataset):
    base = flatten(idc_config.get_config(f"{stage}/{dataset}"))
    assert flatten(idc_config.get_config(f"{stage}/{dataset}/full")) == base  # the default
    for name in idc_config.STAGE_ABLATIONS[stage]:
        fields = idc_config.ABLATIONS[name]
        config = idc_config.get_config(f"{stage}/{dataset}/{name}")
        got = flatten(config)
        assert_switches_exactly(base, got, fields, name, common.DROP)
        # The trainer weights exactly the model's losses.
        judged = (stage == "finetune" and config.model.pairs == "both"
                  and config.model.distractor_judging)
        assert ("distractor" in config.loss_weights) == judged, name
        models.build(config.model, vocab_size=20, max_len=12)  # the fields are the model's


def test_presets_without_an_ablation_are_unchanged():
    assert flatten(idc_config.get_config("")) == flatten(
        idc_config.get_config("finetune/synthetic/full"))
    assert flatten(idc_config.get_config("pretrain")) == flatten(
        idc_config.get_config("pretrain/synthetic/full"))


def test_distractor_judging_is_a_fine_tuning_ablation():
    with pytest.raises(ValueError, match="no_difference_encoder"):
        idc_config.get_config("pretrain/clevr_change/no_distractor_judging")
    with pytest.raises(ValueError, match="no_distractor_judging"):
        idc_config.get_config("finetune/clevr_change/no_judging")


def test_docs_table_names_every_preset():
    text = DOCS.read_text()
    for stage, names in idc_config.STAGE_ABLATIONS.items():
        for name in names:
            if name != "full":
                assert f"`{stage}/DATASET/{name}`" in text, (stage, name)


# ---- float64 references ---------------------------------------------------------------------


def np_layer_norm(x: np.ndarray, a: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    """I-Q1: a * (x - mean) / (unbiased std + eps) + b."""
    mean = x.mean(-1, keepdims=True)
    return a * (x - mean) / (x.std(-1, ddof=1, keepdims=True) + eps) + b


def np_sinusoid(length: int, dim: int) -> np.ndarray:
    """I-Q2: even column i sin(p / 10000^(2i/dim)), odd column i cos(p / 10000^(2i/dim))."""
    p, i = np.arange(length)[:, None], np.arange(dim)[None, :]
    angle = p / 10000.0 ** (2.0 * i / dim)
    return np.where(i % 2 == 0, np.sin(angle), np.cos(angle))


def np_embedded_pair(params: dict, img1: np.ndarray, img2: np.ndarray,
                     cls_id: int) -> np.ndarray:
    """Table 4 line 5's input of the cross-modal transformer: [CLS1; e1; CLS2; e2], each token
    LN(x + type_pe[t] (+ sinusoid row)), e_k = sigmoid(img_k W + b) (docs/official §5.2)."""
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), params["params"])
    pe = p["position_encoding"]
    ln = lambda x: np_layer_norm(x, pe["layernorm"]["a_2"], pe["layernorm"]["b_2"], 1e-12)
    type_pe = pe["type_pe"]["embedding"]
    cls = p["word_embedding"]["embedding"][cls_id]
    parts = []
    for img, t_cls, t_img in ((img1, idc_pcl.TYPE_CLS1, idc_pcl.TYPE_IMG1),
                              (img2, idc_pcl.TYPE_CLS2, idc_pcl.TYPE_IMG2)):
        x = np.asarray(img, np.float64).reshape(img.shape[0], -1, img.shape[-1])
        e = 1.0 / (1.0 + np.exp(-(x @ p["img_project_0"]["kernel"] + p["img_project_0"]["bias"])))
        e = ln(e + type_pe[t_img] + np_sinusoid(x.shape[1], e.shape[-1]))
        c = np.broadcast_to(ln(cls + type_pe[t_cls]), (x.shape[0], 1, e.shape[-1]))
        parts += [c, e]
    return np.concatenate(parts, 1)


def np_summed_ce(logits: np.ndarray, labels: np.ndarray) -> float:
    x = np.asarray(logits, np.float64)
    x = x - x.max(-1, keepdims=True)
    log_p = x - np.log(np.exp(x).sum(-1, keepdims=True))
    return float(-np.sum(np.take_along_axis(log_p, labels[..., None], -1)))


# ---- the model ------------------------------------------------------------------------------


def make_batch(seed: int = 0) -> dict[str, jax.Array]:
    r = np.random.RandomState(seed)

    def captions(lengths: list[int]) -> jax.Array:
        ids = np.zeros((B, L), np.int32)
        for row, n in enumerate(lengths):
            ids[row, 0], ids[row, 1:n - 1], ids[row, n - 1] = 2, r.randint(4, V, n - 2), 3
        return jnp.asarray(ids)

    grids = {k: jnp.asarray(r.rand(B, G, G, C), jnp.float32)
             for k in ("before", "after_semantic", "after_distractor")}
    return {**grids, "change_caption": captions([5, 8, 3, 6]),
            "no_change_caption": captions([4, 4, 7, 3])}


@pytest.fixture(scope="module")
def batch() -> dict[str, jax.Array]:
    return make_batch()


def variant_model(stage: str, ablation: str) -> tuple[ml_collections.ConfigDict, Any]:
    config = idc_config.get_config(f"{stage}/clevr_change/{ablation}")
    config.model.update(TINY)
    return config, models.build(config.model, vocab_size=V, max_len=L)


def init(model: Any, batch: dict) -> dict:
    if model.stage == "finetune":
        return model.init({"params": jax.random.key(0)}, batch, train=False)
    ids = batch["change_caption"]
    return model.init({"params": jax.random.key(0)}, batch["before"], batch["after_semantic"],
                      ids, method="pretrain")


@pytest.mark.parametrize("stage", idc_config.STAGES)
def test_without_the_difference_encoder_the_embeddings_feed_the_transformer(stage, batch):
    _, model = variant_model(stage, "no_difference_encoder")
    _, full = variant_model(stage, "full")
    params = init(model, batch)
    assert not {"single_img_encoder", "double_img_encoder"} & set(params["params"])
    img1, img2 = batch["before"], batch["after_semantic"]
    want = np_embedded_pair(params, np.asarray(img1), np.asarray(img2), model.cls_token)
    got = model.apply(params, img1, img2, method="image_tokens")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # The full model's difference encoder changes I (so the check above can tell them apart).
    full_params = init(full, batch)
    assert {"single_img_encoder", "double_img_encoder"} <= set(full_params["params"])
    shared = {"params": {k: v for k, v in full_params["params"].items()
                         if k in params["params"]}}
    np.testing.assert_allclose(model.apply(shared, img1, img2, method="image_tokens"),
                               np_embedded_pair(shared, np.asarray(img1), np.asarray(img2),
                                                model.cls_token), rtol=1e-5, atol=1e-5)
    assert not np.allclose(full.apply(full_params, img1, img2, method="image_tokens"),
                           model.apply(shared, img1, img2, method="image_tokens"), atol=1e-3)


def test_fine_tuning_without_the_encoder_runs_the_transformer_on_the_embeddings(batch):
    _, model = variant_model("finetune", "no_difference_encoder")
    params = init(model, batch)
    img1, img2, ids = batch["before"], batch["after_semantic"], batch["change_caption"]
    out = model.apply(params, img1, img2, ids, method="finetune")
    image = jnp.asarray(np_embedded_pair(params, np.asarray(img1), np.asarray(img2),
                                         model.cls_token), jnp.float32)
    hidden = model.apply(params, image, ids, method=lambda m, image, ids: m.encoder(
        jnp.concatenate([image, m._text(ids, True)], 1),
        idc_pcl.finetune_mask(image.shape[1], ids.shape[1]))[0])
    np.testing.assert_allclose(out.hidden, hidden, rtol=1e-4, atol=1e-5)


def test_without_distractor_judging_the_objective_has_no_distractor_term(batch):
    _, model = variant_model("finetune", "no_distractor_judging")
    config, full = variant_model("finetune", "full")
    params = init(full, batch)
    out = model.apply(params, batch, train=False)
    want = full.apply(params, batch, train=False)
    assert out.aux_losses == {} and set(want.aux_losses) == set(config.loss_weights)
    for stream in ("semantic", "distractor"):  # the same masked LM
        np.testing.assert_array_equal(out.caption_logits[stream], want.caption_logits[stream])
        np.testing.assert_array_equal(out.caption_targets[stream], want.caption_targets[stream])
    # The term line 6 removes: the summed CE of pooler(cat(CLS1, CLS2)), 1 = semantic pair.
    masked = full.apply(params, batch, method="masked_captions")
    ce = 0.0
    for stream, after, label in (("semantic", "after_semantic", 1),
                                 ("distractor", "after_distractor", 0)):
        logits = full.apply(params, batch["before"], batch[after], masked[stream][0],
                            method="finetune").distractor_logits
        ce += np_summed_ce(np.asarray(logits), np.full((B,), label))
    assert float(want.aux_losses["distractor"]) == pytest.approx(ce, rel=1e-5)
