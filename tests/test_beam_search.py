"""Beam search (changecap_jax/decoding/search.py) on the three models of the trunk at tiny sizes
with
random parameters: beam 1 == greedy, beams never lose to greedy on these seeds, the reported
scores equal a teacher-forced recompute of the returned beams (which checks the cache
reordering), an exhaustive search, the length penalty, and rows of one batch that finish at
different steps.

Compiles dominate the runtime, so the tests share them: one model, params and feature batch
per model name, and the teacher-forced reference always runs on RECOMPUTE_ROWS rows.
"""

from __future__ import annotations

import functools
import itertools

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from changecap_jax import models
from changecap_jax.decoding import search
from configs import dirl as dirl_config
from configs import scorer as scorer_config
from configs import subtraction as subtraction_config

B, H, W, C, L, V = 6, 4, 4, 6, 8, 12
CONFIGS = {"dirl": dirl_config, "scorer": scorer_config, "subtraction": subtraction_config}
# One layer everywhere and small widths keep each compile short.
TINY = {
    "dirl": dict(hidden_dim=32, num_heads=4, word_dim=12, ffn_dim=64, mlp_hidden_dim=64,
                 encoder_layers=1, decoder_layers=1),
    "scorer": dict(hidden_dim=32, num_heads=4, word_dim=12, encoder_layers=1, decoder_layers=1),
    "subtraction": dict(hidden_dim=32, num_heads=4, word_dim=12, decoder_layers=1),
}
# The decoders' cross-attention kernels: scaled up so that the memory, and not only the
# prefix, steers the words (with plain random weights every row decodes nearly alike).
CROSS_ATTENTION = {"cross_att", "dec_enc_attention"}
# Per model: param seed (features seed 10 + seed), END bias and logit sharpening, picked so
# greedy rows end at different steps (some run to max_len) with varied
# words and distributions soft enough for beams to differ from greedy.
SETTINGS = {
    "dirl": dict(seed=0, end_bias=2.0, sharpen=1.0),
    "scorer": dict(seed=2, end_bias=2.0, sharpen=2.0),
    "subtraction": dict(seed=0, end_bias=2.0, sharpen=2.0),
}


@functools.cache
def build(name: str):
    """The model of the ``synthetic`` preset at TINY sizes, one pair, no dropout."""
    config = CONFIGS[name].get_config("synthetic").model
    config.update(dict(TINY[name], pairs="semantic_only", dropout_rate=0.0))
    return models.build(config, vocab_size=V, max_len=L)


def features(seed: int, b: int = B) -> tuple[jnp.ndarray, jnp.ndarray]:
    r = np.random.RandomState(seed)
    return tuple(jnp.asarray(2 * r.randn(b, H, W, C), jnp.float32) for _ in range(2))


def random_params(name: str, seed: int, *, end_bias: float = 2.0, sharpen: float = 2.0,
                  memory_gain: float = 3.0) -> dict:
    """Random params drawn with NumPy from the model's param shapes (no init compile). The
    logit layer is scaled by ``sharpen`` and the cross-attention kernels by ``memory_gain``; PAD
    and START are made unlikely (a trained model never predicts them; a live PAD would read as
    END in the ids) and END gets a bias so that rows end at different steps."""
    model = build(name)
    before, after = features(0, 2)
    batch = {"before": before, "after_semantic": after,
             "change_caption": jnp.zeros((2, L), jnp.int32).at[:, 0].set(2)}
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
        if path[-1] == "kernel" and CROSS_ATTENTION & set(path):
            value = value * memory_gain
        flat[path] = np.asarray(value, np.float32)
    logit = ("decoder", "logit")
    flat[logit + ("kernel",)] *= sharpen
    flat[logit + ("bias",)][[search.PAD_ID, search.START_ID]] = -1e4
    flat[logit + ("bias",)][search.END_ID] += end_bias
    return {"params": flax.traverse_util.unflatten_dict(
        {k: jnp.asarray(v) for k, v in flat.items()})}


# ---- teacher-forced reference -------------------------------------------------------------

RECOMPUTE_ROWS = 4096  # fixed, so the reference compiles once per model


@functools.partial(jax.jit, static_argnames=("model",))
def _teacher_forced_log_probs(model, variables, before, after, rows, ids):
    """(N, L, V) next-token log-probs at every position of ``ids`` (N, L) from the full decoder
    (no cache) on the memory of example ``rows`` (N,), UNK banned after the log-softmax as the
    decoding protocol says."""
    memory = model.apply(variables, before, after, method="encode")
    memory = jax.tree_util.tree_map(lambda x: x[rows], memory)
    logits = model.apply(variables, memory, ids, method="decode")
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return lp.at[..., search.UNK_ID].set(search.UNK_LOG_PROB)


def ids_of(tokens: tuple[int, ...], max_len: int) -> np.ndarray:
    """The id row the decoders write for predicted ``tokens``: START, words, 0 from END on."""
    row = np.zeros(max_len, np.int32)
    row[0] = search.START_ID
    for j, t in enumerate(tokens):
        if t == search.END_ID:
            break
        row[j + 1] = t
    return row


def tokens_of(row: np.ndarray) -> tuple[int, ...]:
    """Predicted tokens of an id row (no live PAD): the words, then END at the first 0."""
    out = []
    for t in row[1:]:
        out.append(int(t) if t else search.END_ID)
        if not t:
            break
    return tuple(out)


def recomputed_scores(model, variables, before, after,
                      hyps: list[list[tuple[int, ...]]]) -> list[np.ndarray]:
    """Per example b, the sum of teacher-forced log-probs of each hypothesis ``hyps[b][i]``
    (predicted tokens, END included), each rerun through the whole decoder on its own row."""
    flat = [t for row in hyps for t in row]
    n = len(flat)
    assert n <= RECOMPUTE_ROWS
    rows = np.zeros(RECOMPUTE_ROWS, np.int32)
    rows[:n] = np.repeat(np.arange(len(hyps)), [len(h) for h in hyps])
    ids = np.zeros((RECOMPUTE_ROWS, model.max_len), np.int32)
    ids[:, 0] = search.START_ID
    ids[:n] = [ids_of(t, model.max_len) for t in flat]
    lp = np.asarray(_teacher_forced_log_probs(model, variables, before, after,
                                              jnp.asarray(rows), jnp.asarray(ids)))
    # lp[:, j] scores the token predicted at position j + 1.
    tokens = np.zeros((n, model.max_len - 1), np.int64)
    mask = np.zeros_like(tokens, bool)
    for i, t in enumerate(flat):
        tokens[i, : len(t)], mask[i, : len(t)] = t, True
    chosen = np.take_along_axis(lp[:n, :-1], tokens[..., None], axis=-1)[..., 0]
    sums = np.where(mask, chosen.astype(np.float64), 0.0).sum(-1)
    return np.split(sums, np.cumsum([len(h) for h in hyps])[:-1])


def lengths_of(ids: np.ndarray) -> np.ndarray:
    """Predicted tokens including END: the position of the first 0 after START, else max_len-1."""
    zero = ids[..., 1:] == 0
    return np.where(zero.any(-1), zero.argmax(-1) + 1, ids.shape[-1] - 1)


# ---- tests ----------------------------------------------------------------------------------


@functools.cache
def setup(name: str):
    """Model, params and a feature batch of SETTINGS[name], shared by the tests."""
    settings = dict(SETTINGS[name])
    seed = settings.pop("seed")
    return (build(name), random_params(name, seed, **settings), *features(10 + seed))


@functools.cache
def greedy(name: str) -> search.DecodeOutput:
    return search.greedy_decode(*setup(name), max_len=L)


@functools.cache
def beams(name: str, k: int, alpha: float = 0.0) -> search.BeamOutput:
    return search.beam_search(*setup(name), beam_size=k, max_len=L, length_penalty=alpha)


def check_layout(ids: np.ndarray, log_probs: np.ndarray | None = None) -> None:
    """START at 0, no UNK, zeros from END on (and log-prob 0 at 0 and after END)."""
    assert np.all(ids[..., 0] == search.START_ID)
    assert not np.any(ids == search.UNK_ID)
    after_end = np.arange(ids.shape[-1]) > lengths_of(ids)[..., None]
    assert not np.any(ids[after_end])
    if log_probs is not None:
        assert np.all(log_probs[..., 0] == 0) and not np.any(log_probs[after_end])
        assert np.all(log_probs <= 0)


@pytest.mark.parametrize("name", ["dirl", "scorer", "subtraction"])
def test_beam_one_equals_greedy(name):
    ref, out = greedy(name), beams(name, 1)
    np.testing.assert_array_equal(out.ids, ref.ids)
    np.testing.assert_array_equal(out.log_probs, ref.log_probs)
    np.testing.assert_array_equal(out.beam_ids[:, 0], ref.ids)
    np.testing.assert_allclose(out.scores, np.asarray(ref.log_probs).sum(-1), rtol=1e-6)
    # Not vacuous: rows end at different steps (some run to max_len) and the words vary.
    ids = np.asarray(ref.ids)
    check_layout(ids, np.asarray(ref.log_probs))
    lengths = lengths_of(ids)
    assert len(set(lengths)) >= 3 and lengths.max() == L - 1
    assert len(np.unique(ids[:, 1:])) >= 5


@pytest.mark.parametrize("name, sizes", [("dirl", (3, 5)), ("scorer", (3,)),
                                         ("subtraction", (3,))])
def test_beams_beat_greedy_and_scores_match_teacher_forcing(name, sizes):
    model, variables, before, after = setup(name)
    greedy_sum = np.asarray(greedy(name).log_probs).sum(-1)
    improved = 0
    for k in sizes:
        out = beams(name, k)
        ids, beam_ids = np.asarray(out.ids), np.asarray(out.beam_ids)
        beam_scores = np.asarray(out.beam_scores)
        assert ids.shape == (B, L) and beam_ids.shape == (B, k, L) and beam_scores.shape == (B, k)
        check_layout(beam_ids)
        check_layout(ids, np.asarray(out.log_probs))
        np.testing.assert_array_equal(ids, beam_ids[:, 0])
        np.testing.assert_array_equal(out.scores, beam_scores[:, 0])
        np.testing.assert_allclose(np.asarray(out.log_probs).sum(-1), out.scores, rtol=1e-5)
        assert np.all(np.diff(beam_scores, axis=1) <= 0)  # best first
        for row in beam_ids:  # K distinct hypotheses per example
            assert len({tuple(r) for r in row}) == k
        # Not guaranteed by beam search in general (greedy's prefix can fall out of the beam),
        # but it holds for every row here.
        assert np.all(beam_scores[:, 0] >= greedy_sum - 1e-5)
        improved += np.sum(beam_scores[:, 0] > greedy_sum + 1e-4)
        # Every beam's score is its own sum of log-probs under the whole decoder: a beam that
        # read another beam's keys/values (wrong cache reordering) would break this.
        hyps = [[tokens_of(r) for r in row] for row in beam_ids]
        recomputed = np.stack(recomputed_scores(model, variables, before, after, hyps))
        np.testing.assert_allclose(beam_scores, recomputed, rtol=0, atol=1e-4)
    assert improved > 0  # and the beams found something greedy missed


def test_exhaustive_beam_finds_the_best_sequences():
    """3 predictions (decoding max_len 4) over vocab 12: 1 + 11 + 121 * 12 = 1464 hypotheses,
    so 12**3 = 1728 beams never prune; the beams must be exactly all of them, best first."""
    max_len, k = 4, V**3
    model, variables, before, after = setup("dirl")
    out = search.beam_search(model, variables, before, after, beam_size=k, max_len=max_len)
    assert out.beam_ids.shape == (B, k, max_len)

    # Clean hypotheses use the words 4..11 only. The others hold PAD / START (logit bias
    # -1e4) or UNK (-1e10), and a live PAD is masked as padding by the teacher-forced decoder
    # but not by the cache, so for them only the count is checked.
    words = range(4, V)
    end = (search.END_ID,)
    clean = [end] + [(a,) + end for a in words]
    clean += [(a, b, c) for a, b in itertools.product(words, words) for c in (*words, *end)]
    assert len(clean) == 1 + 8 + 64 * 9
    scores = recomputed_scores(model, variables, before, after, [clean] * B)
    beam_scores = np.asarray(out.beam_scores)
    for row in range(B):
        assert np.all(np.isfinite(beam_scores[row, :1464]))
        assert np.all(np.isneginf(beam_scores[row, 1464:]))  # filler beams
        top = beam_scores[row, : len(clean)]
        assert top[-1] > -5e3 and beam_scores[row, len(clean)] < -5e3  # clean ones first
        np.testing.assert_allclose(top, np.sort(scores[row])[::-1], rtol=0, atol=1e-4)
        order = np.argsort(-scores[row], kind="stable")
        for rank in range(10):
            np.testing.assert_array_equal(out.beam_ids[row, rank],
                                          ids_of(clean[order[rank]], max_len))


def test_length_penalty_reranks_the_final_beams():
    alpha = 2.0
    plain, penalised = beams("dirl", 5), beams("dirl", 5, alpha)
    # The search itself ranks by raw sums, so both runs hold the same beams.
    for a, b in zip(np.asarray(plain.beam_ids), np.asarray(penalised.beam_ids), strict=True):
        assert {tuple(r) for r in a} == {tuple(r) for r in b}
    beam_ids, beam_scores = np.asarray(penalised.beam_ids), np.asarray(penalised.beam_scores)
    model, variables, before, after = setup("dirl")
    hyps = [[tokens_of(r) for r in row] for row in beam_ids]
    raw = np.stack(recomputed_scores(model, variables, before, after, hyps))
    lp = ((5.0 + lengths_of(beam_ids)) / 6.0) ** alpha
    np.testing.assert_allclose(beam_scores, raw / lp, rtol=1e-5, atol=1e-5)
    assert np.all(np.diff(beam_scores, axis=1) <= 0)
    # ids / log_probs / scores describe the best penalised beam.
    np.testing.assert_array_equal(penalised.ids, beam_ids[:, 0])
    best_len = lengths_of(np.asarray(penalised.ids))
    np.testing.assert_allclose(
        penalised.scores,
        np.asarray(penalised.log_probs).sum(-1) / ((5.0 + best_len) / 6.0) ** alpha, rtol=1e-5)
    # alpha > 0 can only favour longer hypotheses (sums are negative), and here it does.
    plain_len = lengths_of(np.asarray(plain.ids))
    assert np.all(best_len >= plain_len) and np.any(best_len > plain_len)


def test_rows_finishing_at_different_steps_decode_as_alone():
    model, variables, before, after = setup("scorer")
    batch = beams("scorer", 3)
    lengths = lengths_of(np.asarray(batch.beam_ids))
    assert len(set(lengths.max(1))) >= 2 and len(set(lengths[:, 0])) >= 3
    for row in range(B):
        alone = search.beam_search(model, variables, before[row : row + 1],
                                     after[row : row + 1], beam_size=3, max_len=L)
        np.testing.assert_array_equal(alone.beam_ids[0], batch.beam_ids[row])
        np.testing.assert_allclose(alone.beam_scores[0], batch.beam_scores[row], atol=1e-5)
        np.testing.assert_allclose(alone.log_probs[0], batch.log_probs[row], atol=1e-5)


def test_rejects_bad_sizes():
    model, variables, before, after = setup("dirl")
    with pytest.raises(ValueError, match="beam_size"):
        search.beam_search(model, variables, before, after, beam_size=0, max_len=L)
    with pytest.raises(ValueError, match="max_len"):
        search.beam_search(model, variables, before, after, beam_size=2, max_len=0)
