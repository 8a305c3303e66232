"""Model-agnostic caption decoding: greedy and multinomial sampling with a key/value cache.

Semantics follow the official ``sample()`` of SCORER / DIRL (``reference/official_pytorch.md``
§3.7, §4.6): every row starts with START (2); at each step the next-token distribution is the
log-softmax of the logits with the UNK (1) column then set to -1e10 (not renormalised); the next
token is the argmax (greedy, as at test time) or a draw from that distribution (sampling, as in
the official training-time validation); a row finishes at END (3), which is written as 0 like
every position after it; the loop stops when every row has finished or after ``max_len - 1``
predictions. Output ids (B, max_len) hold START at position 0 and at most max_len - 1 words.

Protocol every model implements (linen methods called through ``model.apply``):

* ``encode(before, after, *, train=False) -> memory``: the decoder's conditioning, any pytree
  (usually (B, N, D)); ``before`` / ``after`` are whatever the model's batch holds.
* ``init_cache(memory, max_len)``: run with ``mutable=['cache']``; creates the 'cache' collection
  (per layer: zeroed self-attention keys/values for ``max_len`` positions and the
  cross-attention keys/values of ``memory``, computed once).
* ``decode_step(token, index) -> logits``: run with ``mutable=['cache']``; ``token`` (B,) int32
  is the input at position ``index`` (a traced int32 scalar), the result (B, V) the logits for
  position ``index + 1``. Eval mode (no dropout).
* ``decode(memory, ids, *, train=False) -> logits``: teacher-forced logits (B, L, V) for all
  positions of ``ids``; only :func:`full_recompute_greedy` (the test reference) uses it.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

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


def _next_token_log_probs(logits: Array) -> Array:
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    # After the log-softmax, so the distribution is not renormalised (§3.7 step 3).
    return log_probs.at[:, UNK_ID].set(UNK_LOG_PROB)


def _without_cache(variables: Any) -> dict:
    return {k: v for k, v in dict(variables).items() if k != "cache"}


@functools.partial(jax.jit, static_argnames=("model", "max_len", "greedy"))
def _cached_decode(
    model: nn.Module,
    variables: Any,
    before: Any,
    after: Any,
    key: Array,
    max_len: int,
    greedy: bool,
) -> DecodeOutput:
    variables = _without_cache(variables)
    memory = model.apply(variables, before, after, method="encode")
    _, state = model.apply(variables, memory, max_len, method="init_cache", mutable=["cache"])
    batch = jax.tree_util.tree_leaves(memory)[0].shape[0]

    ids = jnp.zeros((batch, max_len), jnp.int32).at[:, 0].set(START_ID)
    log_probs = jnp.zeros((batch, max_len), jnp.float32)
    unfinished = jnp.ones((batch,), bool)
    symbol = jnp.full((batch,), START_ID, jnp.int32)

    def cond(carry: tuple) -> Array:
        k, _, unfinished, *_ = carry
        return jnp.logical_and(k < max_len - 1, jnp.any(unfinished))

    def body(carry: tuple) -> tuple:
        k, symbol, unfinished, ids, log_probs, cache = carry
        logits, mutated = model.apply(
            {**variables, "cache": cache}, symbol, k, method="decode_step", mutable=["cache"]
        )
        lp = _next_token_log_probs(logits)
        if greedy:
            nxt = jnp.argmax(lp, axis=-1).astype(jnp.int32)
        else:
            nxt = jax.random.categorical(jax.random.fold_in(key, k), lp, axis=-1)
            nxt = nxt.astype(jnp.int32)
        chosen = jnp.take_along_axis(lp, nxt[:, None], axis=-1)[:, 0]
        chosen = jnp.where(unfinished, chosen, 0.0)
        unfinished = jnp.logical_and(unfinished, nxt != END_ID)
        symbol = nxt * unfinished  # END and everything after it become 0
        ids = ids.at[:, k + 1].set(symbol)
        log_probs = log_probs.at[:, k + 1].set(chosen)
        return k + 1, symbol, unfinished, ids, log_probs, mutated["cache"]

    init = (jnp.int32(0), symbol, unfinished, ids, log_probs, state["cache"])
    _, _, _, ids, log_probs, _ = jax.lax.while_loop(cond, body, init)
    return DecodeOutput(ids, log_probs)


def greedy_decode(
    model: nn.Module, variables: Any, before: Any, after: Any, *, max_len: int
) -> DecodeOutput:
    """Greedy (argmax) decoding with the key/value cache (jitted; test-time decoding)."""
    return _cached_decode(model, variables, before, after, jax.random.key(0), max_len, True)


def sample_decode(
    model: nn.Module, variables: Any, before: Any, after: Any, key: Array, *, max_len: int
) -> DecodeOutput:
    """Multinomial sampling with the key/value cache (jitted); step k draws with
    ``fold_in(key, k)``, so a fixed key gives a fixed result."""
    return _cached_decode(model, variables, before, after, key, max_len, False)


@functools.partial(jax.jit, static_argnames=("model",))
def _encode(model: nn.Module, variables: Any, before: Any, after: Any) -> Any:
    return model.apply(variables, before, after, method="encode")


@functools.partial(jax.jit, static_argnames=("model",))
def _full_logits(model: nn.Module, variables: Any, memory: Any, ids: Array) -> Array:
    return model.apply(variables, memory, ids, method="decode")


def full_recompute_greedy(
    model: nn.Module, variables: Any, before: Any, after: Any, *, max_len: int
) -> DecodeOutput:
    """Reference greedy decoding: a plain Python loop that reruns ``decode`` on the whole id
    buffer every step, as the official ``sample()`` does (for tests; slow)."""
    variables = _without_cache(variables)
    memory = _encode(model, variables, before, after)
    batch = jax.tree_util.tree_leaves(memory)[0].shape[0]
    ids = np.zeros((batch, max_len), np.int32)
    log_probs = np.zeros((batch, max_len), np.float32)
    unfinished = np.ones((batch,), bool)
    ids[:, 0] = START_ID
    for k in range(max_len - 1):
        logits = _full_logits(model, variables, memory, jnp.asarray(ids))[:, k]
        lp = np.asarray(_next_token_log_probs(logits))
        nxt = lp.argmax(axis=-1).astype(np.int32)
        log_probs[:, k + 1] = np.where(unfinished, lp[np.arange(batch), nxt], 0.0)
        unfinished &= nxt != END_ID
        ids[:, k + 1] = nxt * unfinished
        if not unfinished.any():
            break
    return DecodeOutput(jnp.asarray(ids), jnp.asarray(log_probs))
