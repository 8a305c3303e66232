"""The files of an evaluation: ``captions/<split>_<step>.json`` and ``metrics/<split>_<step>.json``
written atomically (:func:`write_results`), and the official COCO-style reference files
(:func:`coco_reference_file`, :func:`references_from_coco`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

from changecap_jax.evaluators.captions import PairCaption
from changecap_jax.io import paths
from changecap_jax.io.jsonio import write_json_atomic

logger = logging.getLogger(__name__)

_CAPTION_FIELDS = ("image_id", "caption", "references", "change_type")


def write_results(
    workdir: str | os.PathLike[str],
    split: str,
    step: int,
    records: list[PairCaption],
    metrics: dict[str, Any],
    extra: dict[str, dict[str, Any]] | None = None,
) -> tuple[paths.AnyPath, paths.AnyPath]:
    """Write the captions and metrics files of one evaluation.

    Paths: ``<workdir>/captions/<split>_<step>.json`` and ``<workdir>/metrics/<split>_<step>.json``.

    The captions file is in COCO result format (a list of ``{"image_id", "caption"}``) with
    ``"references"`` and ``"change_type"`` added to each entry, plus the fields of
    ``extra[image_id]`` when given. The metrics file holds ``metrics`` as is (full floats). Both are
    written atomically (temp file in the target directory, then ``os.replace``).

    Returns:
        (captions path, metrics path).

    Raises:
        ValueError: when ``extra`` names an id that is not in ``records`` or a reserved field.
    """
    extra = extra or {}
    ids = {r.image_id for r in records}
    unknown = [i for i in extra if i not in ids]
    if unknown:
        raise ValueError(f"extra has ids that are not in records: {unknown[:5]!r}")
    entries: list[dict[str, Any]] = []
    for rec in records:
        entry: dict[str, Any] = {
            "image_id": rec.image_id,
            "caption": rec.caption,
            "references": list(rec.references),
            "change_type": rec.change_type,
        }
        fields = extra.get(rec.image_id, {})
        clash = [k for k in fields if k in _CAPTION_FIELDS]
        if clash:
            raise ValueError(f"extra[{rec.image_id!r}] overrides reserved fields {clash!r}")
        entry.update(fields)
        entries.append(entry)
    root = paths.path(workdir)
    name = f"{split}_{step}.json"
    captions_path = root / "captions" / name
    metrics_path = root / "metrics" / name
    write_json_atomic(captions_path, entries)
    write_json_atomic(metrics_path, metrics)
    return captions_path, metrics_path


def coco_reference_file(records: Iterable[PairCaption]) -> dict[str, Any]:
    """The official COCO-caption GT dict (like ``total_change_captions_reformat.json``).

    ``"images"`` lists ``{"filename": id, "id": id}`` once per record and ``"annotations"``
    ``{"caption", "id": running int, "image_id"}`` per reference; ``"info"``, ``"licenses"`` and
    ``"type"`` are filled with the same placeholders as the official files so that older
    coco-caption loaders accept it.
    """
    info = {
        k: "dummy" for k in ("contributor", "date_created", "description", "url", "version", "year")
    }
    gt: dict[str, Any] = {
        "info": info,
        "licenses": info,
        "type": "captions",
        "images": [],
        "annotations": [],
    }
    count = 0
    for rec in records:
        gt["images"].append({"filename": rec.image_id, "id": rec.image_id})
        for caption in rec.references:
            gt["annotations"].append({"caption": caption, "id": count, "image_id": rec.image_id})
            count += 1
    return gt


def references_from_coco(gt: Mapping[str, Any]) -> dict[str, list[str]]:
    """Read references back from a COCO-caption GT dict: image id -> list of captions.

    Ids are returned as strings (``str(image_id)``). The order follows ``"images"`` when present
    (duplicates collapsed, as in Spot-the-Diff's official GT file), then annotation order; images
    without annotations are left out.

    Raises:
        ValueError: naming the missing key / entry when the input is malformed.
    """
    if not isinstance(gt, Mapping):
        raise ValueError(f"COCO GT must be a dict, got {type(gt).__name__}")
    if "annotations" not in gt:
        raise ValueError("COCO GT is missing the 'annotations' key")
    annotations = gt["annotations"]
    if not isinstance(annotations, list):
        raise ValueError("COCO GT 'annotations' must be a list")
    order: list[str] = []
    images = gt.get("images")
    if images is not None:
        if not isinstance(images, list):
            raise ValueError("COCO GT 'images' must be a list")
        for k, img in enumerate(images):
            if not isinstance(img, Mapping) or "id" not in img:
                raise ValueError(f"COCO GT 'images'[{k}] is missing the 'id' key")
            order.append(str(img["id"]))
    refs: dict[str, list[str]] = {}
    for k, ann in enumerate(annotations):
        if not isinstance(ann, Mapping):
            raise ValueError(f"COCO GT 'annotations'[{k}] is not a dict")
        for key in ("image_id", "caption"):
            if key not in ann:
                raise ValueError(f"COCO GT 'annotations'[{k}] is missing the {key!r} key")
        if not isinstance(ann["caption"], str):
            raise ValueError(f"COCO GT 'annotations'[{k}]['caption'] is not a string")
        refs.setdefault(str(ann["image_id"]), []).append(ann["caption"])
    ordered = {i: refs[i] for i in dict.fromkeys(order) if i in refs}
    ordered.update({i: c for i, c in refs.items() if i not in ordered})
    return ordered
