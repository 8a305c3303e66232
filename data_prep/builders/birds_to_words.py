"""Birds-to-Words (Forbes et al., EMNLP 2019) from its official TSV (datasets.md §5).

Raw layout (``raw_dir`` or its ``data/`` sub-folder)::

    birds-to-words-v1.0.tsv    tab-separated, one row per (pair, annotation), header row:
        img1ObservationURL img1ImgURL img1Species img1Selection
        img2ObservationURL img2ImgURL img2Species img2Selection split annN description
    images/<photo_id>.jpg      the iNaturalist photos, downloaded by the user (.jpeg / .png,
                               any letter case, are accepted for the same photo id)

``photo_id`` is the number in ``/photos/<digits>/`` of ``img{1,2}ImgURL`` (e.g.
``https://static.inaturalist.org/photos/647514/medium.jpg?1387577400``), else the trailing
digits of ``img{1,2}ObservationURL`` (``https://www.inaturalist.org/photos/647514``).

The TSV is read as Python's csv module and pandas read it (a field that starts with ``"`` is
a quoted field; a stray quote there is an error, not silently mangled text). Checked: the
header exactly as above, 11 columns per row, ``split`` in train / val / test,
``annN`` an integer 1..5, the selections in the README's set, a non-empty description and a
photo id for both images; errors name the file and line (and the column).

One record per ordered pair (img1 photo, img2 photo), its rows gathered from the whole file:
``id`` is a running number in order of first appearance in the TSV (given before pairs are
dropped, so ids do not depend on which images could be downloaded), ``image_id`` is
``"<photo1>_<photo2>"``, the captions are the pair's descriptions ordered by ``annN`` (rows
with the same ``annN`` keep their file order). A pair whose rows name different splits is an
error. Some iNaturalist URLs are dead, so a pair with a missing image file is dropped and
counted in ``meta.json``'s ``skipped``; a split left with no pair is an error.

Captions: descriptions are already lower-cased and tokenised (``animal1 ' s legs ...``), so
they are split on whitespace; vocabulary from the train descriptions, threshold 1, sorted
(IDC's own ``dict_cub_bird.json`` is not obtainable); captions capped at 80 tokens with
``<START>``/``<END>`` (IDC's bird ``max_len``), longer ones cut with a final ``<END>``.
Features: ResNet-101 layer4, 2048 x 7 x 7 (IDC's grid features); ``features_dir`` holds
``<image file name>.npy`` (flat or under ``images/``).

Evaluation: every test pair, references all its descriptions; main metrics CIDEr
(pycocoevalcap's, i.e. CIDEr-D) and ROUGE-L, by which IDC ranks its bird results.
"""

from __future__ import annotations

import csv
import dataclasses
import logging
import re
from pathlib import Path

from data_prep.builders.base import (
    SPLITS,
    Annotations,
    BuildError,
    PairDatasetBuilder,
    PairSpec,
    skip,
)
from data_prep.builders.clevr_change import resolve_raw_dir

TSV_NAME = "birds-to-words-v1.0.tsv"
IMAGES_DIR = "images"
HEADER = ("img1ObservationURL", "img1ImgURL", "img1Species", "img1Selection",
          "img2ObservationURL", "img2ImgURL", "img2Species", "img2Selection",
          "split", "annN", "description")
SELECTIONS = ("base", "visual", "sameSpecies", "sameGenus", "sameFamily", "sameOrder",
              "sameClass")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")  # preference order when several exist
MAX_ANNOTATIONS = 5

_PHOTO_IN_PATH = re.compile(r"/photos/(\d+)(?:[/?#]|$)")
_TRAILING_DIGITS = re.compile(r"(\d+)/?(?:[?#].*)?$")


@dataclasses.dataclass(frozen=True)
class Row:
    """One annotation row of the TSV."""

    line: int
    photos: tuple[str, str]
    split: str
    ann: int
    description: str


@dataclasses.dataclass
class Pair:
    """An ordered image pair with all its annotation rows."""

    id: int
    photos: tuple[str, str]
    split: str
    rows: list[Row]

    @property
    def descriptions(self) -> list[str]:
        return [r.description for r in sorted(self.rows, key=lambda r: r.ann)]  # stable


def photo_id(image_url: str, observation_url: str) -> str | None:
    """The iNaturalist photo id of an image: ``/photos/<digits>`` of the image URL, else the
    trailing digits of the observation URL; None when neither has one."""
    m = _PHOTO_IN_PATH.search(image_url)
    if m:
        return m.group(1)
    m = _TRAILING_DIGITS.search(observation_url.strip())
    return m.group(1) if m else None


def read_tsv(path: Path) -> list[Row]:
    """Reads and checks the TSV; errors name the file, line and column."""
    if not path.is_file():
        raise BuildError(f"missing annotation file {path} (the birds-to-words TSV)")
    rows: list[Row] = []
    with path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f, delimiter="\t", strict=True)
        try:
            header = next(reader, None)
            if header is None or tuple(header) != HEADER:
                raise BuildError(f"{path}: line 1: expected the header {list(HEADER)}, found "
                                 f"{header}")
            for values in reader:
                line = reader.line_num
                if not values or values == [""]:
                    continue  # a blank line carries nothing
                rows.append(_parse_row(path, line, values))
        except csv.Error as e:
            raise BuildError(f"{path}: line {reader.line_num}: cannot be parsed as TSV: {e}"
                             ) from e
    return rows


def _parse_row(path: Path, line: int, values: list[str]) -> Row:
    where = f"{path}: line {line}"
    if len(values) != len(HEADER):
        raise BuildError(f"{where}: expected {len(HEADER)} tab-separated columns, found "
                         f"{len(values)}")
    row = dict(zip(HEADER, values, strict=True))
    photos = []
    for k in (1, 2):
        key = f"img{k}Selection"
        if row[key] not in SELECTIONS:
            raise BuildError(f"{where}: column {key} is {row[key]!r}, expected one of "
                             f"{list(SELECTIONS)}")
        pid = photo_id(row[f"img{k}ImgURL"], row[f"img{k}ObservationURL"])
        if pid is None:
            raise BuildError(f"{where}: column img{k}ImgURL {row[f'img{k}ImgURL']!r} has no "
                             f"/photos/<id>/ and img{k}ObservationURL "
                             f"{row[f'img{k}ObservationURL']!r} does not end in a number")
        photos.append(pid)
    if row["split"] not in SPLITS:
        raise BuildError(f"{where}: column split is {row['split']!r}, expected one of "
                         f"{list(SPLITS)}")
    ann = row["annN"].strip()
    if not ann.isdigit() or not 1 <= int(ann) <= MAX_ANNOTATIONS:
        raise BuildError(f"{where}: column annN is {row['annN']!r}, expected an integer "
                         f"1..{MAX_ANNOTATIONS}")
    description = row["description"].strip()
    if not description:
        raise BuildError(f"{where}: column description is empty")
    return Row(line, (photos[0], photos[1]), row["split"], int(ann), description)


def group_pairs(rows: list[Row], path: Path) -> list[Pair]:
    """Rows -> pairs in order of first appearance; a pair must keep one split."""
    pairs: dict[tuple[str, str], Pair] = {}
    for row in rows:
        pair = pairs.get(row.photos)
        if pair is None:
            pairs[row.photos] = Pair(len(pairs), row.photos, row.split, [row])
            continue
        if row.split != pair.split:
            raise BuildError(f"{path}: pair {'_'.join(row.photos)} is {pair.split!r} at line "
                             f"{pair.rows[0].line} but {row.split!r} at line {row.line}")
        pair.rows.append(row)
    return list(pairs.values())


def image_files(images_dir: Path) -> dict[str, str]:
    """photo id -> image file name in ``images_dir`` (preferring .jpg, then .jpeg, .png)."""
    best: dict[str, tuple[int, str]] = {}
    for p in images_dir.iterdir():
        suffix = p.suffix.lower()
        if suffix in IMAGE_SUFFIXES and p.stem.isdigit() and p.is_file():
            choice = (IMAGE_SUFFIXES.index(suffix), p.name)
            best[p.stem] = min(best.get(p.stem, choice), choice)
    return {pid: name for pid, (_, name) in best.items()}


class BirdsToWords(PairDatasetBuilder):
    """Birds-to-Words: paragraphs on how two bird photos differ, one record per pair."""

    DEFAULT_CONFIG_NAME = "layer4"
    DEFAULT_LAYER = 4
    HAS_DISTRACTOR = False
    TOKENIZER = "whitespace"
    DEFAULT_MAX_CAPTION_LEN = 80
    # pycocoevalcap's CIDEr is CIDEr-D; IDC ranks birds by ROUGE-L.
    MAIN_METRICS = ("CIDEr", "ROUGE_L")
    PROTOCOL = ("every test pair (image id '<photo1>_<photo2>'), references: all its "
                "descriptions; pairs with a missing image are left out (meta skipped)")

    def read_annotations(self, raw_dir: Path) -> Annotations:
        raw_dir = resolve_raw_dir(raw_dir, TSV_NAME)
        self.raw_dir = raw_dir
        path = raw_dir / TSV_NAME
        pairs = group_pairs(read_tsv(path), path)
        images_dir = raw_dir / IMAGES_DIR
        if not images_dir.is_dir():
            raise BuildError(f"missing image folder {images_dir} (the photos of img1ImgURL / "
                             f"img2ImgURL, saved as <photo_id>.jpg)")
        files = image_files(images_dir)
        specs: dict[str, list[PairSpec]] = {s: [] for s in SPLITS}
        for pair in pairs:
            specs[pair.split].append(PairSpec(
                id=pair.id, image_id="_".join(pair.photos),
                # An absent photo keeps its expected name; _drop_missing_images drops it.
                images={key: f"{IMAGES_DIR}/{files.get(p, p + IMAGE_SUFFIXES[0])}"
                        for key, p in zip(("before", "after_semantic"), pair.photos,
                                          strict=True)},
                change_captions=pair.descriptions))
        for split, split_specs in specs.items():
            if not split_specs:
                raise BuildError(f"{path}: no row has split {split!r}")
        return Annotations(specs)

    def _drop_missing_images(self, ann: Annotations) -> Annotations:
        # Dead iNaturalist URLs leave gaps in every download: drop those pairs, count them.
        kept: dict[str, list[PairSpec]] = {}
        missing: set[str] = set()
        for split, specs in ann.splits.items():
            kept[split] = []
            for spec in specs:
                absent = [r for r in spec.images.values() if not (self.raw_dir / r).is_file()]
                if absent:
                    missing.update(absent)
                    skip(ann.skipped, f"{split} pairs with an image missing from {IMAGES_DIR}/ "
                                      "(no <photo_id>.jpg/.jpeg/.png)")
                else:
                    kept[split].append(spec)
            if not kept[split]:
                raise BuildError(f"{self.name}: every {split} pair lacks an image in "
                                 f"{self.raw_dir / IMAGES_DIR} ({len(specs)} pair(s), e.g. "
                                 f"{specs[0].image_id!r}); nothing is left to build")
        if missing:
            logging.warning("%s: %d image file(s) missing, e.g. %s", self.name, len(missing),
                            ", ".join(sorted(missing)[:5]))
        return Annotations(kept, ann.change_types, ann.skipped)
