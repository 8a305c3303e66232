"""``jax.jit`` for the programs that only run a trained model (decoding, attention maps).

A top-level call compiles with :func:`changecap_jax.cpu.inference_options.compiler_options`
(XLA options that make these programs faster on CPU when the command line has turned the CPU
tunings on; none elsewhere). Called inside another traced program (``jax.export`` for GPU or
TPU, a caller's own ``jax.jit``), it is a plain nested jit: compile options belong to the
outermost program, and JAX refuses them on an inner one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

from changecap_jax.cpu import inference_options


def _traced(args: Any) -> bool:
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(args))


def inference_jit(fun: Callable | None = None, **jit_kwargs: Any) -> Any:
    """``jax.jit(fun, **jit_kwargs)`` compiled with the inference compile options; usable as
    ``@inference_jit`` or ``@inference_jit(static_argnames=...)``. The jit is created at the
    first call (or ``.lower``), so importing a module that uses it initialises no backend
    (``jax.distributed.initialize`` must come first on multi-host runs)."""
    if fun is None:
        return functools.partial(inference_jit, **jit_kwargs)

    @functools.cache
    def jitted(options: tuple[tuple[str, str], ...]) -> Any:
        return jax.jit(fun, compiler_options=dict(options) or None, **jit_kwargs)

    def top_level() -> Any:
        return jitted(tuple(sorted(inference_options.compiler_options().items())))

    @functools.wraps(fun)
    def call(*args: Any, **kwargs: Any) -> Any:
        if _traced((args, kwargs)):
            return jitted(())(*args, **kwargs)
        return top_level()(*args, **kwargs)

    call.lower = lambda *args, **kwargs: top_level().lower(*args, **kwargs)
    return call
