"""``x @ kernel`` with a custom gradient: the kernel gradient (the sum over tokens of
``x_t^T g_t``) is one primitive, whose lowering picks the form: XLA's folded ``dot(x.T, g)``,
or on the CPU the plain product the command line registers with the other CPU tunings
(:mod:`changecap_jax.cpu.kernel_gradient`). The layer reads no setting. Gradients of inputs
nothing differentiates (image features) and of frozen kernels are not traced at all.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from changecap_jax.cpu.kernel_gradient import dense_kernel_gradient

Array = jax.Array


def kernel_gradient(x: Array, g: Array) -> Array:
    """sum over tokens of x_t^T g_t for x (..., in), g (..., out) -> (in, out)."""
    return dense_kernel_gradient(x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1]))


@jax.custom_vjp
def linear(x: Array, kernel: Array) -> Array:
    """x (..., in) @ kernel (in, out)."""
    return jnp.dot(x, kernel)


def _linear_forward(x: CustomVJPPrimal, kernel: CustomVJPPrimal) -> tuple[Array, Any]:
    # x.perturbed is False for inputs nothing differentiates (image features), kernel.perturbed
    # for frozen kernels: their gradients are then not traced at all (XLA would drop them, but
    # the benchmark's jaxpr FLOP count would not)
    return jnp.dot(x.value, kernel.value), (x.value, kernel.value, x.perturbed, kernel.perturbed)


def _linear_backward(residuals: tuple[Array, Array, bool, bool],
                     g: Array | SymbolicZero) -> tuple[Array | None, Array | None]:
    x, kernel, x_needs_gradient, kernel_needs_gradient = residuals
    if isinstance(g, SymbolicZero):  # the output does not reach the loss
        return None, None
    # the casts matter for mixed operands (x in bfloat16, the kernel in float32): each
    # cotangent has its primal's dtype
    dx = jnp.dot(g, kernel.T).astype(x.dtype) if x_needs_gradient else None
    dk = kernel_gradient(x, g).astype(kernel.dtype) if kernel_needs_gradient else None
    return dx, dk


linear.defvjp(_linear_forward, _linear_backward, symbolic_zeros=True)
