"""The host allocator of a command that computes on the CPU, set when the process starts.

XLA's CPU runtime allocates a compiled program's temporary buffer (1.1 GB for a DIRL+CCR train
step at batch 16) with ``malloc`` at every call and frees it at the end. With glibc's defaults
a block that large is a fresh ``mmap``, so every step page-faults its working memory in again
(~8 % of the step). The standard remedies are settings given at process start, and the
command line uses the fastest one measured that is installed (docs/performance.md "Host
allocator: the routes measured"):

* ``tcmalloc``: ``LD_PRELOAD`` of gperftools' tcmalloc (Debian/Ubuntu: ``apt-get install
  libtcmalloc-minimal4``), which keeps freed memory for reuse by itself;
* ``glibc``: glibc's tunables (``GLIBC_TUNABLES``): one heap for every thread, no ``mmap`` for
  large blocks, no trimming; the process then holds its peak memory, which :func:`release`
  gives back after each evaluation.

:func:`restart_with_chosen_allocator` (the first step of every ``python -m changecap_jax``
command, ``cli.run``) replaces the process by the same command under the chosen setting, once;
the restarted process finds the setting in force and goes on. Nothing is set when

* ``CHANGECAP_HOST_ALLOCATOR`` is ``default`` (``tcmalloc`` or ``glibc`` pick one; ``auto``,
  the default, takes tcmalloc when installed, else glibc's tunables);
* the system is not Linux with glibc;
* JAX may compute on an accelerator (``JAX_PLATFORMS`` names another platform than ``cpu``, or,
  with ``JAX_PLATFORMS`` unset, a GPU or TPU plugin is installed): device memory does not come
  from ``malloc``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import logging
import os
import platform
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from changecap_jax.errors import UserError

CHOICE_VARIABLE = "CHANGECAP_HOST_ALLOCATOR"
CHOICES = ("auto", "tcmalloc", "glibc", "default")
# Set in the restarted process: the setting it runs under (also what the benchmark reports).
APPLIED_VARIABLE = "CHANGECAP_HOST_ALLOCATOR_APPLIED"
GLIBC_SETTINGS = ("glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:"
                  f"glibc.malloc.trim_threshold={2 ** 64 - 1}")
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
                 "/usr/lib", "/usr/local/lib")
# Modules that give JAX a GPU or TPU backend (the CUDA and ROCm plugins are namespace packages
# under jax_plugins; TPUs come through libtpu).
ACCELERATOR_MODULES = ("jax_plugins", "libtpu")


class AllocatorChoiceError(UserError, ValueError):
    """``CHANGECAP_HOST_ALLOCATOR`` names no route, or one that is not installed."""


def cpu_only(environ: Mapping[str, str] | None = None) -> bool:
    """Whether JAX will compute on the CPU alone (module docstring)."""
    environ = os.environ if environ is None else environ
    platforms = [p.strip().lower() for p in environ.get("JAX_PLATFORMS", "").split(",")
                 if p.strip()]
    if platforms:
        return platforms == ["cpu"]
    for name in ACCELERATOR_MODULES:
        if importlib.util.find_spec(name) is not None:
            return False
    try:
        return not any(d.metadata["Name"].lower().startswith(("jax-cuda", "jax-rocm"))
                       for d in importlib.metadata.distributions())
    except Exception:  # a broken distribution's metadata: assume an accelerator may be there
        return False


def _glibc() -> bool:
    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def tcmalloc_path() -> str | None:
    """The installed tcmalloc shared library, or None."""
    for directory in TCMALLOC_DIRS:
        for name in TCMALLOC_NAMES:
            if (Path(directory) / name).exists():
                return str(Path(directory) / name)
    found = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    return found if found and Path(found).is_absolute() else None


def chosen_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables a command should run under (empty: leave the allocator as it is)."""
    environ = os.environ if environ is None else environ
    choice = environ.get(CHOICE_VARIABLE, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise AllocatorChoiceError(f"{CHOICE_VARIABLE}={choice!r}: one of {CHOICES}")
    if choice == "default" or not _glibc() or not cpu_only(environ):
        return {}
    if choice in ("auto", "tcmalloc"):
        path = tcmalloc_path()
        if path is not None:
            preload = " ".join(filter(None, [path, environ.get("LD_PRELOAD", "")]))
            return {"LD_PRELOAD": preload, APPLIED_VARIABLE: "tcmalloc"}
        if choice == "tcmalloc":
            raise AllocatorChoiceError(
                f"{CHOICE_VARIABLE}=tcmalloc but tcmalloc is not installed (Debian/Ubuntu: "
                "apt-get install libtcmalloc-minimal4)")
    tunables = ":".join(filter(None, [environ.get("GLIBC_TUNABLES", ""), GLIBC_SETTINGS]))
    return {"GLIBC_TUNABLES": tunables, APPLIED_VARIABLE: "glibc"}


def applied() -> str:
    """The allocator setting this process runs under: "tcmalloc", "glibc" or "default"."""
    return os.environ.get(APPLIED_VARIABLE, "default")


def restart_with_chosen_allocator(argv: Sequence[str] | None = None) -> None:
    """Replaces this process by the same command under the chosen allocator setting
    (``os.execve``), unless it already runs under it or there is none to set. ``argv``: the
    interpreter's own command line (default ``sys.orig_argv``)."""
    if APPLIED_VARIABLE in os.environ:
        return
    env = chosen_environment()
    if not env:
        return
    argv = list(sys.orig_argv if argv is None else argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv[1:]], {**os.environ, **env})


def release() -> None:
    """Gives the free memory of glibc's heap back to the system (``malloc_trim``) when this
    process keeps it (the ``glibc`` route); the training loop calls it after each evaluation,
    so that what fragmentation keeps does not add up over a run."""
    if applied() != "glibc":
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError) as e:  # not glibc after all
        logging.debug("host allocator: malloc_trim unavailable (%s)", e)
