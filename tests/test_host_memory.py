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

from changecap_jax import host_memory

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="mallopt is glibc's")

BLOCK_MB = 128

# Allocates, touches and frees a BLOCK_MB block in a new thread three times, counting the minor
# page faults of the last two (the first faults the block in either way), then once more after
# host_memory.release().
PROGRAM = f"""
import ctypes, json, resource, threading
from changecap_jax import host_memory

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


def run(**env: str) -> dict:
    environ = {k: v for k, v in os.environ.items()
               if k not in (host_memory.ENV_SWITCH, "JAX_PLATFORMS")}
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                          env={**environ, "JAX_PLATFORMS": "cpu", **env}, timeout=120,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


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
