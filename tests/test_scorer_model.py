"""SCORER + CBR (changecap_jax/models/scorer.py, decoder.py): outputs, parameter tree vs
Appendix A, initialisation (§3.5), the losses of §3.3-§3.4 against float64 NumPy, the logit-scale
clamp, decoding, 8 devices == 1 for the full loss, and the trainer (CBR frozen by the paper
preset, trained with the switch).

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
import scipy.special

from changecap_jax import parallel
from changecap_jax.data import pipeline
from changecap_jax.data.streams import STREAM_KEYS as STREAMS
from changecap_jax.data.streams import make_caption_targets
from changecap_jax.decoding import search
from changecap_jax.models.base import ModelOutput
from changecap_jax.models.layers import sinusoid_table
from changecap_jax.models.scorer import LOGIT_SCALE_MAX, SCORERCBR
from changecap_jax.trainers import caption_step, captioning, optimizers
from configs import scorer as scorer_config

B, H, W, C, L, V = 4, 4, 4, 6, 8, 12
TINY = dict(vocab_size=V, max_len=L, hidden_dim=32, num_heads=4, word_dim=12)
MAIN = dict(TINY, decoder_layers=1)  # the module's shared model: one decoder layer compiles faster
SMALL = {"num_train": 40, "num_val": 12, "num_test": 10, "feature_shape": (4, 4, 16)}


def captions(rng: np.random.RandomState, lengths: list[int]) -> np.ndarray:
    """<START> w1..wn <END> 0 ..., with n = length - 2 words from ids 4..V-1."""
    ids = np.zeros((len(lengths), L), np.int32)
    for row, n in enumerate(lengths):
        ids[row, 0] = 2
        ids[row, 1 : n - 1] = rng.randint(4, V, n - 2)
        ids[row, n - 1] = 3
    return ids


def make_batch(seed: int = 0, b: int = B) -> dict[str, jnp.ndarray]:
    r = np.random.RandomState(seed)
    feats = {k: r.rand(b, H, W, C).astype(np.float32)
             for k in ("before", "after_semantic", "after_distractor")}
    lengths = [5, 8, 3, 6]
    return {
        **{k: jnp.asarray(x) for k, x in feats.items()},
        "change_caption": jnp.asarray(captions(r, (lengths * b)[:b])),
        "no_change_caption": jnp.asarray(captions(r, ([4, 4, 7, 3] * b)[:b])),
    }


def random_params(model, batch, seed: int, *, sharpen: bool = False) -> dict:
    """Random params drawn with NumPy from the model's param shapes (no init compile); with
    ``sharpen`` the logits are made decisive, PAD and START impossible (a trained model never
    predicts them) and END likely enough that rows end at different steps (for decoding)."""
    shapes = jax.eval_shape(
        lambda b: model.init({"params": jax.random.key(0)}, b, train=False), batch)["params"]
    r = np.random.RandomState(seed)
    flat = {}
    for path, s in flax.traverse_util.flatten_dict(shapes).items():
        if path[-1] == "scale":
            value = 1.0 + 0.1 * r.randn(*s.shape)
        elif path[-1] == "logit_scale":
            value = np.asarray(1.0)
        elif len(s.shape) == 2:
            value = r.randn(*s.shape) / np.sqrt(s.shape[0])
        else:
            value = 0.1 * r.randn(*s.shape)
        flat[path] = np.asarray(value, np.float32)
    if sharpen:
        logit = ("decoder", "logit")
        flat[logit + ("kernel",)] *= 4.0
        flat[logit + ("bias",)][[0, 2]] = -1e4
        flat[logit + ("bias",)][3] += 2.0
    return {"params": flax.traverse_util.unflatten_dict(
        {k: jnp.asarray(v) for k, v in flat.items()})}


def np_mtm(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    r = np.einsum("ald,bmd->ablm", q.astype(np.float64), k.astype(np.float64))
    return 0.5 * (r.max(-1).mean(-1) + r.max(-2).mean(-1))


def np_row_ce(s: np.ndarray) -> float:
    s = s - s.max(1, keepdims=True)
    return float(-np.mean(np.diag(s - np.log(np.exp(s).sum(1, keepdims=True)))))


def set_param(params: dict, path: str, value) -> dict:
    flat = flax.traverse_util.flatten_dict(params, sep="/")
    flat[path] = jnp.asarray(value, flat[path].dtype)
    return flax.traverse_util.unflatten_dict(flat, sep="/")


@pytest.fixture(scope="module")
def model() -> SCORERCBR:
    return SCORERCBR(**MAIN)


@pytest.fixture(scope="module")
def batch() -> dict[str, jnp.ndarray]:
    return make_batch()


@pytest.fixture(scope="module")
def variables(model, batch):
    init = jax.jit(lambda key, b: model.init({"params": key}, b, train=False))
    return init(jax.random.key(0, impl="unsafe_rbg"), batch)


def _evaluate(m: SCORERCBR, batch: dict):
    """One compiled eval-mode run: the model output, and encode -> memory -> decode logits of
    the distractor pair (the decoding protocol)."""
    out = m(batch, train=False)
    memory = m.encode(batch["before"], batch["after_distractor"])
    return out, memory, m.decode(memory, batch["no_change_caption"])


@pytest.fixture(scope="module")
def eval_apply(model):
    return jax.jit(lambda v, b: model.apply(v, b, method=_evaluate))


@pytest.fixture(scope="module")
def evaluated(eval_apply, variables, batch):
    return eval_apply(variables, batch)


@pytest.fixture(scope="module")
def eval_out(evaluated) -> ModelOutput:
    return evaluated[0]


# ---- outputs and losses -----------------------------------------------------------------------


def test_outputs(eval_out, batch):
    assert set(eval_out.caption_logits) == {"semantic", "distractor"}
    for stream, key in (("semantic", "change_caption"), ("distractor", "no_change_caption")):
        assert eval_out.caption_logits[stream].shape == (B, L, V)
        np.testing.assert_array_equal(eval_out.caption_targets[stream],
                                      make_caption_targets(batch[key]))
    assert set(eval_out.aux_losses) == {"sim", "cbr"}
    for value in eval_out.aux_losses.values():
        assert value.shape == () and np.isfinite(float(value))


# ---- float64 NumPy reading of §2.3 and §3.1-§3.4 ------------------------------------------------


def np_layer_norm(x, p, eps=1e-6):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * p["scale"] + p["bias"]


def np_dense(x, p):
    return x @ p["kernel"] + p.get("bias", 0.0)


def np_attend(q, k, v, heads, mask=None):
    """softmax(Q_h K_h^T / sqrt(dh) + mask) V_h, heads merged, NO output projection."""
    b, lq, e = q.shape
    dh = e // heads
    split = lambda x: x.reshape(b, -1, heads, dh).transpose(0, 2, 1, 3)
    scores = split(q) @ split(k).transpose(0, 1, 3, 2) / np.sqrt(dh)
    if mask is not None:
        scores = scores + mask[:, None]
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return (probs @ split(v)).transpose(0, 2, 1, 3).reshape(b, lq, e)


def np_scorer_pair(params, before, after, ids, heads, *, sequential=False, mean_by_length=False):
    """One (before, after, caption) pair: memory, logits, sim and cbr of the official code."""
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    enc, dec, cbr = p["encoder"], p["decoder"], p["cbr"]

    def embed(grid):  # §2.3 coordinates, §3.1 steps 1-3
        b, h, w, _ = grid.shape
        xs = np.broadcast_to((np.arange(w) * 2.0 / w - 1.0)[None, None, :, None], (b, h, w, 1))
        ys = np.broadcast_to((np.arange(h) * 2.0 / h - 1.0)[None, :, None, None], (b, h, w, 1))
        x = np_dense(np.concatenate([grid, xs, ys], -1), enc["img_0"])
        half = x.shape[-1] // 2  # PE[i, j] = cat(w_embedding[j], h_embedding[i])
        w_part = np.broadcast_to(enc["pos_embedding"]["w_embedding"][None], (h, w, half))
        h_part = np.broadcast_to(enc["pos_embedding"]["h_embedding"][:, None], (h, w, half))
        x = x + np.concatenate([w_part, h_part], -1)[None]
        return x.reshape(b, h * w, -1)

    x1_0, x2_0 = embed(np.asarray(before, np.float64)), embed(np.asarray(after, np.float64))
    x1, x2 = x1_0, x2_0
    num_layers = len([k for k in enc if k.startswith("scorer_")])
    for layer in range(num_layers):
        a = enc[f"scorer_{layer}"]["attention"]

        def call(xq, xkv, a=a):
            q, k, v = np_dense(xq, a["query"]), np_dense(xkv, a["key"]), np_dense(xkv, a["value"])
            return np_layer_norm(np_attend(q, k, v, heads) + xq, a["layer_norm"]), q, k

        # Simultaneous: both directions read the previous layer's (x1, x2).
        n1, q1, k1 = call(x1, x2)
        n2, q2, k2 = call(x2, n1 if sequential else x1)
        x1, x2 = n1, n2
    scale = np.exp(a["logit_scale"])
    sim = 0.5 * (np_row_ce(scale * np_mtm(q1, k1)) + np_row_ce(scale * np_mtm(q2, k2)))
    memory = np.maximum(np_dense(np.concatenate([x1, x2], -1), enc["embed_fc_0"]), 0.0)

    h, logits, valid = np_speaker(dec, memory, ids, heads)
    loss_cbr = np_cbr(cbr, x1_0, x2_0, h, valid, heads, mean_by_length)
    return {"memory": memory, "logits": logits, "sim": sim, "cbr": loss_cbr}


def np_speaker(dec, memory, ids, heads):
    """The Speaker decoder (§3.2): last layer output h, logits and the caption mask."""
    ids = np.asarray(ids)
    lt = ids.shape[1]
    valid = (np.arange(lt)[None] < (ids != 0).sum(1, keepdims=True)).astype(np.float64)
    allowed = valid[:, None, :] * np.tril(np.ones((lt, lt)))[None]
    mask = (1.0 - allowed) * -10000.0  # §3.2 additive mask
    table = dec["embed"]["embedding"]
    pe = sinusoid_table(lt, table.shape[1]).astype(np.float64)[None]
    h = np_layer_norm(np_dense(table[ids] + pe, dec["fc_0"]), dec["fc_2"])
    for layer in range(len([k for k in dec if k.startswith("layer_")])):
        d = dec[f"layer_{layer}"]
        sa, ca = d["self_attention"], d["dec_enc_attention"]
        a1 = np_layer_norm(np_attend(np_dense(h, sa["query"]), np_dense(h, sa["key"]),
                                     np_dense(h, sa["value"]), heads, mask) + h, d["norm1"])
        a2 = np_layer_norm(a1 + np_attend(np_dense(a1, ca["query"]), np_dense(memory, ca["key"]),
                                          np_dense(memory, ca["value"]), heads), d["norm2"])
        g = np_dense(a2, d["hidden_intermediate"]["dense"])
        g = 0.5 * g * (1.0 + scipy.special.erf(g / np.sqrt(2.0)))  # exact GELU
        h = np_layer_norm(np_dense(g, d["output"]["dense"]) + g, d["output"]["LayerNorm"])
    return h, np_dense(h, dec["logit"]), valid


def np_cbr(cbr, x1_0, x2_0, h, valid, heads, mean_by_length):
    """CBR's loss (§3.3) from X0_bef, X0_aft and the decoder output h."""
    lt = h.shape[1]
    sent = (h * valid[..., None]).sum(1) / (valid.sum(1, keepdims=True) if mean_by_length else lt)
    x = np_dense(np.concatenate([x1_0, np.broadcast_to(sent[:, None], x1_0.shape)], -1),
                 cbr["conv1"])
    mh = cbr["mh_att"]
    x = np_dense(np_attend(np_dense(x, mh["q_proj"]), np_dense(x, mh["k_proj"]),
                           np_dense(x, mh["v_proj"]), heads), mh["out_proj"])
    hallucination = np_dense(x, cbr["conv2_0"])
    c = cbr["contra"]
    s_cbr = np.exp(c["logit_scale"]) * np_mtm(np_dense(hallucination, c["query"]),
                                              np_dense(x2_0, c["key"]))
    return 0.5 * (np_row_ce(s_cbr) + np_row_ce(s_cbr.T))


@pytest.fixture(scope="module")
def wide_variables(model, batch) -> dict:
    """Random params of unit-scale activations (the official init keeps the decoder's
    pre-activations near 0, where the exact and the tanh GELU agree to 1e-5)."""
    variables = random_params(model, batch, 7)
    kernel = "decoder/layer_0/hidden_intermediate/dense/kernel"
    flat = flax.traverse_util.flatten_dict(variables["params"], sep="/")
    return {"params": set_param(variables["params"], kernel, 3.0 * flat[kernel])}


@pytest.fixture(scope="module")
def numpy_pairs(wide_variables, batch) -> dict:
    return {stream: np_scorer_pair(wide_variables["params"], batch["before"], batch[after_key],
                                   batch[caption_key], MAIN["num_heads"])
            for stream, (after_key, caption_key) in STREAMS.items()}


def test_forward_and_losses_match_numpy(eval_apply, wide_variables, batch, numpy_pairs):
    """Memory, logits, L_sim (last layer, both directions) and L_cbr (S and S^T), each the
    equal-weight mean of the two pairs (§3.4), against the float64 reading."""
    out, memory, _ = eval_apply(wide_variables, batch)
    np.testing.assert_allclose(memory, numpy_pairs["distractor"]["memory"], rtol=1e-4,
                               atol=1e-5)
    for stream in STREAMS:
        np.testing.assert_allclose(out.caption_logits[stream], numpy_pairs[stream]["logits"],
                                   rtol=1e-4, atol=1e-5)
    for name in ("sim", "cbr"):
        want = 0.5 * (numpy_pairs["semantic"][name] + numpy_pairs["distractor"][name])
        assert float(out.aux_losses[name]) == pytest.approx(want, rel=1e-5), name


def test_numpy_reading_discriminates(wide_variables, batch, numpy_pairs):
    """The reference itself can tell the official choices from the alternatives: a sequential
    layer update and the caption-length sentence mean give other numbers."""
    args = (wide_variables["params"], batch["before"], batch["after_semantic"],
            batch["change_caption"], MAIN["num_heads"])
    seq = np_scorer_pair(*args, sequential=True)
    assert np.abs(seq["memory"] - numpy_pairs["semantic"]["memory"]).max() > 1e-3
    by_length = np_scorer_pair(*args, mean_by_length=True)
    assert abs(by_length["cbr"] - numpy_pairs["semantic"]["cbr"]) > 1e-5


def test_only_the_last_layer_scale_enters_the_sim_loss(eval_apply, variables, batch, eval_out):
    params = variables["params"]
    run = lambda path: eval_apply({"params": set_param(params, path, 3.0)}, batch)[0]
    dead = run("encoder/scorer_0/attention/logit_scale")
    assert float(dead.aux_losses["sim"]) == float(eval_out.aux_losses["sim"])
    live = run("encoder/scorer_1/attention/logit_scale")
    assert abs(float(live.aux_losses["sim"]) - float(eval_out.aux_losses["sim"])) > 1e-3
    assert float(live.aux_losses["cbr"]) == float(eval_out.aux_losses["cbr"])
    contra = run("cbr/contra/logit_scale")
    assert abs(float(contra.aux_losses["cbr"]) - float(eval_out.aux_losses["cbr"])) > 1e-3


def test_cbr_sentence_mean_divides_by_padded_length(model, variables, batch):
    sent = np.random.RandomState(0).randn(B, L, 32).astype(np.float32)
    mask = np.asarray(batch["change_caption"] != 0, np.float32)
    summed = (sent.astype(np.float64) * mask[..., None]).sum(1)
    sentence = lambda mod, s, k: mod.cbr.sentence(s, k)
    got = model.apply(variables, sent, mask, method=sentence)
    np.testing.assert_allclose(got, summed / L, rtol=1e-5, atol=1e-6)  # S-Q8: / Lt
    fixed = SCORERCBR(**MAIN, cbr_mean_by_length=True)
    got_fix = fixed.apply(variables, sent, mask, method=sentence)
    np.testing.assert_allclose(got_fix, summed / mask.sum(1, keepdims=True), rtol=1e-5,
                               atol=1e-6)


def test_semantic_only_pairs(variables, batch):
    m = SCORERCBR(**MAIN, pairs="semantic_only")
    sem = {k: batch[k] for k in ("before", "after_semantic", "change_caption")}
    out = jax.eval_shape(lambda v: m.apply(v, sem, train=False), variables)
    assert set(out.caption_logits) == {"semantic"} and set(out.aux_losses) == {"sim", "cbr"}


def test_ablation_switches_drop_losses_and_cbr_params(batch):
    for kwargs, names in ((dict(use_cbr=False), {"sim"}), (dict(use_sim=False), {"cbr"})):
        m = SCORERCBR(**TINY, **kwargs)
        out, variables = jax.eval_shape(
            lambda b, m=m: m.init_with_output({"params": jax.random.key(0)}, b, train=False),
            batch)
        assert set(out.aux_losses) == names
        assert ("cbr" in variables["params"]) == ("cbr" in names)


def test_missing_batch_key_is_a_clear_error(model, variables, batch):
    bad = {k: v for k, v in batch.items() if k != "no_change_caption"}
    with pytest.raises(KeyError, match="no_change_caption"):
        model.apply(variables, bad, train=False)
    with pytest.raises(ValueError, match="before"):
        model.apply(variables, {**batch, "before": batch["before"][0]}, train=False)


# ---- parameters, initialisation, clamp --------------------------------------------------------


def test_full_size_param_tree_matches_appendix_a():
    m = SCORERCBR(vocab_size=76, max_len=24)
    grid = jax.ShapeDtypeStruct((2, 14, 14, 1024), jnp.float32)
    caps = jax.ShapeDtypeStruct((2, 24), jnp.int32)
    b = {"before": grid, "after_semantic": grid, "after_distractor": grid,
         "change_caption": caps, "no_change_caption": caps}
    shapes = jax.eval_shape(lambda b: m.init({"params": jax.random.key(0)}, b, train=False), b)
    assert set(shapes) == {"params"}  # no PE buffer or cache among the variables
    flat = flax.traverse_util.flatten_dict(shapes["params"], sep="/")
    count = lambda prefix: sum(math.prod(s.shape) for k, s in flat.items()
                               if k.startswith(prefix))
    # Appendix A totals (the decoder's PE buffer excluded).
    assert count("encoder/") == 2_635_778
    assert count("decoder/") == 4_425_564
    assert count("cbr/") == 2_361_345
    assert set(shapes["params"]) == {"encoder", "decoder", "cbr"}
    expected = {
        "encoder/img_0/kernel": (1026, 512),
        "encoder/pos_embedding/w_embedding": (14, 256),
        "encoder/pos_embedding/h_embedding": (14, 256),
        "encoder/scorer_0/attention/logit_scale": (),
        "encoder/scorer_1/attention/query/kernel": (512, 512),
        "encoder/scorer_1/attention/layer_norm/scale": (512,),
        "encoder/embed_fc_0/kernel": (1024, 512),
        "decoder/embed/embedding": (76, 300),
        "decoder/fc_0/kernel": (300, 512),
        "decoder/fc_2/scale": (512,),
        "decoder/layer_1/self_attention/value/bias": (512,),
        "decoder/layer_0/dec_enc_attention/key/kernel": (512, 512),
        "decoder/layer_0/hidden_intermediate/dense/kernel": (512, 512),
        "decoder/layer_1/norm2/bias": (512,),
        "decoder/layer_1/output/dense/kernel": (512, 512),
        "decoder/layer_1/output/LayerNorm/scale": (512,),
        "decoder/logit/kernel": (512, 76),
        "cbr/conv1/kernel": (1024, 512),
        "cbr/mh_att/q_proj/kernel": (512, 512),
        "cbr/mh_att/out_proj/kernel": (512, 512),
        "cbr/conv2_0/bias": (512,),
        "cbr/contra/logit_scale": (),
        "cbr/contra/key/kernel": (512, 512),
    }
    for path, shape in expected.items():
        assert flat[path].shape == shape, path
    assert not any(k.startswith("cbr/mh_att") and k.endswith("bias") for k in flat)


def test_initialisation_follows_official(variables):
    p = {k: np.asarray(v) for k, v in
         flax.traverse_util.flatten_dict(variables["params"], sep="/").items()}
    e = 32
    # Speaker: N(0, 0.02) weights (pad row included, S-Q7), zero biases.
    emb = p["decoder/embed/embedding"]
    assert np.abs(emb[0]).sum() > 0 and 0.015 < emb.std() < 0.025
    for name in ("self_attention/query", "output/dense", "hidden_intermediate/dense"):
        k = p[f"decoder/layer_0/{name}/kernel"]
        assert 0.015 < k.std() < 0.025 and np.all(p[f"decoder/layer_0/{name}/bias"] == 0)
    assert 0.015 < p["decoder/logit/kernel"].std() < 0.025
    assert np.all(p["decoder/logit/bias"] == 0)
    # ChangeDetector: torch defaults; N(0, 1) grid embeddings; logit scales 1.0.
    q = p["encoder/scorer_0/attention/query/kernel"]
    assert np.abs(q).max() <= 1 / math.sqrt(e) and np.abs(q).max() > 0.9 / math.sqrt(e)
    assert np.abs(p["encoder/scorer_0/attention/query/bias"]).max() > 0.5 / math.sqrt(e)
    assert 0.7 < p["encoder/pos_embedding/w_embedding"].std() < 1.3
    for path in ("encoder/scorer_0/attention/logit_scale",
                 "encoder/scorer_1/attention/logit_scale", "cbr/contra/logit_scale"):
        assert p[path] == 1.0
    # CBR: xavier over the stacked (3E, E) in_proj; conv1 U(1/sqrt(2E)).
    bound = math.sqrt(6 / (4 * e))
    k = np.abs(p["cbr/mh_att/q_proj/kernel"])
    assert k.max() <= bound and k.max() > 0.9 * bound
    assert np.abs(p["cbr/conv1/kernel"]).max() <= 1 / math.sqrt(2 * e)


def test_post_update_clamps_only_the_last_layer_and_cbr(model, variables):
    params = variables["params"]
    for path in ("encoder/scorer_0/attention/logit_scale",
                 "encoder/scorer_1/attention/logit_scale", "cbr/contra/logit_scale"):
        params = set_param(params, path, 7.0)
    params = set_param(params, "decoder/logit/bias", np.full((V,), 9.0))
    out = flax.traverse_util.flatten_dict(model.post_update(params), sep="/")
    assert float(out["encoder/scorer_1/attention/logit_scale"]) == pytest.approx(LOGIT_SCALE_MAX)
    assert float(out["cbr/contra/logit_scale"]) == pytest.approx(LOGIT_SCALE_MAX)
    assert float(out["encoder/scorer_0/attention/logit_scale"]) == 7.0  # S-Q3: left alone
    np.testing.assert_array_equal(out["decoder/logit/bias"], 9.0)
    # Below the bound nothing changes (no lower clamp).
    low = set_param(variables["params"], "encoder/scorer_1/attention/logit_scale", -2.0)
    low_out = flax.traverse_util.flatten_dict(model.post_update(low), sep="/")
    assert float(low_out["encoder/scorer_1/attention/logit_scale"]) == -2.0
    # A 1-layer encoder clamps scorer_0.
    one = SCORERCBR(**TINY, encoder_layers=1, use_cbr=False)
    small = {"encoder": {"scorer_0": {"attention": {"logit_scale": jnp.float32(9.0)}}}}
    assert float(one.post_update(small)["encoder"]["scorer_0"]["attention"]["logit_scale"]) == \
        pytest.approx(LOGIT_SCALE_MAX)


# ---- decoding ---------------------------------------------------------------------------------


def test_encode_then_decode_equals_training_logits(evaluated):
    out, _, decoded = evaluated
    np.testing.assert_allclose(decoded, out.caption_logits["distractor"], rtol=1e-5, atol=1e-5)


def check_cached_greedy(model, seed: int) -> None:
    """Cached greedy decoding (search.greedy_decode) == rerunning the whole decoder each step
    (search.full_recompute_greedy, the official sample() loop) on random sharpened params."""
    r = np.random.RandomState(100 + seed)
    before, after = (jnp.asarray(2 * r.randn(6, H, W, C), jnp.float32) for _ in range(2))
    shapes = {"before": before, "after_semantic": after,
              "change_caption": jnp.zeros((6, L), jnp.int32).at[:, 0].set(2)}
    variables = random_params(model, shapes, seed, sharpen=True)
    fast = search.greedy_decode(model, variables, before, after, max_len=L)
    slow = search.full_recompute_greedy(model, variables, before, after, max_len=L)
    np.testing.assert_array_equal(fast.ids, slow.ids)
    np.testing.assert_allclose(fast.log_probs, slow.log_probs, rtol=1e-5, atol=1e-5)
    ids = np.asarray(fast.ids)
    # Meaningful: some rows end early (END written as 0), some run on, words vary.
    ended = np.any(ids[:, 1:] == 0, axis=1)
    assert ended.any() and not ended.all()
    assert len(np.unique(ids[:, 1:])) >= 4


# Seeds whose random decoders give rows of different lengths (checked by the helper).
@pytest.mark.parametrize("seed", [1, 4])
def test_cached_greedy_equals_full_recompute(seed):
    check_cached_greedy(SCORERCBR(**TINY, pairs="semantic_only"), seed)


# ---- 8 devices == 1, trainer ------------------------------------------------------------------


def test_full_loss_and_gradients_8_devices_equal_1():
    assert jax.device_count() >= 8, "conftest forces 8 CPU devices"
    # One pair and one layer each keep the two compiles short; chunk 3 divides neither the
    # local (2) nor the global (16) batch.
    m = SCORERCBR(**TINY, dropout_rate=0.0, match_chunk_size=3, pairs="semantic_only",
                  encoder_layers=1, decoder_layers=1)
    b = make_batch(5, b=16)
    b = {k: b[k] for k in ("before", "after_semantic", "change_caption")}
    variables = random_params(m, b, 3)
    weights = {"sim": 0.1, "cbr": 0.001}
    results = []
    for n in (1, 8):
        mesh = parallel.make_mesh(n)
        loss_fn = caption_step.make_loss_fn(m, weights, mesh)
        arrays = jax.device_put(b, parallel.batch_sharding(mesh))
        grads, metrics = jax.jit(jax.grad(loss_fn, has_aux=True))(
            variables["params"], arrays, jax.random.key(0))
        results.append(jax.device_get((grads, metrics)))
    (g1, m1), (g8, m8) = results
    assert set(m1) >= {"loss", "loss/caption", "loss/sim", "loss/cbr"}
    for key in m1:
        np.testing.assert_allclose(m8[key], m1[key], rtol=1e-5, err_msg=key)
    flat1 = flax.traverse_util.flatten_dict(g1, sep="/")
    flat8 = flax.traverse_util.flatten_dict(g8, sep="/")
    largest = max(np.abs(g).max() for g in flat1.values())
    for name, a in flat1.items():
        scale = np.abs(a).max()
        if scale < 1e-6 * largest:  # analytically zero (e.g. scorer_0's logit scale)
            assert np.abs(flat8[name]).max() < 1e-6 * largest, name
            continue
        # float32 sums in another order; a wrong gradient is off by O(1) relative.
        np.testing.assert_allclose(flat8[name], a, atol=1e-4 * scale, err_msg=name)
    assert np.abs(flat1["encoder/scorer_0/attention/logit_scale"]) > 0
    assert np.abs(flat1["cbr/contra/logit_scale"]) > 0


def tiny_config(data_dir: str, preset: str = "clevr_change"):
    """configs/scorer.py's preset (optimiser switches included) on the tiny synthetic data."""
    config = scorer_config.get_config(preset)
    tiny = scorer_config.get_config("synthetic")
    config.dataset = tiny.dataset
    config.dataset.data_dir = data_dir
    config.dataset.options = dict(SMALL)
    # One pair and one decoder layer keep the compile short; two SCORER layers so that the
    # clamp of the last one only can be seen.
    config.model.update(pairs="semantic_only", use_coordinates=True, hidden_dim=32,
                        num_heads=4, word_dim=16, dropout_rate=0.0, encoder_layers=2,
                        decoder_layers=1)
    config.batch_size = 16
    config.eval_batch_size = 8
    config.num_train_steps = 3
    config.log_every_steps = 1
    config.eval_every_steps = 1000
    config.checkpoint_every_steps = 1000
    config.eval_splits = ()
    config.final_eval_splits = ()
    config.decode.max_len = 0
    return config


def _data_dir(small_synthetic) -> str:
    # <data_dir>/<tfds name>/<config>/<version>: the root the session fixture built into.
    return str(small_synthetic.directory.parents[2])


def _steps(config, workdir, num_steps: int, *, logit_scale: float | None = None):
    trainer = captioning.Trainer(config, workdir, mesh=parallel.make_mesh(1))
    state = trainer.init_state()
    if logit_scale is not None:
        params = set_param(state.params, "encoder/scorer_1/attention/logit_scale", logit_scale)
        # Same (replicated) placement as the trainer's, so the step compiles once.
        state = state.replace(params=jax.device_put(params, parallel.replicated(trainer.mesh)))
    before = jax.device_get(state.params)
    loader = iter(trainer.train_loader())
    history = []
    for _ in range(num_steps):
        batch = pipeline.to_global(next(loader), trainer.data_sharding)
        state, metrics = trainer.train_step(state, batch)
        history.append(jax.device_get(metrics))
    return before, jax.device_get(state.params), history


def _changed(a: dict, b: dict, group: str) -> bool:
    leaves = zip(jax.tree_util.tree_leaves(a[group]), jax.tree_util.tree_leaves(b[group]),
                 strict=True)
    return any(not np.array_equal(x, y) for x, y in leaves)


def test_paper_preset_freezes_cbr_trains_the_rest_and_clamps(small_synthetic, tmp_path):
    config = tiny_config(_data_dir(small_synthetic))
    assert tuple(config.optim.frozen) == ("cbr",)
    before, after, history = _steps(config, tmp_path, 3, logit_scale=6.0)
    assert not _changed(before, after, "cbr")
    assert _changed(before, after, "encoder") and _changed(before, after, "decoder")
    emb0, emb1 = before["decoder"]["embed"]["embedding"], after["decoder"]["embed"]["embedding"]
    np.testing.assert_array_equal(emb1[0], emb0[0])  # padding_idx row: zero gradient
    # post_update ran: the last layer's scale, set to 6, was clamped to ln 100 (later Adam
    # steps move it by about lr each, from below the bound).
    scale = float(after["encoder"]["scorer_1"]["attention"]["logit_scale"])
    assert LOGIT_SCALE_MAX - 3 * 3 * config.optim.learning_rate < scale <= LOGIT_SCALE_MAX + 1e-6
    assert float(after["encoder"]["scorer_0"]["attention"]["logit_scale"]) == 1.0
    for metrics in history:
        assert np.isfinite(metrics["loss"]) and metrics["loss/cbr"] > 0
        assert metrics["loss"] == pytest.approx(
            metrics["loss/caption"] + 0.1 * metrics["loss/sim"] + 0.001 * metrics["loss/cbr"],
            rel=1e-5)


def test_switch_trains_cbr():
    """--config.optim.frozen='()' hands CBR to the trunk's optimiser; the paper preset's value
    keeps every CBR update exactly zero (no Adam moments either)."""
    params = {g: {"w": jnp.ones((3,))} for g in ("encoder", "decoder", "cbr")}
    grads = jax.tree.map(jnp.ones_like, params)
    for frozen, cbr_moves in ((None, False), ((), True)):
        optim = scorer_config.get_config("clevr_change").optim
        if frozen is not None:
            optim.frozen = frozen
        optimizer, _ = optimizers.make_optimizer(optim, steps_per_epoch=10)
        updates, _ = optimizer.update(grads, optimizer.init(params), params)
        moved = {k: bool(np.abs(np.asarray(v["w"])).max() > 0) for k, v in updates.items()}
        assert moved == {"encoder": True, "decoder": True, "cbr": cbr_moves}, optim.frozen


def test_presets():
    # preset -> (encoder layers, (w_sim, w_cbr), batch, lr, pairs, coordinates)
    want = {
        "synthetic": (2, (0.1, 0.001), 64, 5e-4, "both", True),
        "clevr_change": (2, (0.1, 0.001), 128, 2e-4, "both", True),
        "clevr_dc": (1, (0.01, 0.004), 128, 2e-4, "semantic_only", False),
        "spot_the_diff": (3, (0.3, 0.5), 32, 2e-4, "semantic_only", False),
        "image_editing_request": (2, (0.003, 0.06), 16, 1e-4, "semantic_only", False),
    }
    for preset, (layers, (w_sim, w_cbr), batch, lr, pairs, coords) in want.items():
        c = scorer_config.get_config(preset)
        assert (c.model.encoder_layers, c.batch_size, c.optim.learning_rate) == (layers, batch, lr)
        assert dict(c.loss_weights) == {"sim": w_sim, "cbr": w_cbr}
        assert (c.model.pairs, c.model.use_coordinates) == (pairs, coords)
        assert tuple(c.optim.frozen) == ("cbr",) and c.model.cbr_mean_by_length is False
        assert dict(c.optim.zero_grad_rows) == {"decoder/embed/embedding": 0}
    with pytest.raises(ValueError, match="unknown preset"):
        scorer_config.get_config("clevr")
