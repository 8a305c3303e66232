"""host_memory.keep_freed_memory: a large block freed by a worker thread is reused by the next
allocation without page faults (as XLA's per-call temporary buffer is); off, every allocation
faults its pages in again. Each case runs in its own process: the setting is process-wide."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from changecap_jax.cpu import host_memory

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="mallopt is glibc's")

BLOCK_MB = 128

# Allocates, touches and frees a BLOCK_MB block in a new thread three times, counting the minor
# page faults of the last two (the first faults the block in either way), then once more after
# host_memory.release().
PROGRAM = f"""
import ctypes, json, resource, threading
from changecap_jax.cpu import host_memory

libc = ctypes.CDLL("libc.so.6")  # malloc itself, as XLA's CPU runtime (numpy would madvise)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

kept = host_memory.keep_freed_memory()
faults = []

def allocate():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc({BLOCK_MB} << 20)
    ctypes.memset(block, 1, {BLOCK_MB} << 20)  # touch every page
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    libc.free(block)

def work():
    for _ in range(3):
        allocate()
    host_memory.release()
    allocate()

thread = threading.Thread(target=work)
thread.start()
thread.join()
print(json.dumps({{"kept": kept, "faults": faults[1:3], "after_release": faults[3]}}))
"""


def run_program(program: str, *args: str, **env: str) -> dict:
    """Runs ``program`` in a new process on the CPU (the settings are process-wide) with the
    host-memory switch unset unless ``env`` sets it; returns its last line, parsed as JSON."""
    environ = {k: v for k, v in os.environ.items()
               if k not in (host_memory.ENV_SWITCH, "JAX_PLATFORMS")}
    done = subprocess.run([sys.executable, "-c", program, *args], capture_output=True,
                          text=True, env={**environ, "JAX_PLATFORMS": "cpu", **env},
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(**env: str) -> dict:
    return run_program(PROGRAM, **env)


def test_freed_block_is_reused_without_page_faults():
    pages = BLOCK_MB << 8  # 4 KiB pages
    on = run()
    off = run(**{host_memory.ENV_SWITCH: "0"})
    assert on["kept"] and not off["kept"]
    assert all(f > 0.9 * pages for f in off["faults"]), off
    assert all(f < 0.05 * pages for f in on["faults"]), on
    # release() gave the kept block back: the next one is faulted in again.
    assert on["after_release"] > 0.9 * pages, on


def test_left_alone_when_jax_may_use_an_accelerator():
    # Decided from the setting alone: no CUDA backend is started (none is installed here).
    out = run(JAX_PLATFORMS="cuda")
    assert not out["kept"]
    assert all(f > 0.9 * (BLOCK_MB << 8) for f in out["faults"]), out


# Leaves free chunks between live blocks (as a compile leaves its freed objects), and one free
# block larger than SET_ASIDE_MAX_BYTES; sets the chunks aside. Reports the sorted bins, and the
# resident memory, before and after.
SET_ASIDE_PROGRAM = """
import ctypes, json
from changecap_jax.cpu import host_memory

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

assert host_memory.keep_freed_memory()
blocks = []
for i in range(2000):
    size = 2048 + (i * 7919) % 126976  # 2 KiB to 128 KiB
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    blocks.append((block, size))
big = libc.malloc(16 << 20)
ctypes.memset(big, 1, 16 << 20)
guard = libc.malloc(4096)  # keeps the big block from merging into the heap's top when freed
freed = sum(size for block, size in blocks[::2])
for block, _ in blocks[::2]:
    libc.free(block)
libc.free(big)
size_word = lambda chunk: ctypes.c_size_t.from_address(chunk + 8).value
big_chunk = big - 16  # glibc's chunk header precedes the block
before = host_memory.large_free_chunks()
resident_before = resident()
taken = host_memory.set_aside_free_chunks()
# read before anything else allocates: later allocations may be cut from the big free chunk
big_size = size_word(big_chunk) & ~7
big_free = not size_word(big_chunk + big_size) & 1  # the next chunk's "previous in use" bit
after = host_memory.large_free_chunks()
resident_after = resident()
print(json.dumps({"before": before, "after": after, "taken": taken, "big": [big_size, big_free],
                  "freed": freed, "released": resident_before - resident_after}))
"""


def test_free_chunks_a_compile_leaves_are_set_aside_and_their_memory_released():
    out = run_program(SET_ASIDE_PROGRAM)
    small = lambda bins: sum(count for low, high, count in bins
                             if high <= host_memory.SET_ASIDE_MAX_BYTES)
    assert small(out["before"]) > 500, out["before"]
    assert out["taken"] >= small(out["before"])
    assert small(out["after"]) == 0, out["after"]
    # the free block larger than SET_ASIDE_MAX_BYTES is still free and whole, for the next
    # step's buffer
    assert out["big"] == [(16 << 20) + 16, True], out
    # the set-aside blocks' pages went back to the system
    assert out["released"] > 0.7 * out["freed"], out


# With the setting in effect, a compile of at least SET_ASIDE_AFTER_COMPILE_S (argv[1]) sets the
# free chunks aside; a shorter one does not. With argv[2] "fail" the pass raises.
COMPILE_PROGRAM = """
import json, sys
from changecap_jax.cpu import host_memory
import jax, jax.numpy as jnp

assert host_memory.keep_freed_memory()
host_memory.SET_ASIDE_AFTER_COMPILE_S = float(sys.argv[1])
fail = sys.argv[2] == "fail"
passes = []
original = host_memory.set_aside_free_chunks
host_memory.set_aside_free_chunks = lambda: passes.append(1) or (1 / 0 if fail else original())
jax.jit(lambda x: jnp.sin(x) * 2).lower(jnp.ones(3)).compile()
print(json.dumps({"passes": len(passes)}))
"""


@pytest.mark.parametrize("threshold, sets_aside", [(0.0, True), (1e9, False)])
def test_a_compile_sets_the_free_chunks_aside(threshold, sets_aside):
    out = run_program(COMPILE_PROGRAM, str(threshold), "pass")
    assert (out["passes"] > 0) == sets_aside, out


def test_a_failing_pass_does_not_fail_the_compile():
    out = run_program(COMPILE_PROGRAM, "0", "fail")
    assert out["passes"] > 0
