"""``jax.jit`` for the programs that only run a trained model (decoding, attention maps), with
the XLA compile options that make them faster on CPU.

On CPU, jaxlib's XLA hands dots, and the element-wise and reduction work around them, to the
YNNPACK library as fused calls ("library fusions", on by default). For an attention it builds one
call for scores, softmax and weighted sum, which ran at about 22 GFLOP/s on the development
CPU, against about 100 for a plain projection: at the DIRL paper preset, half of the encoder's
time at evaluation. Compiled without these fusions, greedy decoding of 64 pairs at the DIRL and
SCORER paper presets is about 1.4x faster (docs/performance.md "Decoding"). The train step is
not faster without them (DIRL's about 3% slower), so training keeps XLA's defaults.

The options are applied on the CPU backend only, and only when this XLA knows them (checked once
by compiling a trivial program), so another jaxlib gets XLA's defaults instead of an error.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

# XLA debug option -> value: no YNNPACK library fusions (an empty list of fusion types).
CPU_OPTIONS: dict[str, str] = {"xla_cpu_experimental_ynn_fusion_type": ""}


@functools.cache
def compiler_options() -> dict[str, str]:
    """The options for inference programs on this process's default backend ({} if none)."""
    if jax.default_backend() != "cpu":
        return {}
    try:
        jax.jit(lambda x: x + 1, compiler_options=CPU_OPTIONS).lower(jnp.zeros(())).compile()
    except jax.errors.JaxRuntimeError:  # an XLA without these options
        return {}
    return dict(CPU_OPTIONS)


def inference_jit(fun: Callable | None = None, **jit_kwargs: Any) -> Any:
    """``jax.jit(fun, **jit_kwargs)`` compiled with :func:`compiler_options`; usable as
    ``@inference_jit`` or ``@inference_jit(static_argnames=...)``. The jit is created at the
    first call (or ``.lower``), so importing a module that uses it initialises no backend
    (``jax.distributed.initialize`` must come first on multi-host runs)."""
    if fun is None:
        return functools.partial(inference_jit, **jit_kwargs)

    @functools.cache
    def jitted() -> Any:
        return jax.jit(fun, compiler_options=compiler_options() or None, **jit_kwargs)

    @functools.wraps(fun)
    def call(*args: Any, **kwargs: Any) -> Any:
        return jitted()(*args, **kwargs)

    call.lower = lambda *args, **kwargs: jitted().lower(*args, **kwargs)
    return call
