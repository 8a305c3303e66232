"""Tiny raw datasets in the official layouts, written at test time, and build helpers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from changecap_jax.data import datasets

FEATURE_CHW = {3: (1024, 14, 14), 4: (2048, 7, 7)}


def write_image(path: Path, seed: int, size: tuple[int, int] = (48, 32)) -> Path:
    """A seeded noise image (W, H = size); the format follows the file's extension (a .gif is
    written as a two-frame palette GIF, as real animated GIFs are)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    suffix = path.suffix.lower()
    if suffix == ".gif":
        second = Image.fromarray(255 - pixels).convert("P")
        image.convert("P").save(path, save_all=True, append_images=[second])
    elif suffix in (".jpg", ".jpeg"):
        image.save(path, format="JPEG", quality=95)
    else:
        image.save(path, format="PNG")
    return path


def write_feature(features_dir: Path, rel: str, seed: int, layer: int = 3) -> np.ndarray:
    """An official-style ``<image name>.npy`` (C, H, W) float32 under ``features_dir/rel``'s
    folder; returns the array."""
    rng = np.random.default_rng(seed)
    array = rng.standard_normal(FEATURE_CHW[layer]).astype(np.float32)
    path = features_dir / (rel + ".npy")
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, array)
    return array


def write_json(path: Path, content: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content))


def build(name: str, raw_dir: Path, data_dir: Path, *, features_dir: Path | None = None,
          weights: Path | None = None, layer: int = 3, **config: Any
          ) -> datasets.PreparedDataset:
    """Builds a real dataset the way ``python -m data_prep.build`` does and opens it."""
    from data_prep import builders
    from data_prep.builders.base import make_config

    cls = builders.builder_class(name)
    cfg = make_config(layer, **config)
    named = cfg.name if cfg.name in cls.builder_configs else cfg
    builder = cls(data_dir=str(data_dir), config=named, file_format="array_record",
                  raw_dir=raw_dir, features_dir=features_dir, weights=weights, progress=False)
    datasets.build(builder)
    return datasets.prepare(name, data_dir, cfg.name)


def records(prepared: datasets.PreparedDataset, split: str) -> dict[str, dict[str, Any]]:
    """image_id -> record, read back through the grain eval pipeline."""
    from changecap_jax.data import pipeline

    source = prepared.split(split)
    out = {}
    for batch in pipeline.eval_batches(source, global_batch_size=4):
        for j in range(len(batch["mask"])):
            if batch["mask"][j]:
                rec = {k: v[j] for k, v in batch.items()}
                image_id = rec["image_id"]
                out[image_id.decode() if isinstance(image_id, bytes) else str(image_id)] = rec
    return out


def texts(values: Any) -> list[str]:
    return [v.decode() if isinstance(v, bytes) else str(v) for v in values]


# ---------------------------------------------------------------------------------------------
# CLEVR-Change (datasets.md §1)

CLEVR_CHANGE_CAPTIONS = {
    0: (["the red cube changed to blue", "the red metal cube turned blue"], "color"),
    1: (["the small sphere became metal", "the sphere became shiny"], "material"),
    2: (["someone added a cylinder", "a gray cylinder has appeared"], "add"),
    3: (["the large cube is missing", "the brown cube has disappeared"], "drop"),
    4: (["the cylinder changed its location", "the cylinder moved"], "move"),
}
CLEVR_NO_CHANGE = ["no change was made", "there is no change", "the scene remains the same"]
CLEVR_SPLITS = {"train": [0, 1, 2], "val": [3], "test": [4]}


def clevr_change_raw(root: Path, *, with_features: bool = False) -> Path:
    """``data/`` of CLEVR-Change with ids 0-4 annotated and id 5 with images only (as the 197
    unannotated ids of the real data). Returns the parent (the tarball's extraction dir)."""
    data = root / "data"
    for i in range(6):
        for sub, prefix in (("images", "default"), ("sc_images", "semantic"),
                            ("nsc_images", "nonsemantic")):
            rel = f"{sub}/CLEVR_{prefix}_{i:06d}.png"
            write_image(data / rel, seed=100 * i + len(sub))
            if with_features:
                fsub = {"images": "features", "sc_images": "sc_features",
                        "nsc_images": "nsc_features"}[sub]
                write_feature(root / "features", f"{fsub}/CLEVR_{prefix}_{i:06d}.png",
                              seed=100 * i + len(sub))
    write_json(data / "change_captions.json", {
        f"CLEVR_default_{i:06d}.png": caps for i, (caps, _) in CLEVR_CHANGE_CAPTIONS.items()})
    write_json(data / "no_change_captions.json", {
        f"CLEVR_default_{i:06d}.png": CLEVR_NO_CHANGE[: 1 + i % 3]
        for i in CLEVR_CHANGE_CAPTIONS})
    write_json(data / "splits.json", CLEVR_SPLITS)
    types: dict[str, list[str]] = {t: [] for t in ("color", "material", "move", "drop", "add")}
    for i, (_, t) in CLEVR_CHANGE_CAPTIONS.items():
        types[t].append(f"{i:06d}.png")
    write_json(data / "type_mapping.json", types)
    return root
