"""changecap_jax/decoding/jit.py with changecap_jax/cpu/inference_options.py: decoding and
attention maps compiled without XLA's YNNPACK library fusions on CPU (docs/performance.md
"Decoding"), the same results as XLA's defaults; XLA's defaults where the options are unknown,
where the CPU tunings are off, on another backend, and inside an outer traced program."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from changecap_jax import cpu
from changecap_jax.cpu import inference_options
from changecap_jax.decoding import jit, search
from tests.test_decoding import MODEL, _features, _random_params


def test_cpu_options_are_known_and_used():
    assert jax.default_backend() == "cpu" and cpu.enabled()  # tests/conftest.py, as cli.run
    assert inference_options.compiler_options() == inference_options.CPU_OPTIONS


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


def test_off_when_the_cpu_tunings_are_off(monkeypatch):
    monkeypatch.setattr(cpu, "_enabled", False)
    assert inference_options.compiler_options() == {}
    x = jnp.ones((2, 16, 32), jnp.float32)
    assert "ynn_fusion" in jit.inference_jit(_attention_like).lower(x).compile().as_text()


def test_off_on_an_accelerator_backend(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert inference_options.compiler_options() == {}


def test_an_unknown_option_falls_back_to_xla_defaults(monkeypatch):
    monkeypatch.setattr(inference_options, "CPU_OPTIONS", {"xla_cpu_no_such_option": ""})
    inference_options._known_to_this_xla.cache_clear()
    assert inference_options.compiler_options() == {}


def test_inside_an_outer_jit_it_is_a_plain_nested_jit():
    """JAX refuses compile options on a jit nested in a traced program; the outer program's
    own options (here XLA's defaults: fusions present) govern."""
    x = jnp.ones((2, 16, 32), jnp.float32)
    outer = jax.jit(lambda x: jit.inference_jit(_attention_like)(x) + 1)
    assert "ynn_fusion" in outer.lower(x).compile().as_text()
    np.testing.assert_allclose(outer(x), jax.jit(_attention_like)(x) + 1, rtol=1e-6)


def test_greedy_decoding_is_the_default_compiled_one():
    """Decoding compiled with the options gives the captions and log-probs of the same
    function compiled with XLA's defaults."""
    before, after = _features(1)
    variables = _random_params(1)
    ours = search.greedy_decode(MODEL, variables, before, after, max_len=8)
    default = jax.jit(search._cached_decode.__wrapped__,
                      static_argnames=("model", "max_len", "greedy"))(
        MODEL, variables, before, after, jax.random.key(0), 8, True, {})
    np.testing.assert_array_equal(ours.ids, default.ids)
    np.testing.assert_allclose(ours.log_probs, default.log_probs, atol=1e-5)


@pytest.fixture(autouse=True)
def _fresh_probe():
    yield
    inference_options._known_to_this_xla.cache_clear()
