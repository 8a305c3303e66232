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

How it is switched: the dense layers (``models/linear.py``) compute their kernel gradient as
the primitive :data:`kernel_gradient_p`, which reads no setting. Its lowering is XLA's folded
``dot(x.T, g)`` on every platform until :func:`use_plain_product` registers this form as its
CPU lowering (JAX's per-platform lowering rules); the command line does that with the other
CPU tunings (``cpu.enable``, called by ``cli.run``). GPU and TPU lowerings never see it (their
libraries read transposed operands natively, and there the barrier would only stop fusion), so
an export or ahead-of-time compile for them from a CPU host keeps the folded product.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

Array = jax.Array


def folded_kernel_gradient(x: Array, g: Array) -> Array:
    """x (T, I), g (T, O) -> x^T g (I, O) as XLA folds it (the default lowering)."""
    return jnp.dot(x.T, g)


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


# ---------------------------------------------------------------------------------------------
# The primitive the dense layers bind, and its lowerings
# ---------------------------------------------------------------------------------------------

kernel_gradient_p = Primitive("dense_kernel_gradient")


def dense_kernel_gradient(x: Array, g: Array) -> Array:
    """x (T, I), g (T, O) -> sum over tokens of x_t^T g_t (I, O), in the form the platform's
    lowering chooses (module docstring)."""
    return kernel_gradient_p.bind(x, g)


def _abstract(x: jax.core.ShapedArray, g: jax.core.ShapedArray) -> jax.core.ShapedArray:
    out = jax.eval_shape(folded_kernel_gradient, jax.ShapeDtypeStruct(x.shape, x.dtype),
                         jax.ShapeDtypeStruct(g.shape, g.dtype))
    return jax.core.ShapedArray(out.shape, out.dtype)


def _batched(args: tuple[Array, Array], dims: tuple[int | None, int | None]
             ) -> tuple[Array, int]:
    """Under ``vmap``: one kernel gradient per batch member (the folded form)."""
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    x, g = (jnp.moveaxis(a, d, 0) if d is not None else jnp.broadcast_to(a, (size, *a.shape))
            for a, d in zip(args, dims, strict=True))
    return jnp.einsum("bti,bto->bio", x, g), 0


kernel_gradient_p.def_abstract_eval(_abstract)
kernel_gradient_p.def_impl(folded_kernel_gradient)
batching.primitive_batchers[kernel_gradient_p] = _batched
mlir.register_lowering(kernel_gradient_p,
                       mlir.lower_fun(folded_kernel_gradient, multiple_results=False))


def use_plain_product(on: bool = True) -> None:
    """Registers (or, with ``on=False``, withdraws) :func:`plain_product_kernel_gradient` as
    the CPU lowering of :data:`kernel_gradient_p`, for programs lowered from now on."""
    form = plain_product_kernel_gradient if on else folded_kernel_gradient
    mlir.register_lowering(kernel_gradient_p, mlir.lower_fun(form, multiple_results=False),
                           platform="cpu")
