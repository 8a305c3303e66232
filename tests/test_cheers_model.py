"""CHEERS equations against float64 NumPy written from the paper's text (§3.2-3.4), decoding,
and the Table 4 switches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from changecap_jax import parallel
from changecap_jax.decoding import search
from changecap_jax.models import losses
from changecap_jax.models.cheers import (
    CHEERS,
    GatedDecoderLayer,
    HRDLayer,
    RepresentationEnhancement,
)

B, N, K, D, HEADS = 3, 6, 4, 8, 2


def _np(tree):
    return jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), tree)


# ---- NumPy float64 reference, from the paper's equations ------------------------------------


def np_layer_norm(x, p, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * p["scale"] + p["bias"]


def np_dense(x, p):
    return x @ p["kernel"] + p["bias"]


def np_softmax(x, axis=-1):
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def np_sigmoid(x):
    return 1 / (1 + np.exp(-x))


def np_mha(p, x, y, heads, mask=None):
    e = x.shape[-1]
    hd = e // heads
    q = np_dense(x, p["q_proj"]).reshape(*x.shape[:2], heads, hd) / np.sqrt(hd)
    k = np_dense(y, p["k_proj"]).reshape(*y.shape[:2], heads, hd)
    v = np_dense(y, p["v_proj"]).reshape(*y.shape[:2], heads, hd)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k)
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
    ctx = np.einsum("bhqk,bkhd->bqhd", np_softmax(scores), v).reshape(*x.shape[:2], e)
    return np_dense(ctx, p["out_proj"])


def np_enhance(p, source, target, mode, scale=1.0):
    """Eq. 2-5: P(i, j) = softmax over source positions j of cos(target_i, source_j);
    P_hat = Linear(max_j P) (common) or Linear(1 - max_j P) (difference);
    out = LN(sigmoid(P_hat) * target + target)."""
    t = target / np.linalg.norm(target, axis=-1, keepdims=True)
    s = source / np.linalg.norm(source, axis=-1, keepdims=True)
    prob = np_softmax(scale * np.einsum("bid,bjd->bij", t, s))
    m = prob.max(-1, keepdims=True)
    if mode == "difference":
        m = 1 - m
    p_hat = m * p["expand"]["kernel"][0] + p["expand"]["bias"]
    return np_layer_norm(np_sigmoid(p_hat) * target + target, p["norm"]), p_hat


def np_hrd(p, f_bef, f_aft, e):
    """Eq. 6-11 with our documented readings (module docstring of models/cheers.py)."""
    mse = lambda a, b: np.mean((a - b) ** 2)
    c_bef, pc_bef = np_enhance(p["image_cre"], f_aft, f_bef, "common")
    c_aft, pc_aft = np_enhance(p["image_cre"], f_bef, f_aft, "common")
    _, pe_bef = np_enhance(p["entity_dre"], e, f_bef, "difference")
    _, pe_aft = np_enhance(p["entity_dre"], e, f_aft, "difference")
    l_c = (mse(pc_bef, pe_bef) + mse(pc_aft, pe_aft)) / 2
    mhca = lambda x, y: np_layer_norm(x + np_mha(p["mhca"]["attention"], x, y, HEADS),
                                      p["mhca"]["norm"])
    ct_bef, ct_aft = mhca(c_bef, c_aft), mhca(c_aft, c_bef)
    r_bef, r_aft = f_bef - ct_bef, f_aft - ct_aft
    d_bef, pd_bef = np_enhance(p["image_dre"], f_bef, r_bef, "difference")
    d_aft, pd_aft = np_enhance(p["image_dre"], f_aft, r_aft, "difference")
    _, qe_bef = np_enhance(p["entity_cre"], e, r_bef, "common")
    _, qe_aft = np_enhance(p["entity_cre"], e, r_aft, "common")
    l_d = (mse(pd_bef, qe_bef) + mse(pd_aft, qe_aft)) / 2
    return d_bef, d_aft, l_c + l_d, (ct_bef.mean(1), ct_aft.mean(1))


def np_infonce(q, k, tau):
    """Eq. 9: -log exp(sim(q, k+)/tau) / sum_i exp(sim(q, k_i)/tau), mean over rows."""
    qn = q / np.linalg.norm(q, axis=-1, keepdims=True)
    kn = k / np.linalg.norm(k, axis=-1, keepdims=True)
    logits = qn @ kn.T / tau
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return -np.mean(np.diag(log_p))


def np_gated_layer(p, h, visual, entities, mask, activation):
    """Eq. 13-17 + FFN: H' = LN(H + SA(H)); H^T, H^V; alpha, beta; H_n = LN(H^F + H')."""
    h1 = np_layer_norm(h + np_mha(p["self_att"], h, h, HEADS, mask), p["norm1"])
    h_text = np_mha(p["entity_att"], h1, entities, HEADS)
    h_vis = np_mha(p["visual_att"], h1, visual, HEADS)
    a = np_dense(np.concatenate([h1, h_text], -1), p["alpha"])
    b = np_dense(np.concatenate([h1, h_vis], -1), p["beta"])
    if activation == "sigmoid":
        a, b = np_sigmoid(a), np_sigmoid(b)
    elif activation == "softmax":
        a, b = np.exp(a) / (np.exp(a) + np.exp(b)), np.exp(b) / (np.exp(a) + np.exp(b))
    hn = np_layer_norm(a * h_text + b * h_vis + h1, p["norm2"])
    ffn = np_dense(np.maximum(np_dense(hn, p["linear1"]), 0), p["linear2"])
    return np_layer_norm(hn + ffn, p["norm3"])


# ---- tests ---------------------------------------------------------------------------------


def _random(rng, *shape):
    return rng.normal(size=shape)


@pytest.mark.parametrize("mode", ["common", "difference"])
@pytest.mark.parametrize("scale", [1.0, 5.0])
def test_cre_and_dre_match_equations_2_to_5(mode, scale):
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        source, target = _random(rng, B, K, D), _random(rng, B, N, D)
        module = RepresentationEnhancement(D, mode, similarity_scale=scale)
        params = module.init(jax.random.key(1), source, target)["params"]
        # Random LN affine so that a swapped scale/bias would show.
        params = jax.tree_util.tree_map(lambda x: x + rng.normal(size=x.shape) * 0.3, params)
        out, p_hat = module.apply({"params": params}, source, target)
        want_out, want_p = np_enhance(_np(params), source, target, mode, scale)
    np.testing.assert_allclose(np.asarray(p_hat), want_p, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out), want_out, atol=1e-6)
    # CRE and DRE differ only in max vs 1 - max: the maps must not coincide.
    other = "difference" if mode == "common" else "common"
    assert np.abs(np_enhance(_np(params), source, target, other, scale)[1] - want_p).max() > 1e-3


def test_hrd_layer_matches_equations_6_to_11():
    rng = np.random.default_rng(1)
    with jax.enable_x64(True):
        f_bef, f_aft, e = _random(rng, B, N, D), _random(rng, B, N, D), _random(rng, B, K, D)
        layer = HRDLayer(D, HEADS, 0.0)
        params = layer.init(jax.random.key(2), f_bef, f_aft, e, deterministic=True)["params"]
        params = jax.tree_util.tree_map(lambda x: x + rng.normal(size=x.shape) * 0.3, params)
        d_bef, d_aft, consistency, (q, k) = layer.apply(
            {"params": params}, f_bef, f_aft, e, deterministic=True)
    want = np_hrd(_np(params), f_bef, f_aft, e)
    np.testing.assert_allclose(np.asarray(d_bef), want[0], atol=1e-6)
    np.testing.assert_allclose(np.asarray(d_aft), want[1], atol=1e-6)
    np.testing.assert_allclose(float(consistency), want[2], atol=1e-6)
    np.testing.assert_allclose(np.asarray(q), want[3][0], atol=1e-6)
    np.testing.assert_allclose(np.asarray(k), want[3][1], atol=1e-6)
    assert want[2] > 1e-3  # the consistency loss is not trivially zero here


def test_infonce_matches_equation_9_and_uses_the_whole_batch():
    rng = np.random.default_rng(2)
    q, k = rng.normal(size=(8, D)), rng.normal(size=(8, D))
    with jax.enable_x64(True):
        got = float(losses.cosine_infonce_loss(jnp.asarray(q), jnp.asarray(k), 0.07))
    np.testing.assert_allclose(got, np_infonce(q, k, 0.07), atol=1e-6)
    # Sharded over 4 devices with the gather, the global-batch value is unchanged.
    mesh = parallel.make_mesh(4)
    sharded = jax.jit(jax.shard_map(
        lambda a, b: losses.cosine_infonce_loss(a, b, 0.07, axis_name="data"), mesh=mesh,
        in_specs=(jax.P("data"), jax.P("data")), out_specs=jax.P()))
    got4 = float(sharded(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32)))
    np.testing.assert_allclose(got4, np_infonce(q, k, 0.07), rtol=1e-5)
    # Per-device batches alone (no gather) would give another value.
    local = np.mean([np_infonce(q[i:i + 2], k[i:i + 2], 0.07) for i in range(0, 8, 2)])
    assert abs(local - np_infonce(q, k, 0.07)) > 1e-2


def test_mse_is_the_global_mean():
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=(8, 5, 3)).astype(np.float32), rng.normal(size=(8, 5, 3)).astype(
        np.float32)
    mesh = parallel.make_mesh(4)
    sharded = jax.jit(jax.shard_map(
        lambda x, y: losses.mean_squared_error(x, y, axis_name="data"), mesh=mesh,
        in_specs=(jax.P("data"), jax.P("data")), out_specs=jax.P()))
    np.testing.assert_allclose(float(sharded(a, b)), np.mean((a - b) ** 2.0), rtol=1e-6)


@pytest.mark.parametrize("activation", ["sigmoid", "softmax", "identity"])
def test_gated_decoder_layer_matches_equations_13_to_17(activation):
    rng = np.random.default_rng(4)
    L = 5
    with jax.enable_x64(True):
        h, visual, ents = _random(rng, B, L, D), _random(rng, B, N, D), _random(rng, B, K, D)
        mask = np.tril(np.ones((L, L), bool))[None, None]
        layer = GatedDecoderLayer(D, HEADS, 16, 0.0, gate_activation=activation)
        params = layer.init(jax.random.key(3), h, visual, ents, mask,
                            deterministic=True)["params"]
        params = jax.tree_util.tree_map(lambda x: x + rng.normal(size=x.shape) * 0.3, params)
        got = layer.apply({"params": params}, h, visual, ents, mask, deterministic=True)
        alpha, beta = layer.apply({"params": params}, h, _random(rng, B, L, D),
                                  _random(rng, B, L, D), method="gates")
    want = np_gated_layer(_np(params), h, visual, ents, mask, activation)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-6)
    if activation == "sigmoid":
        assert (np.asarray(alpha) > 0).all() and (np.asarray(beta) < 1).all()
    if activation == "softmax":
        np.testing.assert_allclose(np.asarray(alpha + beta), 1.0, atol=1e-12)


def _model(**fields):
    base = dict(vocab_size=20, max_len=9, hidden_dim=16, num_heads=2, hrd_layers=2,
                decoder_layers=2, word_dim=8, ffn_dim=32, dropout_rate=0.0, num_entities=3,
                entity_dim=6)
    return CHEERS(**{**base, **fields})


def _batch(rng, b=4, entities=True):
    grid = lambda: rng.normal(size=(b, 3, 3, 10)).astype(np.float32)
    ids = np.zeros((b, 9), np.int32)
    ids[:, :5] = [2, 5, 6, 7, 3]
    batch = {"before": grid(), "after_semantic": grid(), "after_distractor": grid(),
             "change_caption": ids, "no_change_caption": ids}
    if entities:
        for s in ("semantic", "distractor"):
            batch[f"entities_{s}"] = rng.normal(size=(b, 3, 6)).astype(np.float32)
    return batch


@pytest.mark.parametrize("use_gate", [True, False])
def test_cached_decoding_equals_full_recompute(use_gate):
    # The gated layer's cache covers the ungated one's (it adds the entity attention), so the
    # slow full recompute runs for the gated model only.
    rng = np.random.default_rng(5)
    model = _model(use_gate=use_gate)
    batch = _batch(rng)
    variables = model.init(jax.random.key(0), batch, train=False)
    # Larger weights so that greedy paths vary between rows and steps.
    variables = jax.tree_util.tree_map(lambda x: x * 3.0, variables)
    cond = {"entities": batch["entities_semantic"]}
    cached = search.greedy_decode(model, variables, batch["before"], batch["after_semantic"],
                                    max_len=9, conditioning=cond)
    if use_gate:
        full = search.full_recompute_greedy(model, variables, batch["before"],
                                              batch["after_semantic"], max_len=9,
                                              conditioning=cond)
        np.testing.assert_array_equal(np.asarray(cached.ids), np.asarray(full.ids))
        # float32 with weights x3 (logits of tens): the two paths round apart by ~1e-5.
        np.testing.assert_allclose(np.asarray(cached.log_probs), np.asarray(full.log_probs),
                                   atol=1e-4)
    # The entities reach the captions only through the gate (and the consistency loss).
    other = search.greedy_decode(
        model, variables, batch["before"], batch["after_semantic"], max_len=9,
        conditioning={"entities": -batch["entities_semantic"]})
    changed = not np.array_equal(np.asarray(other.log_probs), np.asarray(cached.log_probs))
    assert changed == use_gate


def test_table_4_switches():
    rng = np.random.default_rng(6)
    baseline = _model(use_cre=False, use_dre=False, entity_consistency=False, use_gate=False)
    assert baseline.conditioning_shapes == {}
    assert _model().conditioning_shapes == {"entities": (3, 6)}
    variables = baseline.init(jax.random.key(0), _batch(rng, entities=False), train=False)
    names = set(variables["params"]["hrd_0"])
    assert names == {"mhca"}  # no CRE/DRE modules at all
    out = baseline.apply(variables, _batch(rng, entities=False), train=True)
    assert float(out.aux_losses["consistency"]) == 0.0
    full = _model()
    full_vars = full.init(jax.random.key(0), _batch(rng), train=False)
    assert set(full_vars["params"]["hrd_0"]) == {"image_cre", "image_dre", "entity_cre",
                                                 "entity_dre", "mhca"}
    out = full.apply(full_vars, _batch(rng), train=True)
    assert float(out.aux_losses["consistency"]) > 0.0
    with pytest.raises(ValueError, match="entity_consistency"):
        _model(use_cre=False).init(jax.random.key(0), _batch(rng), train=False)
    with pytest.raises(ValueError, match=r"\(B, 3, 6\)"):
        full.apply(full_vars, {**_batch(rng), "entities_semantic": np.zeros((4, 2, 6))},
                   train=False)


@pytest.mark.parametrize("activation", ["none", "relu"])
def test_fusion_activation(activation):
    """Eq. 12 as printed (no activation: F_diff takes negative values) or with the DIRL/SCORER
    memory's ReLU (F_diff >= 0)."""
    rng = np.random.default_rng(7)
    model = _model(fusion_activation=activation)
    batch = _batch(rng)
    variables = model.init(jax.random.key(0), batch, train=False)
    f_diff, _ = model.apply(variables, batch["before"], batch["after_semantic"],
                            entities=batch["entities_semantic"], method=model.encode)
    assert (float(jnp.min(f_diff)) >= 0.0) == (activation == "relu")
    with pytest.raises(ValueError, match="fusion_activation"):
        _model(fusion_activation="gelu").init(jax.random.key(0), batch, train=False)
