"""Mixed precision: the dtype a model computes in, separate from the dtype it is stored in.

``config.compute_dtype`` ("float32", the default, or "bfloat16") applies at the boundary of
every jitted forward pass of the trunk (the train step, the pretraining steps and
evaluation's decoding): the float32 parameters and the floating model inputs are cast to the
compute dtype there, so every Dense, attention product and embedding runs in it. What stays
float32:

* parameters and optimizer state (the cast is inside the differentiated function, so the
  gradients arrive in float32 and Adam updates float32 weights);
* softmax: attention scores are upcast before the softmax (``layers.MultiheadAttention``,
  ``decoder.multi_head_attend``, IDC-PCL's attention);
* normalisation statistics: ``nn.LayerNorm`` reduces in float32
  (``force_float32_reductions``);
* every loss: ``losses`` upcasts its inputs, so log-softmax, correlations and means are float32.

float64 (``jax_enable_x64``) is not a compute dtype of the trunk, but what is computed in float64
stays float64 (:func:`at_least_float32`), so that ``python -m changecap_jax reproduce
--precision=float64`` (docs/reproduce.md) runs every step in float64.

float16 is refused for training: without loss scaling its gradients underflow, and bfloat16
has float32's exponent range. Features stored in float16 are upcast on device by the same cast.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def compute_dtype(name: str) -> jnp.dtype:
    """The dtype named by ``config.compute_dtype``; a clear error for anything else."""
    if name not in COMPUTE_DTYPES:
        hint = (" (float16 training needs loss scaling, which the trunk does not do; "
                "bfloat16 has float32's range)" if name == "float16" else "")
        raise ValueError(
            f"config.compute_dtype must be one of {sorted(COMPUTE_DTYPES)}, got {name!r}{hint}")
    return jnp.dtype(COMPUTE_DTYPES[name])


def cast_floating(tree: Any, dtype: jnp.dtype) -> Any:
    """Every floating leaf of ``tree`` as ``dtype``; integer, boolean and key leaves unchanged."""

    def cast(x: Any) -> Any:
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
            return jnp.asarray(x).astype(dtype)
        return x

    return jax.tree_util.tree_map(cast, tree)


def at_least_float32(x: jax.Array) -> jax.Array:
    """``x`` in float32 where it is narrower (bfloat16, float16) or float32; float64 stays
    float64 (the x64 runs of docs/reproduce.md)."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))
