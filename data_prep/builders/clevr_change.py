"""CLEVR-Change (Park et al., ICCV 2019) from its official download (datasets.md §1).

Raw layout (the ``data/`` folder of ``clevr_change.tar.gz``; ``raw_dir`` may be that folder
or its parent)::

    images/CLEVR_default_%06d.png       before
    sc_images/CLEVR_semantic_%06d.png   after, semantic change     -> change_captions.json
    nsc_images/CLEVR_nonsemantic_%06d.png  after, distractors only -> no_change_captions.json
    change_captions.json, no_change_captions.json   {"CLEVR_default_%06d.png": [captions]}
    splits.json        {"train": [int], "val": [...], "test": [...]}
    type_mapping.json  {"color": ["%06d.png", ...], "material": ..., "move", "drop", "add"}

One record per id of ``splits.json`` with both pairs. Ids with images but in neither
``splits.json`` nor ``type_mapping.json`` (197 in the real data) are skipped and counted; an
id in only one of the two, or one without captions or images, is an error. Tokeniser and
vocabulary as SCORER / DIRL (train change + no-change captions, threshold 1, sorted); captions
padded to the longest over all splits (24 tokens for the real data). Features: ResNet-101
layer3 (1024 x 14 x 14), or the official ``features/``, ``sc_features/``, ``nsc_features/``
folders of ``<png name>.npy``.
"""

from __future__ import annotations

import re
from pathlib import Path

from changecap_jax.data.synthetic.scenes import CHANGE_TYPES
from changecap_jax.jsonio import read_json
from data_prep.builders.base import SPLITS, Annotations, BuildError, PairDatasetBuilder, PairSpec

IMAGE_PATTERN = re.compile(r"^CLEVR_default_(\d+)\.png$")


def load_json(path: Path, what: str) -> object:
    if not path.is_file():
        raise BuildError(f"missing {what}: {path}")
    try:
        return read_json(path, what)
    except ValueError as e:
        raise BuildError(str(e)) from e


def read_splits(path: Path) -> dict[str, list[int]]:
    """``splits.json`` -> split name -> ids; checks keys, types and disjointness."""
    data = load_json(path, "split file")
    if not isinstance(data, dict) or set(data) != set(SPLITS):
        found = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise BuildError(f"{path}: expected keys {list(SPLITS)}, found {found}")
    seen: dict[int, str] = {}
    for split in SPLITS:
        for i in data[split]:
            if not isinstance(i, int):
                raise BuildError(f"{path}: {split!r} holds {i!r}; ids must be integers")
            if i in seen:
                raise BuildError(f"{path}: id {i} is in both {seen[i]!r} and {split!r}")
            seen[i] = split
    return {s: list(data[s]) for s in SPLITS}


def read_type_mapping(path: Path) -> dict[int, int]:
    """``type_mapping.json`` -> id -> index into CHANGE_TYPES."""
    data = load_json(path, "type mapping")
    if not isinstance(data, dict) or set(data) != set(CHANGE_TYPES):
        found = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise BuildError(f"{path}: expected keys {sorted(CHANGE_TYPES)}, found {found}")
    out: dict[int, int] = {}
    for ctype, names in data.items():
        for name in names:
            m = re.fullmatch(r"(\d+)\.png", str(name))
            if not m:
                raise BuildError(f"{path}: {ctype!r} holds {name!r}, expected '%06d.png'")
            i = int(m.group(1))
            if i in out:
                raise BuildError(f"{path}: id {i} has two types")
            out[i] = CHANGE_TYPES.index(ctype)
    return out


def read_captions(path: Path, what: str) -> dict[int, list[str]]:
    data = load_json(path, what)
    if not isinstance(data, dict):
        raise BuildError(f"{path}: expected an object of image name -> captions")
    out = {}
    for name, captions in data.items():
        m = IMAGE_PATTERN.match(name)
        if not m:
            raise BuildError(f"{path}: key {name!r} is not 'CLEVR_default_%06d.png'")
        if not isinstance(captions, list) or not captions:
            raise BuildError(f"{path}: {name!r} must map to a non-empty list of captions")
        out[int(m.group(1))] = [str(c) for c in captions]
    return out


def resolve_raw_dir(raw_dir: Path, marker: str) -> Path:
    """The folder holding ``marker``: raw_dir itself or its ``data/`` sub-folder."""
    if not (raw_dir / marker).exists() and (raw_dir / "data" / marker).exists():
        return raw_dir / "data"
    return raw_dir


class ClevrChange(PairDatasetBuilder):
    """CLEVR-Change: before / semantic-after / distractor-after triplets."""

    HAS_DISTRACTOR = True
    PROTOCOL = ("both pairs of every test id (semantic '%06d.png', distractor '%06d.png_n'); "
                "references: all captions of the pair; rows total / semantic / no-change and "
                "per change type (SCORER / DIRL evaluate.py)")
    FEATURE_SUBDIRS = {"images": "features", "sc_images": "sc_features",
                       "nsc_images": "nsc_features"}

    def read_annotations(self, raw_dir: Path) -> Annotations:
        raw_dir = resolve_raw_dir(raw_dir, "splits.json")
        self.raw_dir = raw_dir
        splits = read_splits(raw_dir / "splits.json")
        types = read_type_mapping(raw_dir / "type_mapping.json")
        change = read_captions(raw_dir / "change_captions.json", "change captions")
        no_change = read_captions(raw_dir / "no_change_captions.json", "no-change captions")
        split_ids = {i for ids in splits.values() for i in ids}
        for i in sorted(split_ids ^ set(types))[:1]:
            where = "splits.json" if i in split_ids else "type_mapping.json"
            other = "type_mapping.json" if i in split_ids else "splits.json"
            raise BuildError(f"{raw_dir}: id {i} ('{i:06d}.png') is in {where} but not in "
                             f"{other}")
        for captions, fname in ((change, "change_captions.json"),
                                (no_change, "no_change_captions.json")):
            outside = sorted(set(captions) - split_ids)
            if outside:
                raise BuildError(f"{raw_dir / fname}: {len(outside)} captioned id(s) are in "
                                 f"no split of splits.json, e.g. CLEVR_default_"
                                 f"{outside[0]:06d}.png")
        specs: dict[str, list[PairSpec]] = {}
        for split, ids in splits.items():
            specs[split] = []
            for i in ids:
                name = f"CLEVR_default_{i:06d}.png"
                for captions, fname in ((change, "change_captions.json"),
                                        (no_change, "no_change_captions.json")):
                    if i not in captions:
                        raise BuildError(f"{raw_dir / fname}: no captions for {name} "
                                         f"({split} id {i})")
                specs[split].append(PairSpec(
                    id=i, image_id=f"{i:06d}.png",
                    images={"before": f"images/{name}",
                            "after_semantic": f"sc_images/CLEVR_semantic_{i:06d}.png",
                            "after_distractor": f"nsc_images/CLEVR_nonsemantic_{i:06d}.png"},
                    change_captions=change[i], no_change_captions=no_change[i],
                    change_type=types[i]))
        skipped: dict[str, int] = {}
        if (raw_dir / "images").is_dir():
            unannotated = sum(
                1 for p in (raw_dir / "images").iterdir()
                if (m := IMAGE_PATTERN.match(p.name)) and int(m.group(1)) not in split_ids)
            if unannotated:
                skipped["images in neither splits.json nor type_mapping.json"] = unannotated
        return Annotations(specs, list(CHANGE_TYPES), skipped)
