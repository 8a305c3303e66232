"""CLEVR-DC (Kim et al., ICCV 2021) from its official download (datasets.md §2).

Two raw layouts are accepted, in ``raw_dir`` or its ``data/`` sub-folder (checked in that
order; the upstream layout is preferred when a folder holds both):

upstream (hsgkim/clevr-dc with ``bef.tar.gz`` / ``aft.tar.gz`` extracted beside its files)::

    bef/<id>.png      before; ids 0..47999 without zero padding
    aft/<id>.png      after: moved camera and, except in the last block, one change
    captions.json     {"<id>": [captions]}  (keys are bare numbers, no extension)
    split.json        {"train": [int], "val": [...], "test": [...]}

DIRL (tuyunbin/DIRL after ``scripts/pad_img.py`` moved bef -> images, aft -> sc_images and
``scripts/rename_dc_caption.py`` re-keyed the captions)::

    images/%06d.png, sc_images/%06d.png
    change_captions.json   {"%06d.png": [captions]}
    splits.json            (or the upstream name split.json)

One record per split id: ``id`` the number, ``image_id`` ``"%06d.png"`` (DIRL's names, which
its evaluation keys on), before / semantic-after features, the id's captions; no distractor
and no no-change captions (the no-change block is an ordinary pair). Split ids must be
disjoint and in 0..47999; a caption key in no split, a split id without captions or a
missing image is an error naming the file and the key or id.

Change type: ``id // 8000`` into ``color, material, add, drop, move, no_change``. The README
only says there are 8,000 pairs per action; the block order is INFERRED from the order in
which it lists the actions (datasets.md §2), nothing in the download states it. DIRL itself
never uses types (the type code of its evaluate_dc.py is commented out).

Captions: the SCORER / DIRL tokeniser (``clevr``), vocabulary from the train captions only,
threshold 1, sorted (scripts/preprocess_captions_dc.py); padded to the longest caption over
all splits (the official ``L_h5``; the preset's ``seq_length: 40`` is its decode length).

Features: ResNet-101 layer3, (1024, 14, 14). datasets.md §2 reads the DIRL preset's
``input_dim: 2048`` as layer4 (2048 x 7 x 7), but the DC model's first conv has weight shape
(512, 1024, 1, 1) and its dataset code expects (1024, 14, 14) (docs/official/common.md §2.6), so
the model code wins. Feature files: ``<image name>.npy`` in ``features/`` (before) and
``sc_features/`` (after) of ``features_dir``; with the upstream layout, DIRL-named files
(``000123.png.npy`` for ``bef/123.png``) are found too.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

from changecap_jax.data.synthetic.scenes import CHANGE_TYPES
from data_prep.builders.base import (
    Annotations,
    BuildError,
    PairDatasetBuilder,
    PairSpec,
)
from data_prep.builders.clevr_change import load_json, read_splits

BLOCK = 8000  # ids per action (README)
NUM_IDS = 6 * BLOCK
DC_CHANGE_TYPES = (*CHANGE_TYPES, "no_change")  # inferred block order, see the docstring


@dataclasses.dataclass(frozen=True)
class Layout:
    """One of the accepted raw layouts: where the images, captions and splits are."""

    name: str
    before: str  # image folders
    after: str
    captions: str
    split_files: tuple[str, ...]  # the first present one is read
    key_pattern: re.Pattern  # caption key -> id (group 1)
    key_format: str  # id -> caption key
    key_form: str  # the key form, in messages
    image_format: str  # id -> image file name

    def key(self, i: int) -> str:
        return self.key_format.format(i)

    def image(self, i: int) -> str:
        return self.image_format.format(i)

    def missing(self, folder: Path) -> list[str]:
        """What of this layout ``folder`` lacks (empty: complete)."""
        out = [f"{d}/" for d in (self.before, self.after) if not (folder / d).is_dir()]
        if not (folder / self.captions).is_file():
            out.append(self.captions)
        if not any((folder / s).is_file() for s in self.split_files):
            out.append(" or ".join(self.split_files))
        return out


UPSTREAM = Layout("upstream hsgkim/clevr-dc", "bef", "aft", "captions.json", ("split.json",),
                  re.compile(r"^(0|[1-9]\d*)$"), "{}", "<id>", "{}.png")
DIRL = Layout("DIRL-renamed", "images", "sc_images", "change_captions.json",
              ("splits.json", "split.json"), re.compile(r"^(\d{6})\.png$"), "{:06d}.png",
              "%06d.png", "{:06d}.png")
LAYOUTS = (UPSTREAM, DIRL)


def find_layout(raw_dir: Path) -> tuple[Path, Layout]:
    """The folder (raw_dir or raw_dir/data) and the first complete layout in it."""
    folders = [raw_dir] + ([raw_dir / "data"] if (raw_dir / "data").is_dir() else [])
    gaps = []
    for folder in folders:
        for layout in LAYOUTS:
            missing = layout.missing(folder)
            if not missing:
                return folder, layout
            gaps.append(f"{folder}: {layout.name} layout lacks {', '.join(missing)}")
    raise BuildError("no complete CLEVR-DC layout (bef/, aft/, captions.json, split.json; or "
                     "images/, sc_images/, change_captions.json, splits.json): "
                     + "; ".join(gaps))


def change_type_of(i: int) -> int:
    """Index into DC_CHANGE_TYPES of id ``i`` (its 8,000-id block)."""
    if not 0 <= i < NUM_IDS:
        raise ValueError(f"id {i} is outside 0..{NUM_IDS - 1}")
    return i // BLOCK


def read_captions(path: Path, layout: Layout) -> dict[int, list[str]]:
    """The caption file of ``layout`` -> id -> captions; keys must have the layout's form."""
    data = load_json(path, "caption file")
    if not isinstance(data, dict):
        raise BuildError(f"{path}: expected an object of key -> captions, found "
                         f"{type(data).__name__}")
    out: dict[int, list[str]] = {}
    for key, captions in data.items():
        m = layout.key_pattern.match(key)
        if not m:
            raise BuildError(f"{path}: key {key!r} is not of the {layout.name} form "
                             f"{layout.key_form!r}")
        if (not isinstance(captions, list) or not captions
                or not all(isinstance(c, str) for c in captions)):
            raise BuildError(f"{path}: key {key!r} must map to a non-empty list of strings")
        out[int(m.group(1))] = list(captions)
    return out


class ClevrDC(PairDatasetBuilder):
    """CLEVR-DC: before / after pairs under a moved camera, one record per pair."""

    DEFAULT_LAYER = 3
    HAS_DISTRACTOR = False
    TOKENIZER = "clevr"
    PROTOCOL = ("every test pair (image id '%06d.png'; no distractor stream), references: all "
                "its captions (DIRL evaluate_dc.py, whose number is our 'total' row); the "
                "per-type rows are ours, from the 8,000-id blocks in the README's order "
                "(inferred): color, material, add, drop, move, no_change")
    FEATURE_SUBDIRS = {"images": "features", "sc_images": "sc_features",
                       "bef": "features", "aft": "sc_features"}

    layout: Layout | None = None

    def read_annotations(self, raw_dir: Path) -> Annotations:
        folder, layout = find_layout(raw_dir)
        logging.info("%s: reading the %s layout in %s", self.name, layout.name, folder)
        self.raw_dir, self.layout = folder, layout
        split_path = next(folder / s for s in layout.split_files if (folder / s).is_file())
        splits = read_splits(split_path)
        for split, ids in splits.items():
            for i in ids:
                if not 0 <= i < NUM_IDS:
                    raise BuildError(f"{split_path}: {split} id {i} is outside 0..{NUM_IDS - 1}"
                                     f" (6 blocks of {BLOCK} ids, one per change type)")
        caption_path = folder / layout.captions
        captions = read_captions(caption_path, layout)
        split_ids = {i for ids in splits.values() for i in ids}
        outside = sorted(set(captions) - split_ids)
        if outside:
            raise BuildError(f"{caption_path}: {len(outside)} caption key(s) are in no split of "
                             f"{split_path.name}, e.g. key {layout.key(outside[0])!r}")
        specs: dict[str, list[PairSpec]] = {}
        for split, ids in splits.items():
            specs[split] = []
            for i in ids:
                if i not in captions:
                    raise BuildError(f"{caption_path}: no captions for {split} id {i} (key "
                                     f"{layout.key(i)!r})")
                specs[split].append(PairSpec(
                    id=i, image_id=f"{i:06d}.png",
                    images={"before": f"{layout.before}/{layout.image(i)}",
                            "after_semantic": f"{layout.after}/{layout.image(i)}"},
                    change_captions=captions[i], change_type=change_type_of(i)))
        return Annotations(specs, list(DC_CHANGE_TYPES))

    def feature_names(self, image_rel: str) -> list[str]:
        # The authors' features are named after DIRL's padded images (000123.png.npy); with
        # the upstream layout (123.png), accept those names after the image's own.
        names = super().feature_names(image_rel)
        if self.layout is UPSTREAM:
            names.append(DIRL.image(int(Path(image_rel).stem)))
        return names
