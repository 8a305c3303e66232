"""Keep freed host memory in the process when JAX computes on the CPU.

XLA's CPU runtime allocates the temporary buffer of a compiled program (every activation a
train step keeps for its backward pass: 1.1 GB for DIRL+CCR at the CLEVR-Change paper preset,
batch 16; 4.4 GB at batch 64) with ``malloc`` at every call and frees it at the end. glibc
serves an allocation that large with a fresh ``mmap`` and returns it with ``munmap``, so every
step page-faults its whole working memory back in: ~280 000 faults and ~0.5 s of kernel time
per DIRL step at batch 16, ~1.2 million and ~2.4 s at batch 64 (docs/performance.md, "Host
memory").

:func:`keep_freed_memory` tells glibc's allocator (``mallopt``) to serve every thread from its
main heap, never to ``mmap`` an allocation and never to give freed memory back to the system.
The step's buffers are then faulted in once, at the first step, and reused by every later one.
The cost is memory: a small allocation made between two steps can split the freed buffer, and
the next step then takes a new one, so the resident size grows by a temporary buffer now and
then (docs/performance.md, "Host memory"). :func:`release` gives the free memory back
(``malloc_trim``); the training loop calls it after every evaluation, so that growth does not
add up over a long run.

Every ``python -m changecap_jax.*`` command calls it first (``cli.run``). It does nothing when

* ``CHANGECAP_KEEP_HOST_MEMORY`` is ``0`` / ``false`` / ``off`` / ``no``;
* the C library is not glibc (macOS, musl): there is no ``mallopt`` to call;
* JAX may compute on an accelerator (``JAX_PLATFORMS`` names another platform than ``cpu``,
  or, with ``JAX_PLATFORMS`` unset, a GPU or TPU plugin is installed): device memory does not
  come from ``malloc``, and a single heap would only serialise the host threads' allocations.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import logging
import os
import platform
import sys

ENV_SWITCH = "CHANGECAP_KEEP_HOST_MEMORY"
OFF_VALUES = ("0", "false", "off", "no")

# mallopt parameters, from glibc's malloc.h.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8

# Modules that give JAX a GPU or TPU backend (the CUDA and ROCm plugins are namespace packages
# under jax_plugins; TPUs come through libtpu).
ACCELERATOR_MODULES = ("jax_plugins", "libtpu")

# Whether this process's allocator was set by keep_freed_memory (the benchmark reports it).
kept = False


def is_disabled() -> bool:
    """Whether ``CHANGECAP_KEEP_HOST_MEMORY`` switches the setting off."""
    return os.environ.get(ENV_SWITCH, "").strip().lower() in OFF_VALUES


def cpu_only() -> bool:
    """Whether JAX will compute on the CPU alone, decided without starting a backend (a
    started backend's threads would already have their own heaps)."""
    import jax

    platforms = jax.config.jax_platforms
    if platforms:
        return all(p.strip() == "cpu" for p in platforms.split(",") if p.strip())
    if any(importlib.util.find_spec(name) is not None for name in ACCELERATOR_MODULES):
        return False
    return not importlib.metadata.entry_points(group="jax_plugins")


_libc: ctypes.CDLL | None = None


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") else None


def keep_freed_memory() -> bool:
    """Sets glibc's allocator to keep freed memory (module docstring); returns whether it did.
    Call it before JAX starts its CPU backend: threads that allocated before keep their own
    heaps, whose large blocks still come and go through ``mmap``."""
    if is_disabled():
        return False
    libc = _glibc()
    if libc is None or not cpu_only():
        return False
    # M_TRIM_THRESHOLD takes a size_t through an int: -1 is the largest, "never trim".
    done = all(libc.mallopt(param, value) == 1 for param, value in (
        (M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1)))
    global kept, _libc
    kept, _libc = done, libc if done else None
    if done:
        logging.info("host memory: freed memory stays in the process (%s=0 switches it off)",
                     ENV_SWITCH)
    return done


def release() -> None:
    """Gives the heap's free memory back to the system when :func:`keep_freed_memory` is in
    effect (the next step faults its buffer in once more); does nothing otherwise."""
    if _libc is not None:
        _libc.malloc_trim(0)
