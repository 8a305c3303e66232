"""The persistent compilation cache every command line turns on (changecap_jax/compile_cache.py).

Each case runs in a fresh interpreter: JAX opens its cache once per process, and this test
process already has its own private cache (tests/conftest.py), which is not the one under test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from changecap_jax import compile_cache

REPO = Path(__file__).resolve().parents[1]
# Enables the cache, compiles one small function and prints the folder enable() returned.
# The threshold is lowered so that this short compile is written: what is tested is the
# switch and the folder, not the time threshold.
SCRIPT = """
import jax, jax.numpy as jnp
from changecap_jax import compile_cache
compile_cache.MIN_COMPILE_SECONDS = 0.0
print(compile_cache.enable())
jax.block_until_ready(jax.jit(lambda x: jnp.tanh(x @ x.T).sum())(jnp.ones((32, 32))))
"""


def _run(env_updates: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CHANGECAP_", "JAX_COMPILATION_CACHE"))}
    env.update(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", **env_updates)
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def _entries(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []


def test_enabled_cache_gains_entries(tmp_path):
    folder = tmp_path / "xla"
    printed = _run({compile_cache.ENV_DIR: str(folder)})
    assert Path(printed) == folder
    assert _entries(folder), "the compile was not written to the cache"


def test_off_switch_writes_nothing(tmp_path):
    folder = tmp_path / "xla"
    printed = _run({compile_cache.ENV_DIR: str(folder), compile_cache.ENV_SWITCH: "0"})
    assert printed == "None"
    assert not _entries(folder)


def test_jax_own_setting_is_kept_without_ours(tmp_path):
    folder = tmp_path / "jax_dir"
    printed = _run({"JAX_COMPILATION_CACHE_DIR": str(folder)})
    assert Path(printed) == folder
    assert _entries(folder)


def test_default_dir_honours_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(compile_cache.ENV_DIR, str(tmp_path / "mine"))
    assert compile_cache.default_dir() == tmp_path / "mine"
    monkeypatch.delenv(compile_cache.ENV_DIR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.default_dir() == tmp_path / "xdg" / "changecap_jax" / "xla"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.default_dir() == tmp_path / "home" / ".cache" / "changecap_jax" / "xla"


def test_switch_values(monkeypatch):
    for value, off in [("0", True), ("off", True), ("False", True), ("1", False), ("", False)]:
        monkeypatch.setenv(compile_cache.ENV_SWITCH, value)
        assert compile_cache.is_disabled() is off, value


def test_count_lookups_tells_a_compile_from_a_load():
    """In this process's private cache (tests/conftest.py): a new program is compiled and
    written, the same program lowered again is loaded; a block without compiles saw nothing."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((3, 5))

    def lower() -> jax.stages.Lowered:
        # A constant no other test uses, so the program is new to the cache.
        return jax.jit(lambda x: jnp.sin(x) * 1.2345678).lower(x)

    with compile_cache.count_lookups() as first:
        lower().compile()
    jax.clear_caches()  # else the second compile is served from memory, without a lookup
    with compile_cache.count_lookups() as second:
        lower().compile()
    jax.clear_caches()
    with compile_cache.count_lookups() as both:  # one program loaded, one compiled
        lower().compile()
        jax.jit(lambda x: jnp.cos(x) * 1.2345678).lower(x).compile()
    with compile_cache.count_lookups() as nothing:
        pass
    assert (first.lookups, first.hits, first.loaded) == (1, 0, False)
    assert (second.lookups, second.hits, second.loaded) == (1, 1, True)
    assert (both.lookups, both.hits, both.loaded) == (2, 1, False)
    assert nothing.loaded is None
