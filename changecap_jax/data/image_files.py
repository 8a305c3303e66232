"""Where a prepared dataset keeps the image files of a record, when it keeps them.

Apart from ``datasets`` so that the modules ``datasets`` itself imports (first-use preparation,
entity retrieval) can ask without importing it back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from changecap_jax.data.synthetic import builder as synthetic_builder


def image_paths(dataset: Any, record: dict[str, Any]) -> dict[str, Path] | None:
    """The image files of a record (before / after_semantic / after_distractor), where the
    dataset (a ``datasets.PreparedDataset``) keeps them: the synthetic dataset saves its
    renders under ``meta.raw_dir``; the real datasets' records do not name their files, so
    None."""
    if dataset.name != "synthetic" or not dataset.meta.raw_dir:
        return None
    raw_dir = dataset.directory / dataset.meta.raw_dir
    paths = {key: synthetic_builder.image_path(raw_dir, key, int(record["id"]))
             for key in synthetic_builder.IMAGE_DIRS}
    return paths if all(p.is_file() for p in paths.values()) else None
