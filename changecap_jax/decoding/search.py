"""Model-agnostic caption decoding: greedy, multinomial sampling and beam search with a
key/value cache.

Semantics follow the official ``sample()`` of SCORER / DIRL (``docs/official/``
§3.7, §4.6): every row starts with START (2); at each step the next-token distribution is the
log-softmax of the logits with the UNK (1) column then set to -1e10 (not renormalised); the next
token is the argmax (greedy, as at test time) or a draw from that distribution (sampling, as in
the official training-time validation); a row finishes at END (3), which is written as 0 like
every position after it; the loop stops when every row has finished or after ``max_len - 1``
predictions. Output ids (B, max_len) hold START at position 0 and at most max_len - 1 words.

Beam search (:func:`beam_search`, not in the official code) uses the same next-token
distribution (UNK banned the same way) and the same id conventions. The decoder runs on B*K rows
(batch-major, row b*K + k) sharing one encoding per example; beam 0 starts with score 0 and the
others with -inf, so step 0 expands START once. Each step keeps the K best of the K*V
continuations per example by the raw sum of log-probs and moves every cache row to its parent
beam. A beam that has emitted END is finished: it may only be extended by PAD at log-prob 0, so
its score stays fixed while it keeps competing for a slot. The loop stops when every beam is
finished or after ``max_len - 1`` predictions. The length penalty alpha (GNMT,
lp = ((5 + len) / 6) ** alpha, len = predicted tokens including END, max_len - 1 for a beam cut
at the limit) is applied only when ranking the K final hypotheses at the end (score = sum / lp);
during the search hypotheses are ranked by their raw sums. alpha = 0 returns the highest-sum
beam, and ``beam_size=1`` equals greedy. UNK's -1e10 is finite, so a K larger than the other
continuations can hold UNK beams (scored near -1e10); with even fewer hypotheses than K, the
rest are filler beams scored -inf.

A model whose token conventions differ (another START id, no UNK ban, running all
``max_len - 1`` steps with the raw ids kept after END) declares ``decoding_rules``
(:class:`changecap_jax.models.base.DecodingRules`); every function here follows them, and the
defaults are the conventions above.

Protocol every model implements (linen methods called through ``model.apply``):

* ``encode(before, after, *, train=False, **conditioning) -> memory``: the decoder's
  conditioning, any pytree (usually (B, N, D)); ``before`` / ``after`` are whatever the model's
  batch holds, and ``conditioning`` the pair's extra inputs the model declares (e.g.
  retrieved ``entities`` (B, k, D)); every decoding function here takes them as
  ``conditioning={name: array}`` and passes them on.
* ``init_cache(memory, max_len)``: run with ``mutable=['cache']``; creates the 'cache' collection
  (per layer: zeroed self-attention keys/values for ``max_len`` positions and the
  cross-attention keys/values of ``memory``, computed once).
* ``decode_step(token, index) -> logits``: run with ``mutable=['cache']``; ``token`` (B,) int32
  is the input at position ``index`` (a traced int32 scalar), the result (B, V) the logits for
  position ``index + 1``. Eval mode (no dropout).
* ``decode(memory, ids, *, train=False) -> logits``: teacher-forced logits (B, L, V) for all
  positions of ``ids``; only test references (:func:`full_recompute_greedy`) use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from changecap_jax.decoding.jit import inference_jit
from changecap_jax.models import precision
from changecap_jax.models.base import DecodingRules, decoding_rules

Array = jax.Array

PAD_ID = 0
UNK_ID = 1
START_ID = 2
END_ID = 3
UNK_LOG_PROB = -1e10


class DecodeOutput(NamedTuple):
    """ids (B, max_len) int32, START at 0 and 0 from END onwards; log_probs (B, max_len) float32:
    log p of the token chosen at each position while the row was unfinished (END included, even
    though it is written as 0), 0 at position 0 and after END."""

    ids: Array
    log_probs: Array


DEFAULT_RULES = DecodingRules()


def _next_token_log_probs(logits: Array, rules: DecodingRules = DEFAULT_RULES) -> Array:
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    # After the log-softmax, so the distribution is not renormalised (§3.7 step 3).
    for banned in rules.banned_ids:
        log_probs = log_probs.at[:, banned].set(UNK_LOG_PROB)
    return log_probs


def _without_cache(variables: Any) -> dict:
    return {k: v for k, v in dict(variables).items() if k != "cache"}


@inference_jit(static_argnames=("model", "max_len", "greedy"))
def _cached_decode(
    model: nn.Module,
    variables: Any,
    before: Any,
    after: Any,
    key: Array,
    max_len: int,
    greedy: bool,
    conditioning: dict,
) -> DecodeOutput:
    rules = decoding_rules(model)
    variables = _without_cache(variables)
    memory = model.apply(variables, before, after, method="encode", **conditioning)
    _, state = model.apply(variables, memory, max_len, method="init_cache", mutable=["cache"])
    batch = jax.tree_util.tree_leaves(memory)[0].shape[0]

    ids = jnp.zeros((batch, max_len), jnp.int32).at[:, 0].set(rules.start_id)
    log_probs = jnp.zeros((batch, max_len), jnp.float32)
    unfinished = jnp.ones((batch,), bool)
    symbol = jnp.full((batch,), rules.start_id, jnp.int32)

    def cond(carry: tuple) -> Array:
        k, _, unfinished, *_ = carry
        if not rules.stop_at_end:
            return k < max_len - 1
        return jnp.logical_and(k < max_len - 1, jnp.any(unfinished))

    def body(carry: tuple) -> tuple:
        k, symbol, unfinished, ids, log_probs, cache = carry
        logits, mutated = model.apply(
            {**variables, "cache": cache}, symbol, k, method="decode_step", mutable=["cache"]
        )
        lp = _next_token_log_probs(logits, rules)
        if greedy:
            nxt = jnp.argmax(lp, axis=-1).astype(jnp.int32)
        else:
            nxt = jax.random.categorical(jax.random.fold_in(key, k), lp, axis=-1)
            nxt = nxt.astype(jnp.int32)
        chosen = jnp.take_along_axis(lp, nxt[:, None], axis=-1)[:, 0]
        chosen = jnp.where(unfinished, chosen, 0.0)
        unfinished = jnp.logical_and(unfinished, nxt != rules.end_id)
        # END and everything after it become 0, unless the model keeps the raw ids.
        symbol = nxt * unfinished if rules.stop_at_end else nxt
        ids = ids.at[:, k + 1].set(symbol)
        log_probs = log_probs.at[:, k + 1].set(chosen)
        return k + 1, symbol, unfinished, ids, log_probs, mutated["cache"]

    init = (jnp.int32(0), symbol, unfinished, ids, log_probs, state["cache"])
    _, _, _, ids, log_probs, _ = jax.lax.while_loop(cond, body, init)
    return DecodeOutput(ids, log_probs)


def greedy_decode(
    model: nn.Module, variables: Any, before: Any, after: Any, *, max_len: int,
    conditioning: Mapping[str, Any] | None = None,
) -> DecodeOutput:
    """Greedy (argmax) decoding with the key/value cache (jitted; test-time decoding)."""
    return _cached_decode(model, variables, before, after, jax.random.key(0), max_len, True,
                          dict(conditioning or {}))


def sample_decode(
    model: nn.Module, variables: Any, before: Any, after: Any, key: Array, *, max_len: int,
    conditioning: Mapping[str, Any] | None = None,
) -> DecodeOutput:
    """Multinomial sampling with the key/value cache (jitted); step k draws with
    ``fold_in(key, k)``, so a fixed key gives a fixed result."""
    return _cached_decode(model, variables, before, after, key, max_len, False,
                          dict(conditioning or {}))


@inference_jit(static_argnames=("model",))
def _encode(model: nn.Module, variables: Any, before: Any, after: Any,
            conditioning: dict | None = None) -> Any:
    return model.apply(variables, before, after, method="encode", **(conditioning or {}))


@inference_jit(static_argnames=("model",))
def _full_logits(model: nn.Module, variables: Any, memory: Any, ids: Array) -> Array:
    return model.apply(variables, memory, ids, method="decode")


def full_recompute_greedy(
    model: nn.Module, variables: Any, before: Any, after: Any, *, max_len: int,
    conditioning: Mapping[str, Any] | None = None,
) -> DecodeOutput:
    """Reference greedy decoding: a plain Python loop that reruns ``decode`` on the whole id
    buffer every step, as the official ``sample()`` does (for tests; slow)."""
    rules = decoding_rules(model)
    variables = _without_cache(variables)
    memory = _encode(model, variables, before, after, dict(conditioning or {}))
    batch = jax.tree_util.tree_leaves(memory)[0].shape[0]
    ids = np.zeros((batch, max_len), np.int32)
    log_probs = np.zeros((batch, max_len), np.float32)
    unfinished = np.ones((batch,), bool)
    ids[:, 0] = rules.start_id
    for k in range(max_len - 1):
        logits = _full_logits(model, variables, memory, jnp.asarray(ids))[:, k]
        lp = np.asarray(_next_token_log_probs(logits, rules))
        nxt = lp.argmax(axis=-1).astype(np.int32)
        log_probs[:, k + 1] = np.where(unfinished, lp[np.arange(batch), nxt], 0.0)
        unfinished &= nxt != rules.end_id
        ids[:, k + 1] = nxt * unfinished if rules.stop_at_end else nxt
        if rules.stop_at_end and not unfinished.any():
            break
    return DecodeOutput(jnp.asarray(ids), jnp.asarray(log_probs))


class BeamOutput(NamedTuple):
    """Beam search result. ``ids`` / ``log_probs`` (B, max_len) are the best beam, with the
    conventions of :class:`DecodeOutput` (drop-in where greedy output is used); ``scores`` (B,)
    its ranking score; ``beam_ids`` (B, K, max_len) and ``beam_scores`` (B, K) all K beams,
    best first. A beam scored -inf is filler (only when K exceeds the number of hypotheses)."""

    ids: Array
    log_probs: Array
    scores: Array
    beam_ids: Array
    beam_scores: Array


def gnmt_length_penalty(lengths: Array, alpha: float) -> Array:
    """lp(len) = ((5 + len) / 6) ** alpha (Wu et al., 2016); ``lengths`` count predicted
    tokens, END included."""
    return ((5.0 + lengths.astype(jnp.float32)) / 6.0) ** alpha


@inference_jit(static_argnames=("model", "beam_size", "max_len", "length_penalty"))
def _beam_search(
    model: nn.Module,
    variables: Any,
    before: Any,
    after: Any,
    beam_size: int,
    max_len: int,
    length_penalty: float,
    conditioning: dict,
) -> BeamOutput:
    K = beam_size
    rules = decoding_rules(model)
    variables = _without_cache(variables)
    memory = model.apply(variables, before, after, method="encode", **conditioning)
    batch = jax.tree_util.tree_leaves(memory)[0].shape[0]
    # Encode once at batch B; the decoder works on B*K rows, batch-major (row b*K + k).
    memory = jax.tree_util.tree_map(lambda x: jnp.repeat(x, K, axis=0), memory)
    _, state = model.apply(variables, memory, max_len, method="init_cache", mutable=["cache"])

    row_base = jnp.arange(batch)[:, None] * K

    def cond(carry: tuple) -> Array:
        k, _, finished, *_ = carry
        return jnp.logical_and(k < max_len - 1, jnp.logical_not(jnp.all(finished)))

    def body(carry: tuple) -> tuple:
        k, symbol, finished, scores, lengths, ids, log_probs, cache = carry
        logits, mutated = model.apply(
            {**variables, "cache": cache}, symbol, k, method="decode_step", mutable=["cache"]
        )
        vocab = logits.shape[-1]
        lp = _next_token_log_probs(logits, rules).reshape(batch, K, vocab)
        # A finished beam has one continuation, PAD at log-prob 0, so its score stays fixed
        # and it keeps competing for a slot with the live beams.
        pad_only = jnp.where(jnp.arange(vocab) == PAD_ID, 0.0, -jnp.inf)
        lp = jnp.where(finished[..., None], pad_only, lp)
        scores, parent, token, chosen = _select_beams(lp, scores)
        live = jnp.logical_not(jnp.take_along_axis(finished, parent, axis=1))
        # -inf only arises from filler beams, which then stay finished (as filler).
        finished = (~live) | (token == rules.end_id) | jnp.isneginf(scores)
        chosen = jnp.where(live, chosen, 0.0)
        new_symbol = token * jnp.logical_not(finished)  # END and everything after it become 0
        lengths = jnp.take_along_axis(lengths, parent, axis=1) + live.astype(jnp.int32)
        ids = jnp.take_along_axis(ids, parent[..., None], axis=1).at[:, :, k + 1].set(new_symbol)
        log_probs = jnp.take_along_axis(log_probs, parent[..., None], axis=1)
        log_probs = log_probs.at[:, :, k + 1].set(chosen)
        # Each new beam continues its parent's prefix: every cache leaf (batch-leading, B*K rows)
        # takes the parent's row. Parents never cross batch rows (top-k is per row).
        rows = (row_base + parent).reshape(-1)
        cache = jax.tree_util.tree_map(lambda x: jnp.take(x, rows, axis=0), mutated["cache"])
        return k + 1, new_symbol.reshape(-1), finished, scores, lengths, ids, log_probs, cache

    init = (*_beam_start(batch, K, max_len, rules.start_id), state["cache"])
    _, _, _, scores, lengths, ids, log_probs, _ = jax.lax.while_loop(cond, body, init)

    return _final_beams(scores, lengths, ids, log_probs, length_penalty)


def _beam_start(batch: int, K: int, max_len: int, start_id: int) -> tuple:
    """The loop's first carry but the cache: (step, symbol, finished, scores, lengths, ids,
    log_probs)."""
    ids = jnp.zeros((batch, K, max_len), jnp.int32).at[:, :, 0].set(start_id)
    log_probs = jnp.zeros((batch, K, max_len), jnp.float32)
    # Only beam 0 is live at first, so step 0 expands one copy of START instead of K.
    scores = jnp.full((batch, K), -jnp.inf, jnp.float32).at[:, 0].set(0.0)
    finished = jnp.broadcast_to(jnp.arange(K) > 0, (batch, K))
    lengths = jnp.zeros((batch, K), jnp.int32)
    symbol = jnp.full((batch * K,), start_id, jnp.int32)
    return jnp.int32(0), symbol, finished, scores, lengths, ids, log_probs


def _select_beams(lp: Array, scores: Array) -> tuple[Array, Array, Array, Array]:
    """One beam step's K survivors of (B, K, V) next-token log-probs ``lp`` and (B, K) beam
    scores: (new scores, parent beam, token, its log-prob), each (B, K).

    Two-stage top-k (same selection as top-K of all K*V candidates, since a global winner is
    among its own beam's top K): ranking inside a beam on the log-probs themselves, not on
    score + log-prob, keeps float rounding from merging them into ties, and lax.top_k, like
    argmax, puts the lower index first on a tie, so K = 1 is greedy exactly."""
    batch, K, vocab = lp.shape
    per_beam = min(K, vocab)
    top_lp, top_tok = jax.lax.top_k(lp, per_beam)  # (B, K, per_beam)
    candidates = (scores[..., None] + top_lp).reshape(batch, K * per_beam)
    scores, flat = jax.lax.top_k(candidates, K)
    parent = flat // per_beam
    token = jnp.take_along_axis(top_tok.reshape(batch, -1), flat, axis=1)
    chosen = jnp.take_along_axis(top_lp.reshape(batch, -1), flat, axis=1)
    return scores, parent, token, chosen


def _final_beams(scores: Array, lengths: Array, ids: Array, log_probs: Array,
                 length_penalty: float) -> BeamOutput:
    """The K final hypotheses ranked by score, length-penalised when alpha != 0."""
    ranking = scores
    if length_penalty != 0.0:  # static: alpha = 0 keeps the raw sums bit for bit
        ranking = scores / gnmt_length_penalty(lengths, length_penalty)
    beam_scores, order = jax.lax.top_k(ranking, scores.shape[1])
    beam_ids = jnp.take_along_axis(ids, order[..., None], axis=1)
    beam_log_probs = jnp.take_along_axis(log_probs, order[..., None], axis=1)
    return BeamOutput(
        beam_ids[:, 0], beam_log_probs[:, 0], beam_scores[:, 0], beam_ids, beam_scores
    )


def beam_search(
    model: nn.Module,
    variables: Any,
    before: Any,
    after: Any,
    *,
    beam_size: int,
    max_len: int,
    length_penalty: float = 0.0,
    conditioning: Mapping[str, Any] | None = None,
) -> BeamOutput:
    """Beam search with the key/value cache (jitted per model / beam_size / max_len /
    length_penalty; see the module docstring).

    ``beam_size`` K beams per example; the decoder runs on B*K rows, so the cache and the
    repeated memory take K times greedy's memory. ``length_penalty`` alpha >= 0 only reranks
    the K final hypotheses by sum / ((5 + len) / 6) ** alpha (the search keeps ranking by raw
    sums); 0 returns the highest-sum beam. ``beam_size=1`` equals :func:`greedy_decode` token
    for token. Returns :class:`BeamOutput`, whose ``ids`` / ``log_probs`` replace greedy's."""
    if beam_size < 1:
        raise ValueError(f"beam_size must be >= 1, got {beam_size}")
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    return _beam_search(
        model, variables, before, after, int(beam_size), int(max_len), float(length_penalty),
        dict(conditioning or {}),
    )


def decode_ids(model: nn.Module, params: Any, before: Array, after: Array, *,
               decode_config: Any, max_len: int, key: Array,
               conditioning: Mapping[str, Array] | None = None,
               compute_dtype: Any = jnp.float32) -> Array:
    """Caption ids (B, max_len) as ``decode_config`` (a config's ``decode`` block) asks:
    beam search when ``beam_size`` > 1, else sampling with ``key`` when ``sample``, else greedy.
    The parameters and inputs are cast to ``compute_dtype`` first (``precision``)."""
    params, before, after, conditioning = precision.cast_floating(
        (params, before, after, conditioning), compute_dtype)
    variables = {"params": params}
    decode = decode_config
    if decode.get("beam_size", 1) > 1:
        if decode.sample:
            raise ValueError("decode.sample and decode.beam_size > 1 exclude each other")
        return beam_search(model, variables, before, after,
                           beam_size=decode.beam_size, max_len=max_len,
                           length_penalty=decode.get("length_penalty", 0.0),
                           conditioning=conditioning).ids
    if decode.sample:
        return sample_decode(model, variables, before, after, key,
                             max_len=max_len, conditioning=conditioning).ids
    return greedy_decode(model, variables, before, after,
                         max_len=max_len, conditioning=conditioning).ids
