"""models/linear.py: the dense product whose kernel gradient runs as a plain product on CPU."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from changecap_jax.models.linear import kernel_gradient, linear


def _inputs(tokens: int, fan_in: int, fan_out: int, dtype=jnp.float32):
    rng = np.random.default_rng(fan_in * 7 + fan_out)
    x = jnp.asarray(rng.standard_normal((2, tokens, fan_in)), dtype)
    kernel = jnp.asarray(rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in), dtype)
    return x, kernel


def _grads(product, x, kernel):
    # a non-linear loss, so that the cotangent differs from token to token
    loss = lambda x, kernel: jnp.sum(jnp.sin(product(x, kernel)).astype(jnp.float32))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, kernel)


@pytest.mark.parametrize("fan_in,fan_out", [(96, 32), (32, 96), (48, 48)])
def test_same_values_and_gradients_as_the_plain_product(fan_in, fan_out):
    x, kernel = _inputs(50, fan_in, fan_out)
    np.testing.assert_array_equal(linear(x, kernel), jnp.dot(x, kernel))
    (loss, (dx, dk)), (ref_loss, (ref_dx, ref_dk)) = (
        _grads(linear, x, kernel), _grads(jnp.dot, x, kernel))
    assert float(loss) == float(ref_loss)
    np.testing.assert_array_equal(dx, ref_dx)  # the input gradient is the same product
    # the kernel gradient sums the same products in another order: float32 rounding only
    np.testing.assert_allclose(dk, ref_dk, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(ref_dk))))
    assert dk.shape == kernel.shape


def test_kernel_gradient_is_the_sum_over_tokens():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 4)).astype(np.float32)
    g = rng.standard_normal((3, 5, 6)).astype(np.float32)
    expected = sum(np.outer(x[b, t], g[b, t]) for b in range(3) for t in range(5))
    np.testing.assert_allclose(jax.jit(kernel_gradient)(x, g), expected, rtol=1e-5, atol=1e-5)


def test_bfloat16_keeps_its_dtype_and_values():
    x, kernel = _inputs(40, 64, 32, jnp.bfloat16)
    _, (dx, dk) = _grads(linear, x, kernel)
    _, (ref_dx, ref_dk) = _grads(jnp.dot, x, kernel)
    assert dk.dtype == dx.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(dk, np.float32), np.asarray(ref_dk, np.float32),
                               rtol=2e-2, atol=2e-2 * float(jnp.max(jnp.abs(ref_dk))))


def _dots(fn, *args) -> list[str]:
    return [line for line in jax.jit(fn).lower(*args).compile().as_text().splitlines()
            if re.search(r"= \S+ dot\(", line)]


def _transposed_lhs(dot_line: str) -> bool:
    return "lhs_contracting_dims={0}" in dot_line


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU lowering")
@pytest.mark.parametrize("fan_in,fan_out", [(96, 32), (32, 96)])
def test_cpu_kernel_gradient_is_a_plain_product(fan_in, fan_out):
    """XLA folds x^T into the dot (contracting the lhs's token axis), the form its CPU runtime
    runs slowest; here the gradient's dot contracts the lhs's last axis, and the one transposed
    copy is of the smaller operand."""
    x, kernel = _inputs(50, fan_in, fan_out)
    g = jnp.ones((2, 50, fan_out))
    assert any(_transposed_lhs(d) for d in _dots(lambda x, g: jnp.dot(x.reshape(-1, fan_in).T,
                                                                     g.reshape(-1, fan_out)), x, g))
    dots = _dots(kernel_gradient, x, g)
    assert len(dots) == 1 and not _transposed_lhs(dots[0]), dots
    hlo = jax.jit(kernel_gradient).lower(x, g).compile().as_text()
    smaller = min(fan_in, fan_out)
    assert re.search(rf"= f32\[{smaller},100\]\{{1,0\}} (fusion|transpose|copy)", hlo), hlo
    grad_dots = _dots(jax.grad(lambda x, k: jnp.sum(jnp.sin(linear(x, k))), argnums=1), x, kernel)
    assert grad_dots and not any(_transposed_lhs(d) for d in grad_dots), grad_dots


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU lowering")
def test_cpu_cotangent_is_computed_once_not_again_in_the_transpose():
    """The cotangent here is an element-wise expression (cos of the output). Transposed
    directly, XLA fuses that expression into the transposing loop and computes it twice (there
    and for the input gradient); transposed inside the conditional, it is computed once."""
    x, kernel = _inputs(50, 96, 32)  # the cotangent (32 wide) is the operand transposed
    loss = lambda x, kernel: jnp.sum(jnp.sin(linear(x, kernel)))
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, kernel).compile().as_text()
    assert len(re.findall(r"= f32\[[\d,]*\]\{[\d,]*\} cosine\(", hlo)) == 1, hlo


def test_no_tokens_give_zero_gradients():
    x = jnp.zeros((2, 0, 4))
    kernel = jnp.ones((4, 3))
    dx, dk = jax.jit(jax.grad(lambda x, k: jnp.sum(jnp.sin(linear(x, k))), argnums=(0, 1)))(
        x, kernel)
    assert dx.shape == x.shape
    np.testing.assert_array_equal(dk, np.zeros((4, 3), np.float32))


def test_gradients_nothing_asks_for_are_not_traced():
    """The input features of a model's first layer are not differentiated: their gradient
    product must not be in the step's jaxpr (the benchmark counts FLOPs from it)."""
    from changecap_jax.commands.flop_count import dot_flops

    x, kernel = _inputs(50, 96, 32)
    product = 2 * 100 * 96 * 32
    loss = lambda x, kernel: jnp.sum(jnp.sin(linear(x, kernel)))
    assert dot_flops(jax.grad(loss, argnums=1), x, kernel).flops == 2 * product
    assert dot_flops(jax.grad(loss, argnums=0), x, kernel).flops == 2 * product
    assert dot_flops(jax.grad(loss, argnums=(0, 1)), x, kernel).flops == 3 * product
    # an output that does not reach the loss: no backward product at all
    unused = lambda x, kernel: jnp.sum(kernel) + 0.0 * jnp.sum(jax.lax.stop_gradient(
        linear(x, kernel)))
    assert dot_flops(jax.grad(unused, argnums=(0, 1)), x, kernel).flops == product


def test_a_symbolically_zero_cotangent_gives_no_gradients():
    # with symbolic_zeros=True, JAX may hand the backward a SymbolicZero instead of an array
    from jax.custom_derivatives import SymbolicZero

    from changecap_jax.models import linear as linear_module

    x, kernel = _inputs(5, 8, 4)
    zero = SymbolicZero(jax.core.ShapedArray((2, 5, 4), jnp.float32))
    assert linear_module._linear_backward((x, kernel, True, True), zero) == (None, None)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU lowering")
def test_without_the_cpu_tunings_the_gradient_is_xla_folded_product():
    """Code that uses the library without the command line (cpu.enable) gets XLA's own form."""
    from changecap_jax import cpu

    x, _ = _inputs(50, 96, 32)
    g = jnp.ones((2, 50, 32))
    cpu.enable(False)
    try:
        dots = _dots(lambda x, g: kernel_gradient(x, g), x, g)
    finally:
        cpu.enable()  # tests/conftest.py's setting, as cli.run's
    assert len(dots) == 1 and _transposed_lhs(dots[0]), dots
    # and switched back on, the same layer lowers to the plain product again
    dots = _dots(lambda x, g: kernel_gradient(x, g), x, g)
    assert len(dots) == 1 and not _transposed_lhs(dots[0]), dots


def test_under_vmap_each_member_gets_its_own_kernel_gradient():
    x, kernel = _inputs(7, 6, 5)
    g = jnp.asarray(np.random.default_rng(1).standard_normal((2, 7, 5)), jnp.float32)
    batched = jax.jit(jax.vmap(kernel_gradient))(x, g)
    for b in range(2):
        np.testing.assert_allclose(batched[b], x[b].T @ g[b], rtol=1e-5, atol=1e-5)
    # one operand shared by the members
    shared = jax.vmap(kernel_gradient, in_axes=(None, 0))(x[0], g)
    np.testing.assert_allclose(shared[1], x[0].T @ g[1], rtol=1e-5, atol=1e-5)


def test_gpu_and_tpu_lowerings_keep_the_folded_product():
    """With the CPU tunings on, an export for GPU and TPU holds no optimisation barrier (the
    CPU form's mark), and one for the CPU does."""
    x, kernel = _inputs(50, 96, 32)
    grad = jax.jit(jax.grad(lambda x, k: jnp.sum(jnp.sin(linear(x, k))), argnums=1))
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, kernel)]
    for platform, cpu_form in (("cuda", False), ("tpu", False), ("cpu", True)):
        text = jax.export.export(grad, platforms=(platform,))(*shapes).mlir_module()
        assert ("optimization_barrier" in text) == cpu_form, platform
