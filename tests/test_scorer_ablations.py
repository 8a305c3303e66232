"""SCORER's paper ablations (docs/ablations.md): every ``configs/scorer.py:DATASET/ABLATION``
preset switches exactly the fields it names; each Fig. 3 matching variant against a float64
NumPy reference of its equation, alone and inside the model's L_sim; the per-subspace matching
chunked == unchunked (values and gradients); the Table 6 variants' losses.

Tiny sizes (hidden 16, 4x4 grid, batch 4) and no training: a few seconds of compiles.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ablation_helpers import assert_switches_exactly, flatten, semantic_batch

from changecap_jax import models
from changecap_jax.models import losses
from changecap_jax.models.scorer import SCORERCBR
from configs import scorer as scorer_config

DATASETS = ("synthetic", "synthetic_extreme", *scorer_config.PAPER_PRESETS)
DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "ablations.md"
B, H, W, C, L, V = 4, 4, 4, 6, 8, 12
TINY = dict(hidden_dim=16, num_heads=4, encoder_heads=4, word_dim=8, encoder_layers=1,
            decoder_layers=1, dropout_rate=0.0)


# ---- presets --------------------------------------------------------------------------------


@pytest.mark.parametrize("dataset", DATASETS)
def test_each_ablation_switches_exactly_its_fields(dataset):
    base = flatten(scorer_config.get_config(dataset))
    assert flatten(scorer_config.get_config(f"{dataset}/scorer_cbr")) == base  # the default
    for name, fields in scorer_config.ABLATIONS.items():
        config = scorer_config.get_config(f"{dataset}/{name}")
        got = flatten(config)
        assert_switches_exactly(base, got, fields, name, scorer_config.DROP)
        # The losses the model returns are the ones weighted (the trainer requires it).
        on = {"sim": config.model.use_sim, "cbr": config.model.use_cbr}
        assert set(config.loss_weights) == {loss for loss, used in on.items() if used}, name
        assert ("cbr" in config.optim.frozen) <= config.model.use_cbr, name
        models.build(config.model, vocab_size=20, max_len=12)  # the fields are the model's


def test_sweeps_change_what_they_name():
    config = scorer_config.get_config("clevr_change/heads4")
    assert (config.model.encoder_heads, config.model.num_heads) == (4, 8)  # decoder keeps 8
    assert scorer_config.get_config("spot_the_diff/layers1").model.encoder_layers == 1
    assert scorer_config.get_config("clevr_dc/layers1").model == (
        scorer_config.get_config("clevr_dc").model)  # the paper's CLEVR-DC value is 1


def test_unknown_ablation_lists_the_ablations():
    with pytest.raises(ValueError, match="rr_cbr"):
        scorer_config.get_config("clevr_change/rr+cbr")


def test_docs_table_names_every_preset():
    text = DOCS.read_text()
    for name in scorer_config.ABLATIONS:
        if not name[-1].isdigit():
            assert f"`DATASET/{name}`" in text, name
    for prefix in ("heads", "layers"):
        values = [n.removeprefix(prefix) for n in scorer_config.ABLATIONS
                  if n.startswith(prefix) and n.removeprefix(prefix).isdigit()]
        assert f"`DATASET/{prefix}{{{','.join(values)}}}`" in text, prefix
    assert "configs/subtraction.py" in text


# ---- matching variants against float64 NumPy ------------------------------------------------


def np_tm(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Paper Eq. 2: 1/2 ((1/N) sum_l max_m R + (1/M) sum_m max_l R), R = <q_l, k_m>."""
    r = np.einsum("ald,bmd->ablm", q.astype(np.float64), k.astype(np.float64))
    return 0.5 * (r.max(-1).mean(-1) + r.max(-2).mean(-1))


def np_similarity(matching: str, q: np.ndarray, k: np.ndarray, heads: int) -> np.ndarray:
    q, k = q.astype(np.float64), k.astype(np.float64)
    if matching in ("official", "tokenwise_single_head"):
        return np_tm(q, k)
    if matching == "per_subspace":  # sum over head subspaces of the per-head TM
        d = q.shape[-1] // heads
        return sum(np_tm(q[..., h * d:(h + 1) * d], k[..., h * d:(h + 1) * d])
                   for h in range(heads))
    pool = {"max_pool": np.max, "mean_pool": np.mean}[matching]
    return pool(q, axis=1) @ pool(k, axis=1).T


def np_row_ce(s: np.ndarray) -> float:
    s = s - s.max(1, keepdims=True)
    return float(-np.mean(np.diag(s - np.log(np.exp(s).sum(1, keepdims=True)))))


def tokens(seed: int) -> tuple[jax.Array, jax.Array]:
    r = np.random.RandomState(seed)
    return (jnp.asarray(r.randn(3, 5, 8), jnp.float32),
            jnp.asarray(r.randn(4, 6, 8), jnp.float32))


@pytest.mark.parametrize("matching", losses.MATCHINGS)
def test_matching_variant_equals_its_equation(matching):
    q, k = tokens(0)
    got = np.asarray(losses.matching_similarity(q, k, matching=matching, num_heads=2,
                                                chunk_size=3))
    want = np_similarity(matching, np.asarray(q), np.asarray(k), 2)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_the_references_are_different_functions():
    # Else a variant could equal another's reference by accident of the inputs.
    q, k = (np.asarray(x) for x in tokens(0))
    distinct = ("official", "per_subspace", "max_pool", "mean_pool")
    refs = [np_similarity(m, q, k, 2) for m in distinct]
    for i in range(len(refs)):
        for j in range(i):
            assert not np.allclose(refs[i], refs[j], rtol=1e-3), (distinct[i], distinct[j])


def test_official_and_single_head_tm_are_todays_matching():
    q, k = tokens(1)
    today = losses.token_matching_similarity(q, k, chunk_size=3)
    for matching in ("official", "tokenwise_single_head"):
        np.testing.assert_array_equal(
            losses.matching_similarity(q, k, matching=matching, num_heads=2, chunk_size=3),
            today)


def unchunked_per_subspace(q: jax.Array, k: jax.Array, heads: int) -> jax.Array:
    """The per-subspace matching with every (Bq, Bk, N, M) block at once, jnp.max's gradient."""
    d = q.shape[-1] // heads
    r = jnp.einsum("alhd,bmhd->hablm", q.reshape(*q.shape[:2], heads, d),
                   k.reshape(*k.shape[:2], heads, d))
    return jnp.sum(0.5 * (r.max(-1).mean(-1) + r.max(-2).mean(-1)), axis=0)


@pytest.mark.parametrize("chunk_size", [1, 3])
def test_per_subspace_chunked_equals_unchunked(chunk_size):
    q, k = tokens(2)
    weights = jnp.asarray(np.random.RandomState(3).randn(3, 4), jnp.float32)

    def weighted(fn):
        return lambda q, k: jnp.sum(weights * fn(q, k))

    chunked = lambda q, k: losses.subspace_matching_similarity(q, k, 4, chunk_size=chunk_size)
    whole = lambda q, k: unchunked_per_subspace(q, k, 4)
    np.testing.assert_allclose(chunked(q, k), whole(q, k), rtol=1e-6, atol=1e-6)
    g_chunked = jax.grad(weighted(chunked), argnums=(0, 1))(q, k)
    g_whole = jax.grad(weighted(whole), argnums=(0, 1))(q, k)
    for a, b in zip(g_chunked, g_whole, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# ---- the model ------------------------------------------------------------------------------


def make_batch(seed: int = 0) -> dict[str, jax.Array]:
    return semantic_batch((H, W, C), L, V, seed)


@pytest.fixture(scope="module")
def batch() -> dict[str, jax.Array]:
    return make_batch()


def tiny_model(**kwargs) -> SCORERCBR:
    return SCORERCBR(vocab_size=V, max_len=L, pairs="semantic_only", use_coordinates=False,
                     **{**TINY, **kwargs})


@pytest.fixture(scope="module")
def params(batch) -> dict:
    return tiny_model().init({"params": jax.random.key(0)}, batch, train=False)


def matching_inputs(model: SCORERCBR, params: dict, batch: dict) -> tuple:
    enc = model.apply(params, batch["before"], batch["after_semantic"], method=lambda m, b, a:
                      m.encoder(m.encoder.embed(m._features(b)), m._features(a),
                                train=False))
    return enc.matching


@pytest.mark.parametrize("matching", losses.MATCHINGS)
def test_model_sim_loss_is_its_matchings_infonce(matching, batch, params):
    # Two encoder heads of four: the per-subspace matching must split by the SCORER's heads.
    model = tiny_model(matching=matching, encoder_heads=2, use_cbr=False, match_chunk_size=3)
    got = float(model.apply(params, batch, train=False).aux_losses["sim"])
    want = 0.0
    for m in matching_inputs(model, params, batch):
        sim = np_similarity(matching, np.asarray(m.query), np.asarray(m.key), 2)
        want += 0.5 * np_row_ce(np.exp(float(m.logit_scale)) * sim)
    assert got == pytest.approx(want, rel=1e-5)


def test_encoder_heads_change_the_encoder_only(batch, params):
    default = tiny_model(use_cbr=False)
    two = tiny_model(encoder_heads=2, use_cbr=False)
    out_default, out_two = (m.apply(params, batch, train=False) for m in (default, two))
    # One layer: L_sim reads the q/k projections before the MHCA, so only the memory changes.
    assert float(out_two.aux_losses["sim"]) == float(out_default.aux_losses["sim"])
    assert not np.allclose(out_two.caption_logits["semantic"],
                           out_default.caption_logits["semantic"], rtol=1e-4)
    assert two.bind(params).encoder.num_heads == 2
    assert two.bind(params).decoder.num_heads == 4


@pytest.mark.parametrize("ablation", ["rr", "rr_cbr", "scorer"])
def test_table6_variant_losses(ablation, batch, params):
    config = scorer_config.get_config(f"synthetic/{ablation}")
    config.model.update(pairs="semantic_only", use_coordinates=False, **TINY)
    model = models.build(config.model, vocab_size=V, max_len=L)
    variables = {"params": {k: v for k, v in params["params"].items()
                            if k != "cbr" or config.model.use_cbr}}
    out = model.apply(variables, batch, train=False)
    assert set(out.aux_losses) == set(config.loss_weights)
    if ablation == "rr_cbr":  # no similarity term, a CBR loss
        assert "sim" not in out.aux_losses
        assert np.isfinite(float(out.aux_losses["cbr"])) and float(out.aux_losses["cbr"]) > 0
