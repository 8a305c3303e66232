"""Can the synthetic set's features carry a colour or material change at all? A linear probe.

    python -m benchmarks.feature_probe --data_dir=DIR [--variant=moderate]
        [--feature_shape=8,8,64] [--features=grid,stats,grid@8x8x128,stats@16x16]
        [--types=color,material] [--pair=pooled|absflat|local]
        [--decompose=grid@8x8x64,grid@16x16x128]

docs/ablations.md, "Why colour and material changes are missed (diagnosis)", has the results.

Pairs of the built-in synthetic set (``datasets.prepare("synthetic", ...)``), one class per
change type of ``--types`` (the record's before / semantic-after pair) plus ``distractor``
(the same records' before / distractor-after pair: the same camera and lighting changes, no
semantic change). A ridge classifier on one-hot targets (NumPy, class-balanced weights,
features standardised on train, lambda chosen on val) is fitted on train and scored on test;
printed: per-class test accuracy (recall) and their mean, and per change type the test AUC
of the feature change at the changed object, semantic vs distractor pair (``change_aucs``),
for each feature source:

* ``grid``: the records' stored grid features (the dataset's ``feature_shape``);
* ``grid@HxWxC``: ``features/grid.py`` ``extract`` at another shape, on the rendered images
  the builder saved under ``raw/`` (the same extractor the builder runs);
* ``stats`` / ``stats@HxW``: the 55 patch statistics per cell before the random projection
  (``grid.patch_statistics``), at the dataset's grid or another one;
* a ``:vN`` suffix (``grid@8x8x64:v2``, ``stats:v2``): extractor version N (default 1, the
  extractor of builder versions before 2.0.0; version 2 has 67 statistics).

Pair representations (``--pair``), from the per-cell difference d = after - before:
``pooled`` (position-free: per channel the mean and max over cells of |d|, of d+ and of d-,
the mean of before and of after, and the 4 largest per-cell L2 norms of d); ``absflat``
(|d| of every cell, flattened: position-specific); ``local`` (told where to look: the 3 x 3
cells around the changed object's before-box centre, the same cells for the semantic and the
distractor pair, pooled (mean, max per channel: the camera jitter, a few pixels, moves an
object across cell borders) in before and after, and the |difference| of each pool). A linear
readout of d itself would cancel (red -> blue and blue -> red are equally likely), hence the
fixed |.| / max pooling.

``--decompose``: the test records re-rendered with only the camera or only the light of the
after views changed, or both changed half as much; the change AUC of each
(``decompose_distractors``).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from absl import app, flags
from PIL import Image

from changecap_jax import cli
from changecap_jax.data import datasets
from changecap_jax.data.synthetic import builder as synthetic_builder
from changecap_jax.data.synthetic import render, scenes
from changecap_jax.features import grid

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command's flags, defined when it runs (the probe's functions are imported by tests
    beside other commands that define flags of the same names)."""
    flags.DEFINE_list("decompose", [], "Feature sources (grid@HxWxC / stats[@HxW]) for which to "
                      "re-render the test examples with only the camera or only the light changed "
                      "(decompose_distractors); empty: skip.")
    flags.DEFINE_string("data_dir", "", "Datasets root ('' = $CHANGECAP_DATA_DIR or the cache).")
    flags.DEFINE_string("variant", "moderate", "Distractor strength of the synthetic set.")
    flags.DEFINE_list("feature_shape", ["8", "8", "64"], "The dataset's stored grid H,W,C.")
    flags.DEFINE_integer("num_train", 3000, "Synthetic option num_train (selects the dataset).")
    flags.DEFINE_list("features", ["grid", "stats", "grid@8x8x128", "stats@16x16"],
                      "Feature sources to compare (see the module docstring).")
    flags.DEFINE_list("types", ["color", "material"], "Change types probed against 'distractor'.")
    flags.DEFINE_enum("pair", "pooled", ["pooled", "absflat", "local"], "Pair representation.")
    flags.DEFINE_list("lambdas", ["0.1", "1", "10", "100", "1000", "10000"],
                      "Ridge penalties tried; the best on val is scored on test.")


DISTRACTOR = "distractor"
VIEWS = ("before", "after_semantic", "after_distractor")


def _load_split(dataset: datasets.PreparedDataset, split: str, types: Sequence[str]
                ) -> tuple[list[int], list[int], dict[str, np.ndarray], np.ndarray]:
    """Ids, change-type labels, stored grids (per view) and the changed object's box centre
    (x, y as fractions of the image; that of the after box for 'add') of one split's records
    of ``types``."""
    source = dataset.split(split)
    wanted = {scenes.CHANGE_TYPES.index(t) for t in types}
    width, height = dataset.meta.image_size[1], dataset.meta.image_size[0]
    ids, labels, grids, centres = [], [], {k: [] for k in VIEWS}, []
    for i in range(len(source)):
        record = source[i]
        if int(record["change_type"]) not in wanted:
            continue
        ids.append(int(record["id"]))
        labels.append(int(record["change_type"]))
        for k in VIEWS:
            grids[k].append(np.asarray(record[k], np.float32))
        box = np.asarray(record["bbox_before"], np.float32)
        if box[0] < 0:
            box = np.asarray(record["bbox_after"], np.float32)
        centres.append(((box[0] + box[2] / 2) / width, (box[1] + box[3] / 2) / height))
    return ids, labels, {k: np.stack(v) for k, v in grids.items()}, np.array(centres)


def _image_features(raw_dir: Path, ids: Sequence[int],
                    fn: Callable[[np.ndarray], np.ndarray]) -> dict[str, np.ndarray]:
    """``fn`` applied to each saved image of ``ids``: {view: (N, H, W, D)}."""
    return {k: np.stack([fn(np.asarray(Image.open(synthetic_builder.image_path(raw_dir, k, i))
                                       .convert("RGB")))
                         for i in ids]) for k in VIEWS}


def image_extractor(spec: str, grid_hw: tuple[int, int]
                    ) -> Callable[[np.ndarray], np.ndarray]:
    """(h, w, 3) uint8 image -> (H, W, D) features of a ``grid@HxWxC`` / ``stats[@HxW]``
    entry (``grid_hw``: the grid of a bare ``stats``)."""
    m = re.fullmatch(r"(grid|stats)(?:@(\d+)x(\d+)(?:x(\d+))?)?(?::v(\d+))?", spec)
    if not m or (m.group(1) == "grid" and not m.group(4)) or (
            m.group(1) == "stats" and m.group(4)) or (
            m.group(5) and int(m.group(5)) not in grid.VERSIONS):
        raise app.UsageError(f"unknown feature source {spec!r}: grid, grid@HxWxC, stats, "
                             f"stats@HxW, each but grid with :vN, N in {list(grid.VERSIONS)}")
    h, w = (int(m.group(2)), int(m.group(3))) if m.group(2) else grid_hw
    version = int(m.group(5) or 1)
    if m.group(1) == "stats":
        return lambda im: grid.patch_statistics(im, (h, w), version)
    shape = (h, w, int(m.group(4)))
    return lambda im: grid.extract(im[None], shape, np.float32, version)[0]


def source_features(spec: str, raw_dir: Path, ids: Sequence[int],
                    stored: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The per-view (N, H, W, D) features of one ``--features`` entry."""
    if spec == "grid":
        return stored
    return _image_features(raw_dir, ids, image_extractor(spec, stored["before"].shape[1:3]))


def _local_block(x: np.ndarray, centres: np.ndarray) -> np.ndarray:
    """(N, H, W, D) -> (N, 3, 3, D): the 3 x 3 cells around each centre (zero-padded)."""
    n, h, w, _ = x.shape
    padded = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    rows = np.clip((centres[:, 1] * h).astype(int), 0, h - 1)
    cols = np.clip((centres[:, 0] * w).astype(int), 0, w - 1)
    return np.stack([padded[i, r:r + 3, c:c + 3] for i, r, c in zip(range(n), rows, cols,
                                                                      strict=True)])


def pair_features(before: np.ndarray, after: np.ndarray, kind: str,
                  centres: np.ndarray | None = None) -> np.ndarray:
    """(N, H, W, D) before / after -> (N, F) probe inputs (see the module docstring)."""
    n = before.shape[0]
    if kind == "local":
        b = _local_block(before, centres).reshape(n, 9, -1)
        a = _local_block(after, centres).reshape(n, 9, -1)
        pooled = [b.mean(1), a.mean(1), b.max(1), a.max(1)]
        return np.concatenate([*pooled, np.abs(pooled[1] - pooled[0]),
                               np.abs(pooled[3] - pooled[2])], axis=1)
    d = (after - before).reshape(n, -1, before.shape[-1])
    if kind == "absflat":
        return np.abs(d).reshape(n, -1)
    a = np.abs(d)
    pos, neg = np.maximum(d, 0.0), np.maximum(-d, 0.0)
    norms = np.sort(np.linalg.norm(d, axis=-1), axis=1)[:, ::-1][:, :4]
    parts = [a.mean(1), a.max(1), pos.mean(1), pos.max(1), neg.mean(1), neg.max(1),
             before.reshape(n, -1, before.shape[-1]).mean(1),
             after.reshape(n, -1, after.shape[-1]).mean(1), norms]
    return np.concatenate(parts, axis=1)


def probe_set(views: dict[str, np.ndarray], labels: Sequence[int], types: Sequence[str],
              kind: str, centres: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(X, y): each record's semantic pair (class = its type) and distractor pair (class
    ``len(types)``)."""
    order = [scenes.CHANGE_TYPES.index(t) for t in types]
    y_sem = np.array([order.index(t) for t in labels])
    before = views["before"]
    x = np.concatenate([pair_features(before, views["after_semantic"], kind, centres),
                        pair_features(before, views["after_distractor"], kind, centres)])
    y = np.concatenate([y_sem, np.full(len(labels), len(types))])
    return x, y


def fit_ridge(x: np.ndarray, y: np.ndarray, num_classes: int, lam: float) -> np.ndarray:
    """Class-balanced ridge regression onto one-hot targets; weights (F + 1, K), bias last.
    Solved in the dual (N x N) when there are more features than examples."""
    counts = np.bincount(y, minlength=num_classes)
    s = np.sqrt(len(y) / (num_classes * counts[y]))[:, None]  # sqrt of the sample weights
    xb = np.concatenate([x, np.ones((len(x), 1))], axis=1) * s
    t = np.eye(num_classes)[y] * s
    if xb.shape[1] > xb.shape[0]:
        alpha = np.linalg.solve(xb @ xb.T + lam * np.eye(len(xb)), t)
        return xb.T @ alpha
    return np.linalg.solve(xb.T @ xb + lam * np.eye(xb.shape[1]), xb.T @ t)


def per_class_accuracy(w: np.ndarray, x: np.ndarray, y: np.ndarray,
                       num_classes: int) -> np.ndarray:
    pred = (np.concatenate([x, np.ones((len(x), 1))], axis=1) @ w).argmax(1)
    return np.array([(pred[y == k] == k).mean() for k in range(num_classes)])


def run_probe(data: dict[str, tuple[np.ndarray, np.ndarray]], num_classes: int,
              lambdas: Sequence[float]) -> tuple[float, np.ndarray, np.ndarray]:
    """Standardise on train, pick lambda by val mean per-class accuracy; (lambda, val, test)."""
    (xtr, ytr), (xva, yva), (xte, yte) = data["train"], data["val"], data["test"]
    mu, sd = xtr.mean(0), xtr.std(0) + 1e-6
    xtr, xva, xte = ((v - mu) / sd for v in (xtr, xva, xte))
    best = None
    for lam in lambdas:
        w = fit_ridge(xtr, ytr, num_classes, lam)
        val = per_class_accuracy(w, xva, yva, num_classes)
        if best is None or val.mean() > best[1].mean():
            best = (lam, val, w)
    lam, val, w = best
    return lam, val, per_class_accuracy(w, xte, yte, num_classes)


def auc(pos: np.ndarray, neg: np.ndarray) -> float:
    """P(a positive scores above a negative) (ties count half)."""
    ranks = np.concatenate([pos, neg]).argsort(kind="stable").argsort() + 1.0
    return float((ranks[:len(pos)].sum() - len(pos) * (len(pos) + 1) / 2)
                 / (len(pos) * len(neg)))


def change_aucs(views: dict[str, np.ndarray], labels: Sequence[int], types: Sequence[str],
                centres: np.ndarray) -> list[float]:
    """Per type: the AUC of the feature change at the changed object (L2 norm of the change of
    the 3 x 3 block's mean) between its semantic pairs and the same records' distractor
    pairs. 0.5: a distractor moves the object's features as much as the change does."""
    n = len(labels)
    pool = lambda x: _local_block(x, centres).reshape(n, 9, -1).mean(1)
    before = pool(views["before"])
    sem = np.linalg.norm(pool(views["after_semantic"]) - before, axis=-1)
    dis = np.linalg.norm(pool(views["after_distractor"]) - before, axis=-1)
    labels = np.asarray(labels)
    return [auc(sem[labels == scenes.CHANGE_TYPES.index(t)],
                dis[labels == scenes.CHANGE_TYPES.index(t)]) for t in types]


def _halved(camera: scenes.Camera, light: scenes.Lighting, base: scenes.Lighting
            ) -> tuple[scenes.Camera, scenes.Lighting]:
    """A view's camera and light change, each parameter moved half-way back to the before
    view's (what a distractor strength of half the ranges would draw)."""
    half = lambda new, old: old + (new - old) / 2
    return (scenes.Camera(yaw=half(camera.yaw, 0.0), tx=half(camera.tx, 0.0),
                          ty=half(camera.ty, 0.0), zoom=half(camera.zoom, 1.0)),
            scenes.Lighting(azimuth=half(light.azimuth, base.azimuth),
                            brightness=half(light.brightness, base.brightness),
                            tint=tuple(half(t, b) for t, b in zip(light.tint, base.tint,
                                                                  strict=True)),
                            ambient=half(light.ambient, base.ambient)))


def decompose_distractors(dataset: datasets.PreparedDataset, types: Sequence[str],
                          specs: Sequence[str]) -> None:
    """Re-renders the test examples of ``types`` with only the camera or only the lighting
    of each after view changed, or both changed half as much, and prints the change AUC
    (``change_aucs``) for each."""
    cfg = dataset.builder.builder_config
    ids = [i for i in synthetic_builder.split_ids(cfg)["test"]
           if synthetic_builder.change_type_of(i) in types]
    settings = {  # name -> (camera, light) of an after view, from (example, view)
        "camera + light": lambda ex, v: (getattr(ex, f"camera_{v}"), getattr(ex, f"light_{v}")),
        "camera only": lambda ex, v: (getattr(ex, f"camera_{v}"), ex.light_before),
        "light only": lambda ex, v: (ex.camera_before, getattr(ex, f"light_{v}")),
        "both, halved": lambda ex, v: _halved(getattr(ex, f"camera_{v}"),
                                              getattr(ex, f"light_{v}"), ex.light_before),
    }
    examples = [synthetic_builder.make_example(cfg, i) for i in ids]
    labels = [scenes.CHANGE_TYPES.index(ex.change_type) for ex in examples]
    images: dict[str, dict[str, list[np.ndarray]]] = {k: {v: [] for v in VIEWS}
                                                       for k in settings}
    centres = []
    for ex in examples:
        before, boxes = render.render(ex.before, ex.camera_before, ex.light_before,
                                      cfg.image_size)
        x, y, w, h = boxes[ex.changed_index_before]
        centres.append(((x + w / 2) / cfg.image_size[1], (y + h / 2) / cfg.image_size[0]))
        for name, camera_light in settings.items():
            images[name]["before"].append(before)
            images[name]["after_semantic"].append(
                render.render(ex.after, *camera_light(ex, "semantic"), cfg.image_size)[0])
            images[name]["after_distractor"].append(
                render.render(ex.before, *camera_light(ex, "distractor"), cfg.image_size)[0])
    print(f"\nchange AUC at the changed object, {len(ids)} re-rendered test examples of the "
          f"{cfg.distractors!r} set")
    print("| features | after views change | " + " | ".join(f"AUC {t}" for t in types) + " |")
    print("|---" * (len(types) + 2) + "|")
    for spec in specs:
        fn = image_extractor(spec, tuple(cfg.feature_shape[:2]))
        for name in settings:
            views = {v: np.stack([fn(im) for im in images[name][v]]) for v in VIEWS}
            aucs = change_aucs(views, labels, types, np.array(centres))
            print(f"| {spec} | {name} | " + " | ".join(f"{a:.2f}" for a in aucs) + " |")
        sys.stdout.flush()


def main(argv: Sequence[str]) -> None:
    del argv
    types = [t for t in FLAGS.types if t]
    unknown = set(types) - set(scenes.CHANGE_TYPES)
    if unknown:
        raise app.UsageError(f"unknown change types {sorted(unknown)}; "
                             f"choose from {scenes.CHANGE_TYPES}")
    options = {"feature_shape": tuple(int(v) for v in FLAGS.feature_shape),
               "num_train": FLAGS.num_train}
    dataset = datasets.prepare("synthetic", FLAGS.data_dir, FLAGS.variant, options)
    raw_dir = dataset.directory / (dataset.meta.raw_dir or "raw")
    splits = {s: _load_split(dataset, s, types) for s in ("train", "val", "test")}
    classes = [*types, DISTRACTOR]
    print(f"dataset {dataset.directory}; pair={FLAGS.pair}; pairs train/val/test: "
          + "/".join(str(2 * len(splits[s][0])) for s in splits))
    print("| features | dims | lambda | " + " | ".join(classes) + " | mean (val) | mean | "
          + " | ".join(f"AUC {t}" for t in types) + " |")
    print("|---" * (len(classes) + len(types) + 5) + "|")
    for spec in FLAGS.features:
        data = {}
        for s, (ids, labels, stored, centres) in splits.items():
            views = source_features(spec, raw_dir, ids, stored)
            data[s] = probe_set(views, labels, types, FLAGS.pair, centres)
            if s == "test":
                aucs = change_aucs(views, labels, types, centres)
        lam, val, test = run_probe(data, len(classes), [float(v) for v in FLAGS.lambdas])
        cells = " | ".join(f"{100 * a:.1f}" for a in test)
        print(f"| {spec} | {data['train'][0].shape[1]} | {lam:g} | {cells} | "
              f"{100 * val.mean():.1f} | {100 * test.mean():.1f} | "
              + " | ".join(f"{a:.2f}" for a in aucs) + " |")
        sys.stdout.flush()
    if FLAGS.decompose:
        decompose_distractors(dataset, types, [f for f in FLAGS.decompose if f != "grid"])


if __name__ == "__main__":
    define_flags()
    cli.run(main)
