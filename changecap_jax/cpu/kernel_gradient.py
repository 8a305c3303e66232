"""A dense layer's kernel gradient in the form XLA's CPU runtime computes fastest.

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

The values are the same products summed in another order (float32 rounding differs).
``models/linear.py`` uses this form for the CPU lowering only, and only when the CPU tunings
are on; GPU and TPU libraries read transposed operands natively, and there the barrier would
only stop fusion.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def plain_product_kernel_gradient(x: Array, g: Array) -> Array:
    """x (T, I), g (T, O) -> x^T g (I, O), as one plain (untransposed) product on a
    materialised transpose of whichever of x and g is smaller."""
    barrier = jax.lax.optimization_barrier
    # False only where x's first element is NaN: known at run time only, and both branches
    # agree (the slices keep it defined for no tokens)
    runtime_predicate = jnp.all(x[:1, :1] == x[:1, :1])
    transposed = lambda a: barrier(
        jax.lax.cond(runtime_predicate, jnp.transpose, jnp.transpose, a))
    if x.shape[1] > g.shape[1]:  # g is smaller: (g^T x)^T
        return barrier(jnp.dot(transposed(g), x)).T
    return jnp.dot(transposed(x), g)
