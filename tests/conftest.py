"""Shared test setup.

Every test process sees 8 simulated CPU devices, so multi-device behaviour is tested the same
way everywhere; single-device code still runs on the default device.
"""

from __future__ import annotations

import os
from pathlib import Path

# Test programs are tiny: LLVM's optimisation passes cost more compile time than they save in
# run time (test_train.py: 485 s of its 753 s were backend compiles), so the tests compile at
# -O0. The flags reach every subprocess a test starts with this environment.
os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
    "--xla_llvm_disable_expensive_passes=true")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Commands started by the tests keep the allocator they start with (changecap_jax/cpu/
# allocator.py restarts a command under tcmalloc or glibc's tunables): tests/test_allocator.py
# and the benchmark command's test set it back to auto.
os.environ.setdefault("CHANGECAP_HOST_ALLOCATOR", "default")

# The compile-time CPU tunings every command runs with (changecap_jax/cpu/: cli.run turns them
# on), so that the tests compile what the commands compile.
from changecap_jax import cpu  # noqa: E402

cpu.enable()

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    """A private persistent compilation cache for this test process (each xdist worker has its
    own): many tests build the same small programs (a Trainer's step and decoding for the tiny
    DIRL config, say), and a repeated compile becomes a load from disk. Set through jax.config,
    not the environment, so that the subprocesses tests start keep their own behaviour; the
    folder is removed when the process exits."""
    import jax

    folder = tempfile.mkdtemp(prefix="changecap_test_xla_cache_")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"

# A tiny synthetic dataset shared by the data tests: built once per test session.
SMALL = {"num_train": 40, "num_val": 12, "num_test": 10, "feature_shape": (4, 4, 16)}


def shared_file(*parts: str) -> Path:
    """A file of ../shared/data; skips the test with a clear message when it is absent."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"real annotation file {path} is absent (expected ../shared/data beside "
                    "the checkout)")
    return path


@pytest.fixture(scope="session")
def small_synthetic(tmp_path_factory):
    from changecap_jax.data import datasets

    root = tmp_path_factory.mktemp("data")
    return datasets.prepare("synthetic", root, "moderate", SMALL)


@pytest.fixture(scope="session")
def random_weights(tmp_path_factory) -> Path:
    """A random ResNet-101 state dict in torchvision's format, BN statistics calibrated on
    random inputs so that the features depend on the image (as trained weights do)."""
    torch = pytest.importorskip(
        "torch", reason="PyTorch is not installed (optional: pip install -r "
        "requirements-torch.txt)")
    from changecap_jax.features import resnet

    torch.manual_seed(0)
    model = resnet.ResNet()
    bns = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.BatchNorm2d)]
    with torch.no_grad():
        for name, m in bns:
            m.weight.uniform_(0.5, 1.5)
            m.bias.normal_(0.0, 0.1)
            if name.endswith("bn3"):
                m.weight.mul_(0.3)  # tame the growth along 33 residual blocks
            m.momentum = None  # running stats := this batch's statistics
        model.train()
        model(torch.randn(2, 3, 48, 48))
    for _, m in bns:
        m.momentum = 0.1
    path = tmp_path_factory.mktemp("weights") / "resnet101_random.pth"
    torch.save(model.state_dict(), path)
    return path
