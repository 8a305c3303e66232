"""JAX's persistent compilation cache, on for every command line of the package.

Each entry point (``main``, ``predict``, ``export``, ``benchmark``, ...) calls :func:`enable`
before it compiles anything, so a second run of the same command loads its XLA executables
from disk instead of compiling them again.

Where the cache lives (the first that applies):

* ``$CHANGECAP_CACHE_DIR``;
* a folder the user already gave JAX itself (``JAX_COMPILATION_CACHE_DIR``);
* ``$XDG_CACHE_HOME/changecap_jax/xla``, else ``~/.cache/changecap_jax/xla``.

A bucket folder (``gs://...``) works too: JAX reads and writes its entries through etils'
paths (gcsfs), so the hosts of a slice can share one cache.

``CHANGECAP_COMPILATION_CACHE=0`` (or ``false``/``off``/``no``) turns it off. Delete the
folder to clear it; JAX keys every entry by the program, the jax/jaxlib versions, the
backend and the compile options, so a stale entry is never used for a different program.
The cache is trusted code: do not point it at a folder that others can write to.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path

from etils import epath

ENV_DIR = "CHANGECAP_CACHE_DIR"
ENV_SWITCH = "CHANGECAP_COMPILATION_CACHE"
OFF_VALUES = ("0", "false", "off", "no")
# Compiles shorter than this are not written. 0: every one is. Measured on 2 busy CPU cores
# (the DIRL CPU preset's benchmark): a run writes about 11 entries (1.2 MB) either way, but
# with JAX's default of 1 s whether the ~1 s greedy-decode compile was kept depended on the
# machine's load (2 or 3 entries), and a kept one saved 0.5 s at every start.
MIN_COMPILE_SECONDS = 0.0
# The events JAX records (jax.monitoring) when a compile looks in the persistent cache, and when
# it finds its executable there. (JAX's "cache_misses" event means "written", not "not found".)
LOOKUP_EVENT = "/jax/compilation_cache/compile_requests_use_cache"
HIT_EVENT = "/jax/compilation_cache/cache_hits"


def is_disabled() -> bool:
    """Whether ``CHANGECAP_COMPILATION_CACHE`` turns the cache off."""
    return os.environ.get(ENV_SWITCH, "").strip().lower() in OFF_VALUES


def _is_url(path: str | os.PathLike) -> bool:
    # io/paths.is_remote's test; this module sits beside io/ and may not import it.
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", os.fspath(path)))


def _as_path(path: str | os.PathLike) -> Path | epath.Path:
    """A bucket folder as an epath (pathlib would squash its ``//``), else a local Path."""
    return epath.Path(os.fspath(path)) if _is_url(path) else Path(path)


def default_dir() -> Path | epath.Path:
    """``$CHANGECAP_CACHE_DIR``, else ``$XDG_CACHE_HOME/changecap_jax/xla``, else
    ``~/.cache/changecap_jax/xla``."""
    if os.environ.get(ENV_DIR):
        folder = _as_path(os.environ[ENV_DIR])
        return folder if _is_url(folder) else folder.expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "changecap_jax" / "xla"


def enable(path: str | os.PathLike | None = None) -> Path | epath.Path | None:
    """Turns the persistent compilation cache on; returns its folder (None when switched off).

    ``path`` None: :func:`default_dir`, unless JAX was already given a folder by its own
    setting and ``$CHANGECAP_CACHE_DIR`` is unset (the user's explicit JAX choice wins). Call
    it before the first compile: JAX opens the cache once, at its first cached compile.
    """
    import jax

    if is_disabled():
        return None
    jax_dir = jax.config.jax_compilation_cache_dir
    if path is None and jax_dir and not os.environ.get(ENV_DIR):
        folder = _as_path(jax_dir)
    else:
        folder = _as_path(path) if path is not None else default_dir()
    try:
        if not _is_url(folder):  # a bucket has no folders to make
            folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # e.g. a read-only home: run uncached rather than not at all
        logging.warning("compilation cache off: cannot create %s (%s)", folder, e)
        return None
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return folder


@dataclasses.dataclass
class Lookups:
    """Persistent-cache lookups of the compiles inside a :func:`count_lookups` block."""

    enabled: bool  # whether JAX had a cache folder when the block began
    lookups: int = 0
    hits: int = 0

    @property
    def loaded(self) -> bool | None:
        """True: every lookup found its executable on disk; False: at least one program was
        compiled; None: the cache is off, or nothing was compiled."""
        if not (self.enabled and self.lookups):
            return None
        return self.hits == self.lookups


@contextlib.contextmanager
def count_lookups() -> Iterator[Lookups]:
    """Counts the persistent-cache lookups and hits of the compiles run inside the block.

    Whether a program was compiled in this process matters for CPU timings: a process that
    compiled its train step runs it a few percent slower than one that loaded it from the
    cache (docs/performance.md, "Compiled here or loaded")."""
    import jax.monitoring  # binds jax too

    # Without a folder JAX still makes its lookup (it finds nothing): not a compile to count.
    counts = Lookups(enabled=bool(jax.config.jax_compilation_cache_dir))

    def listener(event: str, **_: object) -> None:
        if event == LOOKUP_EVENT:
            counts.lookups += 1
        elif event == HIT_EVENT:
            counts.hits += 1

    jax.monitoring.register_event_listener(listener)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_listener(listener)
