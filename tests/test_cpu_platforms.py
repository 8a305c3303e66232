"""The CPU platform a command defaults to on a machine without accelerators
(changecap_jax/cpu/platforms.py): quiet with the accelerator plugins of requirements-aot.txt
installed, never chosen over the user's JAX_PLATFORMS or a present GPU or TPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from changecap_jax.cpu import platforms

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_accelerator(monkeypatch):
    monkeypatch.setattr(platforms.glob, "glob", lambda pattern: [])


def test_defaults_to_cpu_without_an_accelerator(no_accelerator):
    environ: dict[str, str] = {}
    assert platforms.default_to_cpu(environ)
    assert environ == {"JAX_PLATFORMS": "cpu"}


@pytest.mark.parametrize("value", ["", "tpu", "cuda", "cpu"])
def test_the_users_setting_is_kept(no_accelerator, value):
    environ = {"JAX_PLATFORMS": value}  # the empty string too: "let JAX choose"
    assert not platforms.default_to_cpu(environ)
    assert environ == {"JAX_PLATFORMS": value}


@pytest.mark.parametrize("device", ["/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd",
                                    "/dev/accel0", "/dev/vfio/0"])
def test_an_accelerator_device_keeps_jax_choosing(monkeypatch, device):
    import fnmatch

    monkeypatch.setattr(platforms.glob, "glob",
                        lambda pattern: [device] if fnmatch.fnmatch(device, pattern) else [])
    environ: dict[str, str] = {}
    assert not platforms.default_to_cpu(environ)
    assert environ == {}


def test_a_google_pci_device_keeps_jax_choosing(monkeypatch, tmp_path):
    vendor = tmp_path / "0000:00:04.0" / "vendor"
    vendor.parent.mkdir()
    vendor.write_text("0x1ae0\n")
    monkeypatch.setattr(platforms, "DEVICE_PATTERNS", ())
    monkeypatch.setattr(platforms, "PCI_VENDOR_FILES", str(tmp_path / "*" / "vendor"))
    assert platforms.accelerator_present()
    vendor.write_text("0x8086\n")
    assert not platforms.accelerator_present()


def test_a_cpu_command_is_quiet_without_jax_platforms(tmp_path):
    """With libtpu and the CUDA plugin installed (CI installs them), a CPU command that fails
    on its config prints its own lines only, not the plugins' start-up tracebacks."""
    if platforms.accelerator_present():
        pytest.skip("this machine has an accelerator: JAX chooses it")
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "PJRT_NAMES_AND_LIBRARY_PATHS")}
    env.update(CHANGECAP_COMPILATION_CACHE="0", PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-m", "changecap_jax.main", "--config=configs/dirl.py",
         "--config.batch_size=0", f"--workdir={tmp_path}/w",
         f"--config.dataset.data_dir={tmp_path}/data"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr[-3000:]
    # main's "workdir ..." log line, then the error: nothing from the plugins.
    assert len(lines) <= 2 and lines[-1].startswith("error: config.batch_size is 0"), lines
    for noise in ("Traceback", "cuda", "libtpu", "TPU"):
        assert noise not in done.stderr, done.stderr[-3000:]
