"""DIRL + CCR model (changecap_jax/models/dirl.py) and the shared layers it uses.

Tiny sizes (hidden 32, 4 heads, 4x4 grid, vocab 12, L 8) keep every compile short; each jitted
function is built once per module and shared by the tests.

Section numbers (§) and quirk ids (S-Q, D-Q, I-Q) refer to docs/official/ (see its README.md).
"""

from __future__ import annotations

import math

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from changecap_jax.data.streams import make_caption_targets
from changecap_jax.models.base import IGNORE_INDEX, ModelOutput
from changecap_jax.models.dirl import DIRLCCR
from changecap_jax.models.layers import (
    GridPositionEmbedding,
    MultiheadAttention,
    add_spatial_coordinates,
    make_attention_mask,
    sinusoid_table,
)
from changecap_jax.models.losses import barlow_correlation_loss, ccr_infonce_loss

B, H, W, C, L, V = 4, 4, 4, 6, 8, 12
TINY = dict(
    vocab_size=V,
    max_len=L,
    hidden_dim=32,
    num_heads=4,
    word_dim=12,
    ffn_dim=64,
    mlp_hidden_dim=64,
)


def _captions(rng: np.random.RandomState, lengths: list[int]) -> np.ndarray:
    """<START> w1..wn <END> 0 ..., with n = length - 2 words from ids 4..V-1."""
    ids = np.zeros((len(lengths), L), np.int32)
    for row, n in enumerate(lengths):
        ids[row, 0] = 2
        ids[row, 1 : n - 1] = rng.randint(4, V, n - 2)
        ids[row, n - 1] = 3
    return ids


def _batch(seed: int = 0) -> dict[str, jnp.ndarray]:
    r = np.random.RandomState(seed)
    feats = {
        k: r.rand(B, H, W, C).astype(np.float32)
        for k in ("before", "after_semantic", "after_distractor")
    }
    return {
        **{k: jnp.asarray(x) for k, x in feats.items()},
        # Pads in most rows (the CCR pad test needs them) and one full-length row.
        "change_caption": jnp.asarray(_captions(r, [5, 8, 3, 6])),
        "no_change_caption": jnp.asarray(_captions(r, [4, 4, 7, 3])),
    }


@pytest.fixture(scope="module")
def model() -> DIRLCCR:
    return DIRLCCR(**TINY)


@pytest.fixture(scope="module")
def batch() -> dict[str, jnp.ndarray]:
    return _batch()


@pytest.fixture(scope="module")
def variables(model, batch):
    init = jax.jit(lambda key, b: model.init({"params": key}, b, train=False))
    # The model is PRNG-implementation agnostic; an RBG key only makes the CPU compile of the
    # ~60 random initialisers about 2x faster than threefry.
    return init(jax.random.key(0, impl="unsafe_rbg"), batch)


@pytest.fixture(scope="module")
def eval_apply(model):
    return jax.jit(lambda v, b: model.apply(v, b, train=False, mutable=["intermediates"]))


@pytest.fixture(scope="module")
def eval_result(eval_apply, variables, batch):
    return eval_apply(variables, batch)


@pytest.fixture(scope="module")
def train_apply():
    # One pair (same param tree) and RBG dropout keys: threefry dropout masks cost ~15 s of XLA
    # CPU compile here, and dropout does not depend on the PRNG implementation.
    model = DIRLCCR(**TINY, pairs="semantic_only")
    return jax.jit(lambda v, b, key: model.apply(v, b, train=True, rngs={"dropout": key}))


# ---- model outputs ----------------------------------------------------------------------------


def test_output_shapes(eval_result):
    out, _ = eval_result
    assert isinstance(out, ModelOutput)
    assert set(out.caption_logits) == {"semantic", "distractor"}
    for stream in ("semantic", "distractor"):
        assert out.caption_logits[stream].shape == (B, L, V)
        assert out.caption_targets[stream].shape == (B, L)
        assert out.caption_targets[stream].dtype == jnp.int32
    assert set(out.aux_losses) == {"dirl", "ccr"}
    for value in out.aux_losses.values():
        assert value.shape == () and np.isfinite(float(value))


def test_targets_follow_dataset_recipe(eval_result, batch):
    ids = jnp.asarray(
        [[2, 5, 6, 3, 0, 0, 0, 0], [2, 4, 5, 6, 7, 8, 9, 3], [2, 3, 0, 0, 0, 0, 0, 0]]
    )
    i = IGNORE_INDEX
    want = [[5, 6, 3, i, i, i, i, i], [4, 5, 6, 7, 8, 9, 3, i], [3, i, i, i, i, i, i, i]]
    np.testing.assert_array_equal(make_caption_targets(ids), want)
    out, _ = eval_result
    for stream, key in (("semantic", "change_caption"), ("distractor", "no_change_caption")):
        np.testing.assert_array_equal(out.caption_targets[stream], make_caption_targets(batch[key]))


def test_eval_is_deterministic_and_needs_no_dropout_rng(model, variables, batch, eval_apply):
    # eval_apply passes no rngs: train=False never asks for one.
    a, _ = eval_apply(variables, batch)
    b, _ = eval_apply(variables, batch)
    np.testing.assert_array_equal(a.caption_logits["semantic"], b.caption_logits["semantic"])
    with pytest.raises(flax.errors.InvalidRngError):
        jax.eval_shape(lambda v: model.apply(v, batch, train=True), variables)


def test_dropout_active_in_training(variables, batch, train_apply, eval_result):
    k1, k2 = jax.random.key(1, impl="unsafe_rbg"), jax.random.key(2, impl="unsafe_rbg")
    a, b, c = (train_apply(variables, batch, k) for k in (k1, k1, k2))
    np.testing.assert_array_equal(a.caption_logits["semantic"], b.caption_logits["semantic"])
    assert float(a.aux_losses["dirl"]) == float(b.aux_losses["dirl"])
    assert not np.allclose(a.caption_logits["semantic"], c.caption_logits["semantic"])
    assert not np.isclose(float(a.aux_losses["dirl"]), float(c.aux_losses["dirl"]))
    ev, _ = eval_result
    assert not np.allclose(a.caption_logits["semantic"], ev.caption_logits["semantic"])


def test_ccr_means_include_pad_positions(eval_result, batch):
    out, state = eval_result
    last = state["intermediates"]["decoder"]["layer_1"]
    # One sown value per stream, in call order (semantic, distractor).
    o1s, o2s = last["self_att_out"], last["cross_att_out"]
    assert len(o1s) == 2 and o1s[0].shape == (B, L, 32)
    with_pads, without_pads = [], []
    for o1, o2, key in zip(o1s, o2s, ("change_caption", "no_change_caption"), strict=True):
        real = (np.asarray(batch[key]) != 0)[..., None]
        with_pads.append(ccr_infonce_loss(o1.mean(1), o2.mean(1)))
        without_pads.append(
            ccr_infonce_loss((o1 * real).sum(1) / real.sum(1), (o2 * real).sum(1) / real.sum(1))
        )
    got = float(out.aux_losses["ccr"])
    assert got == pytest.approx(0.5 * float(with_pads[0]) + 0.5 * float(with_pads[1]), rel=1e-5)
    assert abs(got - 0.5 * float(without_pads[0] + without_pads[1])) > 1e-3


def test_encoder_update_is_simultaneous_and_dirl_uses_mlp(model, variables, batch, eval_result):
    def reimplement(m: DIRLCCR, before, after):
        enc = m.encoder
        x1_0, x2_0 = enc.embed(before), enc.embed(after)
        sim1, sim2 = x1_0, x2_0
        seq1, seq2 = x1_0, x2_0
        for layer in enc.transformer:
            sim1, sim2 = layer(sim1, sim2), layer(sim2, sim1)
            seq1 = layer(seq1, seq2)
            seq2 = layer(seq2, seq1)  # sequential: reads the NEW x1
        dirl = barlow_correlation_loss(enc.mlp(x1_0), enc.mlp(x2_0))
        out = enc(enc.embed_image(before, train=False), after, train=False)
        return out, (x1_0 - sim1, x2_0 - sim2), (x1_0 - seq1, x2_0 - seq2), dirl

    run = jax.jit(lambda v, b, a: model.apply(v, b, a, method=reimplement))
    before = add_spatial_coordinates(batch["before"])
    out, sim, seq, dirl_sem = run(
        variables, before, add_spatial_coordinates(batch["after_semantic"])
    )
    for got, want in zip((out.diff_before, out.diff_after), sim, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(out.diff_after, seq[1], atol=1e-3)
    # The model's dirl aux is the mean of the two pairs' Barlow losses.
    dirl_dis = run(variables, before, add_spatial_coordinates(batch["after_distractor"]))[3]
    got = float(eval_result[0].aux_losses["dirl"])
    assert got == pytest.approx(0.5 * float(dirl_sem) + 0.5 * float(dirl_dis), rel=1e-5)


def test_semantic_only_pairs(variables, batch, eval_apply):
    model_dc = DIRLCCR(**TINY, pairs="semantic_only")
    sem_batch = {k: batch[k] for k in ("before", "after_semantic", "change_caption")}
    out = jax.jit(lambda v: model_dc.apply(v, sem_batch, train=False))(variables)
    assert set(out.caption_logits) == {"semantic"}
    # Same param tree; equals the two-pair model fed the semantic pair twice.
    twice = {
        **sem_batch,
        "after_distractor": batch["after_semantic"],
        "no_change_caption": batch["change_caption"],
    }
    ref, _ = eval_apply(variables, twice)
    for name in ("dirl", "ccr"):
        assert float(out.aux_losses[name]) == pytest.approx(float(ref.aux_losses[name]), rel=1e-5)
    np.testing.assert_allclose(
        out.caption_logits["semantic"], ref.caption_logits["semantic"], rtol=1e-5, atol=1e-5
    )


def test_encode_then_decode_equals_training_logits(model, variables, batch, eval_result):
    def run(v):
        memory = model.apply(v, batch["before"], batch["after_semantic"], method="encode")
        return model.apply(v, memory, batch["change_caption"], method="decode")

    logits = jax.jit(run)(variables)
    np.testing.assert_allclose(
        logits, eval_result[0].caption_logits["semantic"], rtol=1e-5, atol=1e-5
    )


def test_missing_batch_key_is_a_clear_error(model, variables, batch):
    bad = {k: v for k, v in batch.items() if k != "after_distractor"}
    with pytest.raises(KeyError, match="after_distractor"):
        model.apply(variables, bad, train=False)
    wrong = {**batch, "before": batch["before"][0]}
    with pytest.raises(ValueError, match="before"):
        model.apply(variables, wrong, train=False)


# ---- parameters and initialisation ------------------------------------------------------------


def _param_shapes(**fields) -> dict:
    m = DIRLCCR(**fields)
    nb = 2
    grid = jax.ShapeDtypeStruct((nb, 14, 14, 1024), jnp.float32)
    caps = jax.ShapeDtypeStruct((nb, fields["max_len"]), jnp.int32)
    b = {
        "before": grid,
        "after_semantic": grid,
        "after_distractor": grid,
        "change_caption": caps,
        "no_change_caption": caps,
    }
    shapes = jax.eval_shape(lambda b: m.init({"params": jax.random.key(0)}, b, train=False), b)
    assert set(shapes) == {"params"}  # no cache, no PE buffer among the variables
    return flax.traverse_util.flatten_dict(shapes["params"], sep="/")


def _count(flat: dict, prefix: str) -> int:
    return sum(math.prod(s.shape) for k, s in flat.items() if k.startswith(prefix))


def test_full_size_param_tree_matches_official_state_dict():
    cc = _param_shapes(vocab_size=76, max_len=24, variant="clevr_change")
    # Appendix B totals (the PE buffer excluded).
    assert _count(cc, "encoder/") == 4_736_000
    assert _count(cc, "decoder/") == 9_148_764
    expected = {
        "encoder/img/kernel": (1026, 512),
        "encoder/pos_embedding/w_embedding": (14, 256),
        "encoder/pos_embedding/h_embedding": (14, 256),
        "encoder/mlp_0/kernel": (512, 2048),
        "encoder/mlp_3/bias": (512,),
        "encoder/transformer_1/attention/q_proj/kernel": (512, 512),
        "encoder/transformer_1/attention/out_proj/bias": (512,),
        "encoder/transformer_0/norm1/scale": (512,),
        "decoder/embed/embedding": (76, 300),
        "decoder/fc_0/kernel": (300, 512),
        "decoder/embed_fc_0/kernel": (1024, 512),
        "decoder/layer_1/self_att/out_proj/kernel": (512, 512),
        "decoder/layer_0/cross_att/v_proj/bias": (512,),
        "decoder/layer_1/norm3/scale": (512,),
        "decoder/layer_0/linear1/kernel": (512, 2048),
        "decoder/layer_0/linear2/kernel": (2048, 512),
        "decoder/logit/kernel": (512, 76),
    }
    for path, shape in expected.items():
        assert cc[path].shape == shape, path
    assert not any(k.startswith(("decoder/fc_1", "decoder/embed_fc_1")) for k in cc)

    dc = _param_shapes(
        vocab_size=87,
        max_len=40,
        variant="clevr_dc",
        pairs="semantic_only",
        use_coordinates=False,
    )
    assert _count(dc, "encoder/") == 4_734_976
    assert _count(dc, "decoder/") == 9_159_755
    for path in ("decoder/fc_1/scale", "decoder/fc_1/bias", "decoder/embed_fc_1/scale"):
        assert dc[path].shape == (512,)


def test_initialisation_follows_torch(variables):
    p = flax.traverse_util.flatten_dict(variables["params"], sep="/")
    e = 32
    emb = np.asarray(p["decoder/embed/embedding"])
    assert np.all(emb[0] == 0) and np.all(np.abs(emb[1:]).sum(1) > 0)  # padding_idx row
    assert np.std(emb[1:]) > 0.5  # N(0, 1), not a small uniform
    in_bound = math.sqrt(6 / (4 * e))  # xavier over the stacked (3E, E) in_proj
    for name in ("q_proj", "k_proj", "v_proj"):
        k = np.abs(np.asarray(p[f"decoder/layer_0/self_att/{name}/kernel"]))
        assert k.max() <= in_bound and k.max() > 0.9 * in_bound
        assert np.all(np.asarray(p[f"decoder/layer_0/self_att/{name}/bias"]) == 0)
    # out_proj: torch default U(1/sqrt(E)) in CCR_no_init, xavier in the DIRL encoder.
    dec_out = np.abs(np.asarray(p["decoder/layer_0/self_att/out_proj/kernel"])).max()
    enc_out = np.abs(np.asarray(p["encoder/transformer_0/attention/out_proj/kernel"])).max()
    assert dec_out <= 1 / math.sqrt(e) < enc_out <= math.sqrt(6 / (2 * e))
    # Linear biases: U(+-1/sqrt(fan_in)), not zero.
    b = np.abs(np.asarray(p["decoder/layer_0/linear1/bias"]))
    assert b.max() <= 1 / math.sqrt(e) and b.max() > 0.5 / math.sqrt(e)
    assert np.all(np.asarray(p["decoder/layer_0/norm1/scale"]) == 1)


# ---- shared layers ----------------------------------------------------------------------------


def test_add_spatial_coordinates_values():
    x = jnp.zeros((1, 2, 4, 3))
    y = np.asarray(add_spatial_coordinates(x))
    assert y.shape == (1, 2, 4, 5)
    np.testing.assert_allclose(y[0, 1, :, 3], [-1.0, -0.5, 0.0, 0.5])  # x = j*2/W - 1
    np.testing.assert_allclose(y[0, :, 2, 4], [-1.0, 0.0])  # y = i*2/H - 1


def test_grid_position_embedding_non_square():
    pe_mod = GridPositionEmbedding(dim=8)
    params = pe_mod.init(jax.random.key(0), 3, 5)
    assert params["params"]["w_embedding"].shape == (5, 4)
    assert params["params"]["h_embedding"].shape == (3, 4)
    pe = np.asarray(pe_mod.apply(params, 3, 5))
    w_emb, h_emb = (np.asarray(params["params"][k]) for k in ("w_embedding", "h_embedding"))
    for i in range(3):
        for j in range(5):
            np.testing.assert_array_equal(pe[i, j], np.concatenate([w_emb[j], h_emb[i]]))


def test_sinusoid_table_formula():
    pe = sinusoid_table(24, 300)
    assert pe.dtype == np.float32 and pe.shape == (24, 300)
    p, k = 7, 10
    freq = math.exp(-(2 * k) * math.log(10000.0) / 300)
    assert pe[p, 2 * k] == pytest.approx(math.sin(p * freq), abs=1e-7)
    assert pe[p, 2 * k + 1] == pytest.approx(math.cos(p * freq), abs=1e-7)
    np.testing.assert_array_equal(pe[0, 0::2], 0.0)
    np.testing.assert_array_equal(pe[0, 1::2], 1.0)


def _torch_mha_numpy(params, q_in, kv_in, heads, attn_mask, key_padding):
    """nn.MultiheadAttention forward (eval) in float64, masks as -inf."""
    p = {
        k: np.asarray(v, np.float64)
        for k, v in flax.traverse_util.flatten_dict(params, sep="/").items()
    }
    e = q_in.shape[-1]
    dh = e // heads
    q = (q_in @ p["q_proj/kernel"] + p["q_proj/bias"]) * dh**-0.5
    k = kv_in @ p["k_proj/kernel"] + p["k_proj/bias"]
    v = kv_in @ p["v_proj/kernel"] + p["v_proj/bias"]
    split = lambda x: x.reshape(x.shape[0], x.shape[1], heads, dh).transpose(0, 2, 1, 3)
    scores = split(q) @ split(k).transpose(0, 1, 3, 2)
    scores = scores + np.where(attn_mask, -np.inf, 0.0)[None, None]
    scores = scores + np.where(key_padding, -np.inf, 0.0)[:, None, None, :]
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ctx = (probs @ split(v)).transpose(0, 2, 1, 3).reshape(q_in.shape)
    return ctx @ p["out_proj/kernel"] + p["out_proj/bias"]


def test_multihead_attention_matches_torch_semantics():
    r = np.random.RandomState(0)
    e, heads, lt = 16, 4, 5
    mha = MultiheadAttention(e, heads, dropout_rate=0.1)
    x = r.randn(2, lt, e).astype(np.float32)
    # Random params incl. non-zero biases, so that "scale q after its bias" is really tested.
    params = {
        name: {
            "kernel": jnp.asarray(r.randn(e, e) * 0.3, jnp.float32),
            "bias": jnp.asarray(r.randn(e) * 0.3, jnp.float32),
        }
        for name in ("q_proj", "k_proj", "v_proj", "out_proj")
    }
    valid = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)

    @jax.jit
    def run(params, x, key):
        mask = make_attention_mask(lt, jnp.asarray(valid), causal=True)
        v = {"params": params}
        return (
            mha.apply(v, x, x, mask=mask),
            mha.apply(v, x, x, mask=mask, deterministic=False, rngs={"dropout": key}),
        )

    got, dropped = run(params, x, jax.random.key(1, impl="unsafe_rbg"))
    causal_masked = np.triu(np.ones((lt, lt), bool), k=1)
    want = _torch_mha_numpy(params, x, x, heads, causal_masked, ~valid)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # Attention dropout is active only when not deterministic.
    assert not np.allclose(dropped, got)
