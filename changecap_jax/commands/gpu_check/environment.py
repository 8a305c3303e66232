"""The check's first child: what the host has (jax, devices, memory, PyTorch and CUDA)."""

from __future__ import annotations

import importlib.metadata
import platform
from typing import Any


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_info() -> dict[str, Any]:
    try:
        import torch
    except Exception as e:  # absent or broken: the features part is skipped
        return {"torch": None, "torch_error": f"{type(e).__name__}: {e}"}
    cuda = torch.cuda.is_available()
    return {"torch": torch.__version__, "torch_cuda": cuda,
            "torch_device": torch.cuda.get_device_name(0) if cuda else None}


def run_job(spec: dict[str, Any]) -> dict[str, Any]:
    import jax

    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    return {"python": platform.python_version(), "jax": jax.__version__,
            "jaxlib": _version("jaxlib"), "flax": _version("flax"), "optax": _version("optax"),
            "backend": jax.default_backend(), "device_count": jax.device_count(),
            "device_kind": device.device_kind, "platform": device.platform,
            "memory_limit_bytes": stats.get("bytes_limit"), **torch_info()}
