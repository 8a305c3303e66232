"""DIRL's paper ablations (docs/ablations.md): every ``configs/dirl.py:DATASET/ABLATION`` preset
switches exactly the fields it names; each Table 6/7 variant's losses against a float64 NumPy
reference of its equation (the DIRL loss of Eq. (4) with the variant's terms, the CCR InfoNCE)
computed from the model's own intermediate tensors; the caption path is the same in every
variant, and the variants without DIRL have no MLP head.

Tiny sizes (hidden 16, 4x4 grid, batch 4, one layer each) and no training: a few seconds.
Quirk ids (D-Q) refer to docs/official/dirl.md.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from ablation_helpers import assert_switches_exactly, flatten, semantic_batch

from changecap_jax import models
from changecap_jax.models import losses
from configs import common
from configs import dirl as dirl_config

DATASETS = ("synthetic", "synthetic_extreme", *dirl_config.PAPER_PRESETS)
DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "ablations.md"
B, H, W, C, L, V = 4, 4, 4, 6, 8, 12
TINY = dict(pairs="semantic_only", use_coordinates=False, hidden_dim=16, num_heads=2,
            word_dim=8, ffn_dim=32, mlp_hidden_dim=32, encoder_layers=1, decoder_layers=1,
            dropout_rate=0.0)


# ---- presets --------------------------------------------------------------------------------


@pytest.mark.parametrize("dataset", DATASETS)
def test_each_ablation_switches_exactly_its_fields(dataset):
    base = flatten(dirl_config.get_config(dataset))
    assert flatten(dirl_config.get_config(f"{dataset}/dirl_ccr")) == base  # the default
    for name, fields in dirl_config.ABLATIONS.items():
        config = dirl_config.get_config(f"{dataset}/{name}")
        got = flatten(config)
        assert_switches_exactly(base, got, fields, name, common.DROP)
        # The losses the model returns are the ones weighted (the trainer requires it).
        on = {"dirl": config.model.use_dirl, "ccr": config.model.use_ccr}
        assert set(config.loss_weights) == {loss for loss, used in on.items() if used}, name
        models.build(config.model, vocab_size=20, max_len=12)  # the fields are the model's


def test_table_rows_switch_what_the_paper_says():
    config = dirl_config.get_config("clevr_dc/transformer")
    assert (config.model.use_dirl, config.model.use_ccr, dict(config.loss_weights)) == (
        False, False, {})
    assert dict(dirl_config.get_config("clevr_dc/dirl").loss_weights) == {"dirl": 0.03}
    assert dict(dirl_config.get_config("clevr_dc/ccr").loss_weights) == {"ccr": 0.05}
    only_diag = dirl_config.get_config("clevr_dc/dirl_non_perturbation").model
    only_off = dirl_config.get_config("clevr_dc/dirl_discrimination").model
    assert (only_diag.on_diagonal_weight, only_diag.off_diagonal_weight) == (1.0, 0.0)
    assert (only_off.on_diagonal_weight, only_off.off_diagonal_weight) == (0.0, 0.003)


def test_unknown_ablation_lists_the_ablations():
    with pytest.raises(ValueError, match="dirl_discrimination"):
        dirl_config.get_config("clevr_dc/no_dirl")
    with pytest.raises(ValueError, match="spot_the_diff"):
        dirl_config.get_config("synthetic_moderate")


def test_docs_table_names_every_preset():
    text = DOCS.read_text()
    for name in dirl_config.ABLATIONS:
        assert f"`DATASET/{name}`" in text, name


# ---- float64 references ---------------------------------------------------------------------


def np_dirl(y1: np.ndarray, y2: np.ndarray, on: float, alpha: float) -> float:
    """Eq. (4) with each term's weight: on * sum_i (1 - C_ii)^2 + alpha * sum_{i!=j} C_ij^2,
    C the channel correlation of the z-scored (Bessel std) rows, as the official code."""
    y1, y2 = (np.asarray(y, np.float64).reshape(-1, y.shape[-1]) for y in (y1, y2))
    z1, z2 = ((y - y.mean(0)) / y.std(0, ddof=1) for y in (y1, y2))
    c = z1.T @ z2 / y1.shape[0]
    off = ~np.eye(c.shape[0], dtype=bool)
    return on * float(np.sum((1.0 - np.diag(c)) ** 2)) + alpha * float(np.sum(c[off] ** 2))


def np_ccr(t: np.ndarray, v: np.ndarray) -> float:
    """Paper Eq. (12)-(14) as the official code: InfoNCE over rows of S + S^T, S = t v^T."""
    s = np.asarray(t, np.float64) @ np.asarray(v, np.float64).T
    logits = s + s.T
    logits = logits - logits.max(1, keepdims=True)
    log_p = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    return float(-np.mean(np.diag(log_p)))


def test_the_term_references_are_different_functions():
    r = np.random.RandomState(0)
    y1, y2 = r.randn(40, 6), r.randn(40, 6)
    full, diag, off = (np_dirl(y1, y2, *w) for w in ((1.0, 0.003), (1.0, 0.0), (0.0, 0.003)))
    assert diag > 0 and off > 0 and full == pytest.approx(diag + off, rel=1e-12)


@pytest.mark.parametrize("on, alpha", [(1.0, 0.003), (1.0, 0.0), (0.0, 0.003)])
def test_dirl_loss_terms_equal_their_equation(on, alpha):
    r = np.random.RandomState(1)
    y1, y2 = r.randn(2, 10, 6).astype(np.float32), r.randn(2, 10, 6).astype(np.float32)
    got = losses.barlow_correlation_loss(jnp.asarray(y1), jnp.asarray(y2),
                                         off_diagonal_weight=alpha, on_diagonal_weight=on)
    assert float(got) == pytest.approx(np_dirl(y1, y2, on, alpha), rel=1e-5)


# ---- the model ------------------------------------------------------------------------------


def make_batch(seed: int = 0) -> dict[str, jax.Array]:
    return semantic_batch((H, W, C), L, V, seed)


@pytest.fixture(scope="module")
def batch() -> dict[str, jax.Array]:
    return make_batch()


def variant_model(ablation: str) -> tuple[ml_collections.ConfigDict, Any]:
    config = dirl_config.get_config(f"synthetic/{ablation}")
    config.model.update(TINY)
    return config, models.build(config.model, vocab_size=V, max_len=L)


@pytest.fixture(scope="module")
def params(batch: dict) -> dict:
    _, full = variant_model("dirl_ccr")
    return full.init({"params": jax.random.key(0)}, batch, train=False)


@pytest.fixture(scope="module")
def full_output(batch: dict, params: dict) -> Any:
    _, full = variant_model("dirl_ccr")
    return full.apply(params, batch, train=False)


def mlp_outputs(model: Any, params: dict, batch: dict) -> tuple[jax.Array, jax.Array]:
    enc = model.apply(params, batch["before"], batch["after_semantic"], method=lambda m, b, a:
                      m.encoder(m.encoder.embed_image(m._features(b), train=False),
                                m._features(a), train=False))
    return enc.mlp_before, enc.mlp_after


@pytest.mark.parametrize("ablation", list(dirl_config.ABLATIONS))
def test_variant_losses_equal_their_equations(ablation, batch, params, full_output):
    config, model = variant_model(ablation)
    out, state = model.apply(params, batch, train=False, mutable=["intermediates"])
    assert set(out.aux_losses) == set(config.loss_weights)
    # The caption path is the same in every variant: only the losses change.
    np.testing.assert_array_equal(out.caption_logits["semantic"],
                                  full_output.caption_logits["semantic"])
    if config.model.use_dirl:
        y1, y2 = mlp_outputs(model, params, batch)
        want = np_dirl(y1, y2, config.model.on_diagonal_weight, config.model.off_diagonal_weight)
        assert float(out.aux_losses["dirl"]) == pytest.approx(want, rel=1e-5)
    if config.model.use_ccr:
        last = state["intermediates"]["decoder"][f"layer_{TINY['decoder_layers'] - 1}"]
        t = np.asarray(last["self_att_out"][0]).mean(1)  # over all Lt positions (D-Q5)
        v = np.asarray(last["cross_att_out"][0]).mean(1)
        assert float(out.aux_losses["ccr"]) == pytest.approx(np_ccr(t, v), rel=1e-5)


@pytest.mark.parametrize("ablation", list(dirl_config.ABLATIONS))
def test_without_dirl_there_is_no_mlp_head(ablation, batch):
    config, model = variant_model(ablation)
    shapes = jax.eval_shape(lambda: model.init({"params": jax.random.key(0)}, batch,
                                               train=False))
    encoder = set(shapes["params"]["encoder"])
    assert ({"mlp_0", "mlp_3"} <= encoder) == config.model.use_dirl, ablation
