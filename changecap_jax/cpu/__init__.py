"""Everything in the package that exists only to make CPU runs faster (or quieter), in one place.

* :mod:`~changecap_jax.cpu.allocator`: the host allocator a command starts with (tcmalloc or
  glibc's tunables; a process restart, before JAX is imported);
* :mod:`~changecap_jax.cpu.inference_options`: XLA compile options for the programs that only
  run a trained model (decoding, attention maps);
* :mod:`~changecap_jax.cpu.kernel_gradient`: the form of a dense layer's kernel gradient that
  XLA's CPU runtime computes fastest;
* :mod:`~changecap_jax.cpu.platforms`: ``JAX_PLATFORMS=cpu`` where the machine shows no GPU or
  TPU and the user set none, so installed accelerator plugins do not log their failed start.

The command line applies them: ``cli.run`` (every ``python -m changecap_jax...`` command)
defaults the platform, restarts under the allocator and calls :func:`enable`. Code that uses
the library directly gets XLA's defaults unless it calls :func:`enable` itself. Each switches
itself off where JAX computes on an accelerator: the platform default where a GPU or TPU
device is present, the allocator when a GPU or TPU platform is configured or installed, the
compile options when the default backend is not the CPU or the program is lowered inside
another one (an export for GPU/TPU), the kernel-gradient form by being the CPU lowering of its
primitive only (GPU and TPU lowerings keep the folded product).
"""

from __future__ import annotations

_enabled = False


def enable(on: bool = True) -> None:
    """Turns the compile-time CPU tunings on (or off) for programs lowered from now on: the
    inference compile options, and the kernel gradient's CPU lowering."""
    from changecap_jax.cpu import kernel_gradient

    global _enabled
    _enabled = bool(on)
    kernel_gradient.use_plain_product(_enabled)


def enabled() -> bool:
    """Whether :func:`enable` turned the compile-time CPU tunings on in this process."""
    return _enabled
