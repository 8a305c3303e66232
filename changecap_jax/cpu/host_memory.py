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

With one heap for every thread, a compile leaves its freed objects in that heap: tens of
thousands of free chunks between live ones, which every later allocation of more than 1 KiB
searches (glibc keeps them in bins sorted by size). A step compiled in the process then ran
~4 % slower than the same step loaded from the persistent compilation cache (docs/performance.md,
"Compiled here or loaded"). After every compile of a second or more,
:func:`set_aside_free_chunks` allocates each of those chunks once and never frees it, and gives
their pages back to the system: the bins are empty again, the blocks cost addresses, not memory.

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
import mmap
import os
import platform
import re
import sys
import threading
from typing import Any

ENV_SWITCH = "CHANGECAP_KEEP_HOST_MEMORY"
OFF_VALUES = ("0", "false", "off", "no")

# mallopt parameters, from glibc's malloc.h.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8

# glibc's bins of free chunks from this size up are sorted by size and searched (64-bit); the
# smaller ones are served in constant time.
LARGE_BIN_MIN_BYTES = 1024
# Free chunks up to this size are set aside after a compile: the gaps a compile leaves, and the
# sizes the step's own small allocations search. A larger free chunk (a step's freed temporary
# buffer) is left for the next step to reuse.
SET_ASIDE_MAX_BYTES = 4 << 20
# Compiles shorter than this leave too few gaps to be worth a pass over the heap.
SET_ASIDE_AFTER_COMPILE_S = 1.0
# JAX's event for a program's compile (or its load from the persistent cache), with its duration.
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# Passes over the bins: a chunk larger than the block asked of it is split, and its rest, free
# again in a smaller bin, is taken by the next pass.
SET_ASIDE_ROUNDS = 8
MADV_DONTNEED = 4

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
_set_aside_lock = threading.Lock()
_listening = False


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "mallopt"):
        return None
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.open_memstream.restype = ctypes.c_void_p
    libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_char_p),
                                    ctypes.POINTER(ctypes.c_size_t)]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.sbrk.restype = ctypes.c_void_p
    libc.sbrk.argtypes = [ctypes.c_ssize_t]
    return libc


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
        _listen_to_compiles()
    return done


def _listen_to_compiles() -> None:
    global _listening
    if _listening:
        return
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_after_compile)
    _listening = True


def _after_compile(event: str, duration: float, **_: Any) -> None:
    """Runs in the compiling thread, after the compile and before the program first runs; a
    failure here must not fail the compile (the pass only saves time)."""
    if event == COMPILE_EVENT and duration >= SET_ASIDE_AFTER_COMPILE_S:
        try:
            set_aside_free_chunks()
        except Exception as error:  # e.g. a malloc_info this parser does not read
            logging.warning("host memory: free chunks not set aside after a compile (%s)",
                            error)


def large_free_chunks() -> list[tuple[int, int, int]]:
    """(smallest, largest chunk size, count) of each non-empty sorted bin of free chunks in
    the heap, from glibc's ``malloc_info``; empty unless :func:`keep_freed_memory` is in effect
    (its one heap is the only one read)."""
    if _libc is None:
        return []
    buffer, size = ctypes.c_char_p(), ctypes.c_size_t()
    stream = _libc.open_memstream(ctypes.byref(buffer), ctypes.byref(size))
    if not stream:
        return []
    _libc.malloc_info(0, stream)
    _libc.fclose(stream)
    text = ctypes.string_at(buffer, size.value).decode()
    _libc.free(buffer)
    heap = text.split("</heap>")[0]  # bins of the first (here the only) heap
    bins = re.findall(r'<size from="(\d+)" to="(\d+)" total="\d+" count="(\d+)"/>', heap)
    flags = ~7  # the low bits of a chunk's size field are flags, printed with it
    return [(int(low) & flags, int(high) & flags, int(count)) for low, high, count in bins
            if int(low) & flags >= LARGE_BIN_MIN_BYTES]


def set_aside_free_chunks() -> int:
    """Takes the heap's free chunks of ``LARGE_BIN_MIN_BYTES`` to ``SET_ASIDE_MAX_BYTES`` out
    of use for good (module docstring): allocates each once, keeps the block and gives its
    pages back to the system. Returns the number of blocks set aside; 0 unless
    :func:`keep_freed_memory` is in effect."""
    if _libc is None:
        return 0
    taken = taken_bytes = 0
    with _set_aside_lock:
        for _ in range(SET_ASIDE_ROUNDS):
            wanted = [(low, count) for low, high, count in large_free_chunks()
                      if high <= SET_ASIDE_MAX_BYTES]
            if not wanted:
                break
            # The blocks are never freed, so their addresses are not kept.
            for chunk_size, count in wanted:  # the smallest first
                request = chunk_size - ctypes.sizeof(ctypes.c_size_t)  # the chunk's header
                for _ in range(count):
                    block = _libc.malloc(request)
                    if not block:
                        return taken
                    if _cut_from_large_chunk(block):
                        # The bin has run out (the counts are read before the pass, and the
                        # reading itself frees memory): give it back, whole again
                        _libc.free(block)
                        break
                    _give_pages_back(block, request)
                    taken += 1
                    taken_bytes += chunk_size
    if taken:
        logging.info("host memory: set aside %d free blocks (%.0f MB) a compile left in the "
                     "heap", taken, taken_bytes / 1e6)
    return taken


def _size_field(chunk: int) -> int:
    """The size word of the glibc chunk at ``chunk`` (its low bits are flags)."""
    return ctypes.c_size_t.from_address(chunk + ctypes.sizeof(ctypes.c_size_t)).value


def _cut_from_large_chunk(block: int) -> bool:
    """Whether ``malloc`` cut ``block`` from the front of a free chunk larger than
    ``SET_ASIDE_MAX_BYTES`` (the rest of it follows the block, free) or from the heap's top.
    Adjacent free chunks are always merged, so a free chunk right after the block is the
    rest of the one it was cut from. (Freeing the block merges the two again.)"""
    chunk = block - 2 * ctypes.sizeof(ctypes.c_size_t)
    size = _size_field(chunk) & ~7
    following = chunk + size
    rest = _size_field(following) & ~7
    if following + rest >= _libc.sbrk(0):  # the top chunk: nothing follows it
        return True
    following_is_free = not _size_field(following + rest) & 1  # its successor's "in use" bit
    return following_is_free and size + rest > SET_ASIDE_MAX_BYTES


def _give_pages_back(block: int, size: int) -> None:
    """The whole pages inside the block: the system takes them back, and would give zeroed
    ones if they were touched again (they are not)."""
    page = mmap.PAGESIZE
    start, end = -(-block // page) * page, (block + size) // page * page
    if end > start:
        _libc.madvise(start, end - start, MADV_DONTNEED)


def release() -> None:
    """Gives the heap's free memory back to the system when :func:`keep_freed_memory` is in
    effect (the next step faults its buffer in once more); does nothing otherwise."""
    if _libc is not None:
        _libc.malloc_trim(0)
