"""XLA compile options that make the inference programs (decoding, attention maps) faster on CPU.

On CPU, jaxlib's XLA hands dots, and the element-wise and reduction work around them, to the
YNNPACK library as fused calls ("library fusions", on by default). For an attention it builds one
call for scores, softmax and weighted sum, which ran at about 22 GFLOP/s on the development
CPU, against about 100 for a plain projection: at the DIRL paper preset, half of the encoder's
time at evaluation. Compiled without these fusions, greedy decoding of 64 pairs at the DIRL and
SCORER paper presets is about 1.4x faster (docs/performance.md "Decoding"). The train step is
not faster without them (DIRL's about 3% slower), so training keeps XLA's defaults.

The options apply only when the CPU tunings are on (:func:`changecap_jax.cpu.enable`), the
default backend is the CPU, and this XLA knows them (checked once by compiling a trivial
program, so another jaxlib gets XLA's defaults instead of an error).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from changecap_jax import cpu

# XLA debug option -> value: no YNNPACK library fusions (an empty list of fusion types).
CPU_OPTIONS: dict[str, str] = {"xla_cpu_experimental_ynn_fusion_type": ""}


@functools.cache
def _known_to_this_xla() -> bool:
    try:
        jax.jit(lambda x: x + 1, compiler_options=CPU_OPTIONS).lower(jnp.zeros(())).compile()
    except jax.errors.JaxRuntimeError:  # an XLA without these options
        return False
    return True


def compiler_options() -> dict[str, str]:
    """The options for an inference program compiled now ({} for XLA's defaults)."""
    if not cpu.enabled() or jax.default_backend() != "cpu" or not _known_to_this_xla():
        return {}
    return dict(CPU_OPTIONS)
