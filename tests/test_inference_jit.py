"""changecap_jax/inference/jit.py: decoding and attention maps compiled without XLA's YNNPACK
library fusions on CPU (docs/performance.md "Decoding"), the same results as XLA's defaults,
and XLA's defaults where the options are unknown."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from changecap_jax.inference import decoding, jit
from tests.test_decoding import MODEL, _features, _random_params


def test_cpu_options_are_known_and_used():
    assert jax.default_backend() == "cpu"
    assert jit.compiler_options() == jit.CPU_OPTIONS


def _attention_like(x: jax.Array) -> jax.Array:
    scores = jnp.einsum("bqd,bkd->bqk", x, x)
    return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(scores, axis=-1), x)


def test_no_library_fusion_in_an_inference_program():
    """The same attention compiled by plain jit holds YNNPACK fusions; by inference_jit none."""
    x = jnp.ones((2, 16, 32), jnp.float32)
    plain = jax.jit(_attention_like).lower(x).compile().as_text()
    ours = jit.inference_jit(_attention_like).lower(x).compile().as_text()
    assert "ynn_fusion" in plain
    assert "ynn_fusion" not in ours
    np.testing.assert_allclose(jit.inference_jit(_attention_like)(x),
                               jax.jit(_attention_like)(x), rtol=1e-6)


def test_an_unknown_option_falls_back_to_xla_defaults(monkeypatch):
    monkeypatch.setattr(jit, "CPU_OPTIONS", {"xla_cpu_no_such_option": ""})
    jit.compiler_options.cache_clear()
    try:
        assert jit.compiler_options() == {}
    finally:
        jit.compiler_options.cache_clear()


def test_greedy_decoding_is_the_default_compiled_one():
    """Decoding compiled with the options gives the captions and log-probs of the same
    function compiled with XLA's defaults."""
    before, after = _features(1)
    variables = _random_params(1)
    ours = decoding.greedy_decode(MODEL, variables, before, after, max_len=8)
    default = jax.jit(decoding._cached_decode.__wrapped__,
                      static_argnames=("model", "max_len", "greedy"))(
        MODEL, variables, before, after, jax.random.key(0), 8, True, {})
    np.testing.assert_array_equal(ours.ids, default.ids)
    np.testing.assert_allclose(ours.log_probs, default.log_probs, atol=1e-5)


@pytest.fixture(autouse=True)
def _fresh_options():
    yield
    jit.compiler_options.cache_clear()
