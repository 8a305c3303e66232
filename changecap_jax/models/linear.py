"""``x @ kernel`` whose kernel gradient is computed as XLA CPU computes products fastest.

The kernel gradient of a dense layer is ``x^T g`` summed over every token: x (tokens, in),
g (tokens, out). XLA folds the transpose into the dot, and its CPU runtime runs that
"transposed-lhs" product 15-25 % below a plain one (in the compiled steps XLA gave the folded
form to Eigen, the plain products to YNNPACK, and transposed the *larger* operand for it,
recomputing any dropout mask fused into it). Materialising the transpose of the *smaller*
operand first and keeping XLA from folding it back (``optimization_barrier``) gives a plain
product. At the paper shapes (3136 tokens) the gradient of a 2048 -> 512 layer takes 33 ms
instead of 40, a 512 -> 512 one 8.9 instead of 10.1 (docs/performance.md "Weight gradients").

The operand is transposed inside a conditional. XLA fuses an element-wise producer into each of
its consumers, so the cotangent of a layer behind dropout and ReLU (the mask's hash, the sum of
the gradients of every reader) would be computed again inside the transposing loop, in
transposed order: 45 ms instead of about 3 for DIRL's decoder memory. An optimisation barrier
does not stop that (XLA CPU removes barriers before fusion); a conditional's operand must be a
buffer of its own. Both branches are the same transpose, so the predicate, which XLA cannot
fold, never changes the value.

The values are the same products summed in another order (float32 rounding differs). Only the
CPU lowering changes (``jax.lax.platform_dependent``): GPU and TPU libraries read transposed
operands natively, and there the barrier would only stop fusion.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

Array = jax.Array


def _kernel_gradient_folded(x: Array, g: Array) -> Array:
    return jnp.dot(x.T, g)


def _kernel_gradient_plain(x: Array, g: Array) -> Array:
    """x (T, I), g (T, O) -> (I, O), as one plain (untransposed) product on a materialised
    transpose of whichever of x and g is smaller."""
    barrier = jax.lax.optimization_barrier
    # False only where x's first element is NaN: known at run time only, and both branches
    # agree (the slices keep it defined for no tokens)
    runtime_predicate = jnp.all(x[:1, :1] == x[:1, :1])
    transposed = lambda a: barrier(
        jax.lax.cond(runtime_predicate, jnp.transpose, jnp.transpose, a))
    if x.shape[1] > g.shape[1]:  # g is smaller: (g^T x)^T
        return barrier(jnp.dot(transposed(g), x)).T
    return jnp.dot(transposed(x), g)


def kernel_gradient(x: Array, g: Array) -> Array:
    """sum over tokens of x_t^T g_t for x (..., in), g (..., out) -> (in, out)."""
    x = x.reshape(-1, x.shape[-1])
    g = g.reshape(-1, g.shape[-1])
    return jax.lax.platform_dependent(
        x, g, cpu=_kernel_gradient_plain, default=_kernel_gradient_folded
    )


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
