"""The host allocator a command starts under (changecap_jax/cpu/allocator.py): tcmalloc when
installed, else glibc's tunables, applied by restarting the command once; nothing on an
accelerator, off glibc, or when switched off."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from changecap_jax.cpu import allocator

REPO = Path(__file__).resolve().parents[1]
GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
needs_glibc = pytest.mark.skipif(not GLIBC, reason="the routes are for Linux with glibc")


@needs_glibc
def test_auto_prefers_tcmalloc_and_falls_back_to_glibc_tunables(monkeypatch):
    env = {"JAX_PLATFORMS": "cpu", "LD_PRELOAD": "/x/other.so"}
    monkeypatch.setattr(allocator, "tcmalloc_path", lambda: "/lib/libtcmalloc_minimal.so.4")
    chosen = allocator.chosen_environment(env)
    assert chosen == {"LD_PRELOAD": "/lib/libtcmalloc_minimal.so.4 /x/other.so",
                      allocator.APPLIED_VARIABLE: "tcmalloc"}
    monkeypatch.setattr(allocator, "tcmalloc_path", lambda: None)
    chosen = allocator.chosen_environment({**env, "GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"})
    assert chosen[allocator.APPLIED_VARIABLE] == "glibc"
    assert chosen["GLIBC_TUNABLES"] == ("glibc.malloc.tcache_count=0:"
                                        + allocator.GLIBC_SETTINGS)
    with pytest.raises(allocator.AllocatorChoiceError, match="libtcmalloc-minimal4"):
        allocator.chosen_environment({**env, allocator.CHOICE_VARIABLE: "tcmalloc"})


@pytest.mark.parametrize("environ", [
    {"JAX_PLATFORMS": "cuda"}, {"JAX_PLATFORMS": "tpu"}, {"JAX_PLATFORMS": "cpu,cuda"},
    {"JAX_PLATFORMS": "cpu", allocator.CHOICE_VARIABLE: "default"},
])
def test_nothing_is_set_on_an_accelerator_or_when_switched_off(environ):
    assert allocator.chosen_environment(environ) == {}


def test_an_unknown_choice_is_an_error():
    with pytest.raises(allocator.AllocatorChoiceError, match="one of"):
        allocator.chosen_environment({allocator.CHOICE_VARIABLE: "mimalloc"})


def test_an_installed_accelerator_plugin_counts_without_jax_platforms(monkeypatch):
    found = {"libtpu": object()}
    monkeypatch.setattr(allocator.importlib.util, "find_spec", lambda name: found.get(name))
    assert not allocator.cpu_only({})


# A command restarted under each route: what it runs under, and whether a freed 256 MB block
# stays mapped (glibc's tunables: no mmap, no trim) or is given back (glibc's defaults).
PROGRAM = textwrap.dedent("""
    import ctypes, json, os, sys
    from changecap_jax import cli

    def resident_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    def main(argv):
        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        libc.free.argtypes = [ctypes.c_void_p]
        before = resident_mb()
        block = libc.malloc(256 << 20)
        ctypes.memset(block, 1, 256 << 20)
        libc.free(block)
        maps = open("/proc/self/maps").read()
        print(json.dumps({"applied": os.environ.get("CHANGECAP_HOST_ALLOCATOR_APPLIED"),
                          "pid": os.getpid(), "kept_mb": resident_mb() - before,
                          "tcmalloc_mapped": "tcmalloc" in maps}))

    cli.run(main)
""")


def _run_program(choice: str, tmp_path: Path) -> dict:
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu",
           allocator.CHOICE_VARIABLE: choice}
    env.pop(allocator.APPLIED_VARIABLE, None)
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_glibc
def test_a_command_restarts_under_glibc_tunables_and_keeps_freed_memory(tmp_path):
    kept = _run_program("glibc", tmp_path)
    assert kept["applied"] == "glibc" and not kept["tcmalloc_mapped"]
    assert kept["kept_mb"] > 200  # freed, still mapped: the next step reuses it
    default = _run_program("default", tmp_path)
    assert default["applied"] is None
    assert default["kept_mb"] < 50  # glibc's defaults: mmap'd, unmapped at free


@needs_glibc
def test_a_command_restarts_under_tcmalloc_when_installed(tmp_path):
    if allocator.tcmalloc_path() is None:
        pytest.skip("tcmalloc is not installed (apt-get install libtcmalloc-minimal4)")
    run = _run_program("auto", tmp_path)
    assert run["applied"] == "tcmalloc" and run["tcmalloc_mapped"]


def test_the_entry_points_restart_before_importing_jax():
    """The restart replaces the process: whatever it imported first is imported again, so the
    entry points leave JAX and orbax to after it (a second or so per command otherwise)."""
    probe = ("import sys, changecap_jax.main, changecap_jax.__main__; "
             "print(sorted(m for m in ('jax', 'orbax.checkpoint') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"
