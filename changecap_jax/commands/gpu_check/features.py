"""ResNet-101 grid features of a few synthetic images with CUDA and on the CPU (child
process): the largest difference between the two, with PyTorch's TF32 on (its default for
convolutions) and off. Random weights (seeded): nothing can be downloaded on the host."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any

import numpy as np


def _images(n: int, folder: Path) -> list[Path]:
    from PIL import Image

    from changecap_jax.data.synthetic import examples

    paths = []
    for i in range(n):
        views, _ = examples.render_views(examples.sample_example(0, i),
                                         examples.DEFAULT_IMAGE_SIZE)
        paths.append(folder / f"image_{i}.png")
        Image.fromarray(views["before"]).save(paths[-1])
    return paths


def _extract(paths: list[Path], model: Any, device: str) -> np.ndarray:
    from changecap_jax.features.extract import extract_features

    return np.stack([f for _, f in extract_features(paths, model, layer=3,
                                                    batch_size=len(paths), device=device)])


def _difference(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    diff = float(np.max(np.abs(a - b)))
    return {"max_abs_diff": diff, "max_abs_value": float(np.max(np.abs(a))),
            "max_rel_diff": diff / max(float(np.max(np.abs(a))), 1e-30)}


def run_job(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from changecap_jax.features.resnet import TruncatedResNet, build_resnet101

    torch.manual_seed(0)
    model = TruncatedResNet(build_resnet101(), 3).eval()
    with tempfile.TemporaryDirectory() as tmp:
        paths = _images(spec["images"], Path(tmp))
        cpu = _extract(paths, model, "cpu")
        out: dict[str, Any] = {"images": len(paths), "shape": list(cpu.shape[1:]),
                               "torch": torch.__version__, "cuda": torch.cuda.is_available()}
        if not out["cuda"]:
            return out
        gpu_model = copy.deepcopy(model)
        out["tf32_on"] = _difference(cpu, _extract(paths, gpu_model, "cuda"))
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
        out["tf32_off"] = _difference(cpu, _extract(paths, gpu_model, "cuda"))
        out["device"] = torch.cuda.get_device_name(0)
    return out
