"""ResNet-101 grid features of images, as the official extraction script computes them.

The command is ``python -m data_prep.extract_features`` (``--images=DIR --out=DIR
--weights=PATH``); ``predict`` calls :func:`extract_features` on new images. PyTorch is the
optional extra: import this module only where it is needed.

:func:`extract_directory` writes one ``<image file name>.npy`` per image (e.g.
``CLEVR_default_000123.png.npy``), float32, channels first: (1024, 14, 14) after layer3 (the
official ``--model_stage 3``, the default) or (2048, 7, 7) after layer4. Images are read as
RGB, resized to 224 x 224 with OpenCV's bicubic (``features/preprocess.py``), scaled by 1/255
and normalised with the official mean/std (std 0.224 for blue, the official typo; ``std_fix``
uses 0.225).

The weights are a local torchvision ResNet-101 state dict (nothing is downloaded). A directory
extraction is resumable: images whose ``.npy`` already exists with the right shape and dtype
are skipped, and each file is written to a temp file and renamed, so an interruption never
leaves a partial ``.npy``. CUDA is used when available.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from torch import nn

from changecap_jax import console
from changecap_jax.features.preprocess import preprocess_batch
from changecap_jax.features.resnet import OUTPUT_SHAPES, load_resnet101
from changecap_jax.io.jsonio import atomic_write

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".gif", ".bmp", ".tif", ".tiff", ".webp")


def _official_number(name: str) -> int | None:
    """The integer after the last "_" of the name before its first ".", as the official
    ``int(name.split('.')[0].split('_')[-1])``; None when there is none."""
    stem = name.split(".")[0]
    if "_" not in stem:
        return None
    tail = stem.rsplit("_", 1)[1]
    return int(tail) if tail.isdigit() else None


def sort_image_names(names: Iterable[str]) -> list[str]:
    """Official order: by the number after the last "_" when every name has one, else by name.

    The datasets index sorted listings by id, so numeric order (``..._9`` before ``..._10``)
    matters when ids are not zero-padded.
    """
    names = list(names)
    numbers = [_official_number(n) for n in names]
    if names and all(n is not None for n in numbers):
        return [n for _, n in sorted(zip(numbers, names, strict=True))]
    return sorted(names)


def list_images(images_dir: str | os.PathLike) -> list[Path]:
    """The image files (by extension, not hidden) directly in ``images_dir``, official order."""
    images_dir = Path(images_dir)
    if not images_dir.is_dir():
        raise FileNotFoundError(f"image directory {images_dir} does not exist")
    names = [p.name for p in images_dir.iterdir()
             if p.is_file() and not p.name.startswith(".")
             and p.suffix.lower() in IMAGE_EXTENSIONS]
    if not names:
        raise FileNotFoundError(
            f"no images ({', '.join(IMAGE_EXTENSIONS)}) in {images_dir}")
    return [images_dir / n for n in sort_image_names(names)]


def feature_path(out_dir: str | os.PathLike, image_path: str | os.PathLike) -> Path:
    """``out_dir/<image file name>.npy``, the official naming."""
    return Path(out_dir) / f"{Path(image_path).name}.npy"


def is_complete(path: str | os.PathLike, shape: Sequence[int]) -> bool:
    """Whether ``path`` is a readable float32 .npy of ``shape`` (a finished earlier output)."""
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception:  # absent, truncated, not a .npy: recompute
        return False
    return tuple(arr.shape) == tuple(shape) and arr.dtype == np.float32


def save_npy_atomic(path: str | os.PathLike, array: np.ndarray) -> None:
    """``np.save`` via a temp file in the same folder + ``os.replace``: never a partial file."""
    atomic_write(path, lambda fh: np.save(fh, array, allow_pickle=False), binary=True)


def pick_device(device: str | torch.device | None = None) -> torch.device:
    """``device`` if given, else CUDA when available, else CPU."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _model_device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def extract_features(
    image_paths: Sequence[str | os.PathLike],
    weights: str | os.PathLike | nn.Module,
    layer: int = 3,
    batch_size: int = 128,
    *,
    std_fix: bool = False,
    device: str | torch.device | None = None,
    resize_flavour: str = "opencv",
    use_cv2: bool | None = None,
) -> Iterator[tuple[Path, np.ndarray]]:
    """Yields ``(path, features)`` per image, in input order; features float32 (C, H, W).

    ``weights`` is a local torchvision-format state dict, or a model from
    ``features.resnet.load_resnet101`` (to reuse one across calls). The arguments are checked
    and the weights loaded when called (so a bad weights file fails at once); the images are
    processed while iterating. Batches as the official script (the normalisation is
    elementwise, so batching does not change values); the next batch is read and resized on a
    worker thread while the network runs. An unreadable image raises ``ImageReadError`` naming
    it, after the earlier batches were yielded.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if layer not in OUTPUT_SHAPES:
        raise ValueError(f"layer must be 3 or 4, got {layer}")
    paths = [Path(p) for p in image_paths]
    if not paths:
        return iter(())
    if isinstance(weights, nn.Module):
        model = weights
        model_layer = getattr(model, "layer", layer)
        if model_layer != layer:
            raise ValueError(f"the model given is cut after layer{model_layer}, not layer{layer}")
        if device is not None:
            model = model.to(pick_device(device))
    else:
        model = load_resnet101(weights, layer, device=pick_device(device))
    model.eval()

    def prepare(batch: list[Path]) -> np.ndarray:
        return preprocess_batch(batch, std_fix=std_fix, use_cv2=use_cv2, flavour=resize_flavour)

    return _run(model, paths, batch_size, prepare)


def _run(model: nn.Module, paths: list[Path], batch_size: int,
         prepare: Callable[[list[Path]], np.ndarray]) -> Iterator[tuple[Path, np.ndarray]]:
    run_device = _model_device(model)
    batches = [paths[i:i + batch_size] for i in range(0, len(paths), batch_size)]
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(prepare, batches[0])
        for i, batch in enumerate(batches):
            inputs = pending.result()
            if i + 1 < len(batches):
                pending = pool.submit(prepare, batches[i + 1])
            with torch.inference_mode():
                out = model(torch.from_numpy(inputs).to(run_device))
            feats = out.float().cpu().numpy()
            yield from zip(batch, feats, strict=True)


@dataclasses.dataclass
class ExtractionSummary:
    """What a directory extraction did."""

    total: int
    computed: int
    skipped: int
    out_dir: Path


def extract_directory(
    images_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    weights: str | os.PathLike | nn.Module,
    layer: int = 3,
    batch_size: int = 128,
    *,
    std_fix: bool = False,
    device: str | torch.device | None = None,
    resize_flavour: str = "opencv",
    use_cv2: bool | None = None,
    progress: bool = True,
) -> ExtractionSummary:
    """Features for every image of ``images_dir`` into ``out_dir``; resumable (see module doc).

    The weights are only loaded when some image still needs its features.
    """
    if layer not in OUTPUT_SHAPES:
        raise ValueError(f"layer must be 3 or 4, got {layer}")
    paths = list_images(images_dir)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shape = OUTPUT_SHAPES[layer]
    todo = [p for p in paths if not is_complete(feature_path(out_dir, p), shape)]
    summary = ExtractionSummary(len(paths), len(todo), len(paths) - len(todo), out_dir)
    if not todo:
        return summary
    with console.Progress(total=len(paths), initial=summary.skipped, unit="img",
                          disable=not progress, desc=f"layer{layer} features") as bar:
        for path, feat in extract_features(
                todo, weights, layer, batch_size, std_fix=std_fix, device=device,
                resize_flavour=resize_flavour, use_cv2=use_cv2):
            if feat.shape != shape:  # only if the input size were changed
                raise RuntimeError(f"{path}: features of shape {feat.shape}, expected {shape}")
            save_npy_atomic(feature_path(out_dir, path), feat)
            bar.update(1)
    return summary
