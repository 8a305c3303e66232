"""The JAX platform of a command on a machine without a GPU or TPU: ``cpu``, chosen before JAX
starts, so that installed accelerator plugins stay quiet.

With JAX's CUDA plugin or libtpu installed (requirements-aot.txt, for the ``aot`` command) and
``JAX_PLATFORMS`` unset, JAX tries every installed backend at its first use: the CUDA plugin
logs a ~20-line traceback ("Unable to load cuDNN") and libtpu a few lines about TPU workers it
cannot find, and then JAX runs on the CPU anyway. ``JAX_PLATFORMS=cpu`` is JAX's documented way
to skip the other backends (the plugin's own message says so), and :func:`default_to_cpu` sets
it for a command (``cli.run`` and ``python -m changecap_jax``, before anything else) when

* the user has not set ``JAX_PLATFORMS`` (set, even to the empty string, it is their choice:
  ``JAX_PLATFORMS= python -m ...`` lets JAX try every backend as before), and
* the machine shows no accelerator: no NVIDIA device node (``/dev/nvidia*``, WSL's
  ``/dev/dxg``), no AMD compute node (``/dev/kfd``), no TPU (``/dev/accel*``, ``/dev/vfio/``,
  or a PCI device of Google's vendor id), and no plugin named by
  ``PJRT_NAMES_AND_LIBRARY_PATHS``. These are the places JAX's own hardware checks look
  (``jax/_src/hardware_utils.py``); any one of them keeps JAX's choice, so a GPU or TPU host is
  never forced onto the CPU.

The variable is set in the environment, so the commands a command starts (a sweep's runs, the
allocator's restart) inherit it; when JAX was already imported its config is updated as well.
"""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import MutableMapping
from pathlib import Path

VARIABLE = "JAX_PLATFORMS"
# Device nodes of accelerators JAX could use (jax/_src/hardware_utils.py looks at these).
DEVICE_PATTERNS = ("/dev/nvidia[0-9]*", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd",
                   "/dev/accel*", "/dev/vfio/*")
GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips; a Google vendor id alone counts, to be safe
PCI_VENDOR_FILES = "/sys/bus/pci/devices/*/vendor"


def accelerator_present() -> bool:
    """Whether this machine shows a GPU or TPU JAX might use (module docstring)."""
    if any(glob.glob(pattern) for pattern in DEVICE_PATTERNS):
        return True
    for vendor in glob.glob(PCI_VENDOR_FILES):
        try:
            if Path(vendor).read_text().strip() == GOOGLE_PCI_VENDOR:
                return True
        except OSError:
            continue
    return False


def default_to_cpu(environ: MutableMapping[str, str] | None = None) -> bool:
    """Sets ``JAX_PLATFORMS=cpu`` unless the user set it or an accelerator may be present;
    returns whether it did. Call it before JAX's first use (its backends start once)."""
    environ = os.environ if environ is None else environ
    if VARIABLE in environ or environ.get("PJRT_NAMES_AND_LIBRARY_PATHS") or (
            accelerator_present()):
        return False
    environ[VARIABLE] = "cpu"
    if environ is os.environ and "jax" in sys.modules:
        # JAX read the variable when it was imported; its backends start at first use.
        import jax

        jax.config.update("jax_platforms", "cpu")
    return True
