"""Caption your own image pairs with an exported model, and see where it looked.

    python -m changecap_jax predict --model=DIR --before=IMG --after=IMG [--beam_size=K]
        [--out=DIR]
    python -m changecap_jax predict --model=DIR --pairs=FILE.csv [--out=DIR]

``--model`` is a directory written by ``python -m changecap_jax export``. Features are
extracted exactly as for the model's training data: the synthetic grid extractor, or
ResNet-101 (PyTorch, the optional extra) with the weights recorded at export or given with
``--weights``, through the same preprocessing as ``data_prep`` (both use
``changecap_jax/features/``). Images may be of any size and
any format PIL reads (the first frame of an animation).

For each pair it prints the caption and writes, under ``--out`` (default ``predictions``):

* ``<name>.png``: before and after side by side, each with the model's attention heatmap
  (``changecap_jax.decoding.attention_maps``: cross-attention from the generated words to the grid,
  averaged
  over heads, layers and words), the caption underneath;
* ``<name>.json``: the image paths, the caption, its tokens with their log-probabilities, the
  heatmap arrays (grid rows x columns) and the decoding settings.

``<name>`` is ``pair_<index>`` (``--pairs``: the row number, from 0) unless ``--name`` is given
for a single pair. ``--pairs`` is a CSV of ``before,after`` paths (an optional header row
naming them; relative paths are relative to the CSV's folder).
"""

from __future__ import annotations

import csv
import dataclasses
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from absl import app, flags
from PIL import Image, ImageDraw, UnidentifiedImageError

from changecap_jax import cli, compile_cache, console
from changecap_jax.decoding import attention_maps, search
from changecap_jax.errors import UserError
from changecap_jax.exported_model import ExportedModel, load_exported
from changecap_jax.features import grid
from changecap_jax.io import paths
from changecap_jax.io.jsonio import write_json_atomic
from changecap_jax.models.base import conditioning_shapes, decoding_rules, extra_tokens


class PredictError(UserError, ValueError):
    """Bad input to predict (unreadable image, malformed pairs file, unusable extractor)."""


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def check_image(path: str | os.PathLike) -> None:
    """Raises :func:`read_image`'s error for a missing or non-image file, from its header only
    (cheap: predict checks every input before it loads the model)."""
    path = paths.path(path)
    if not path.is_file():
        raise PredictError(f"image {path} does not exist")
    try:
        with path.open("rb") as fh, Image.open(fh):
            pass
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise PredictError(f"cannot read image {path}: {e}") from e


def read_image(path: str | os.PathLike) -> np.ndarray:
    """Any PIL-readable image file (local or in a bucket) -> uint8 (h, w, 3) RGB; errors name
    the file."""
    path = paths.path(path)
    if not path.is_file():
        raise PredictError(f"image {path} does not exist")
    try:
        with path.open("rb") as fh, Image.open(fh) as im:
            im.seek(0)
            return np.asarray(im.convert("RGB"))
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise PredictError(f"cannot read image {path}: {e}") from e


def size_mismatch(before: paths.AnyPath, after: paths.AnyPath) -> str | None:
    """A warning when the two images of a pair differ in size, else None. Each image is
    resized to the model's grid on its own, so the grid cells of the two then cover different
    parts of the scene (the datasets' pairs are always the same size)."""
    sizes = []
    for path in (before, after):
        try:
            with paths.path(path).open("rb") as fh, Image.open(fh) as im:
                sizes.append(im.size)
        except (UnidentifiedImageError, OSError):
            return None  # read_image reports the file when it is read
    if sizes[0] == sizes[1]:
        return None
    (wb, hb), (wa, ha) = sizes
    return (f"the pair's images differ in size ({before}: {wb}x{hb}, {after}: {wa}x{ha}); each "
            "is resized to the model's grid separately, so their grid cells cover different "
            "parts of the scene: crop or resize them to one size for a faithful comparison")


def read_pairs(path: str | os.PathLike) -> list[tuple[paths.AnyPath, paths.AnyPath]]:
    """``before,after`` rows of a CSV (optional header); relative paths from its folder. The
    file and the images may be local or in a bucket."""
    path = paths.path(path)
    if not path.is_file():
        raise PredictError(f"pairs file {path} does not exist")
    pairs = []
    with path.open(newline="", encoding="utf-8") as fh:
        for i, row in enumerate(csv.reader(fh)):
            cells = [c.strip() for c in row]
            if not any(cells):
                continue
            if len(cells) != 2:
                raise PredictError(f"{path} line {i + 1}: expected 2 columns (before,after), "
                                   f"got {len(cells)}: {row!r}")
            if i == 0 and [c.lower() for c in cells] == ["before", "after"]:
                continue
            pairs.append(tuple(paths.path(c) if paths.is_remote(c) or Path(c).is_absolute()
                               else path.parent / c for c in cells))
    if not pairs:
        raise PredictError(f"pairs file {path} lists no pairs")
    return pairs


class FeatureExtractor:
    """The model's training-data extractor, from the export's description."""

    def __init__(self, description: dict[str, Any], weights: str | None = None,
                 device: str | None = None):
        self.name = description["name"]
        self.feature_shape = tuple(description["feature_shape"])
        if self.name == "synthetic_grid":
            # Exports written before the grid extractor had versions used version 1.
            self.version = int(description.get("version", 1))
            if self.version not in grid.VERSIONS:
                raise PredictError(f"the model was trained on synthetic grid features of "
                                   f"version {self.version}, which this predict cannot compute "
                                   f"(it knows {list(grid.VERSIONS)})")
            return
        if self.name != "resnet101":
            raise PredictError(f"the model was trained on features of extractor "
                               f"{self.name!r}, which predict cannot compute")
        weights = weights or description.get("weights")
        if not weights:
            raise PredictError("the model uses ResNet-101 features and its export records no "
                               "weights: pass --weights=PATH (a torchvision-format state dict)")
        try:  # PyTorch is the optional extra: imported only for a ResNet-101 model
            from changecap_jax.features import extract, resnet
        except ImportError as e:
            raise PredictError("ResNet-101 features need PyTorch: pip install -r "
                               f"requirements-torch.txt ({e})") from e
        self.layer, self.std_fix = int(description["layer"]), bool(description["std_fix"])
        self._extract = extract.extract_features
        self._network = resnet.load_resnet101(weights, self.layer,
                                              device=extract.pick_device(device))

    def __call__(self, paths: Sequence[Path]) -> np.ndarray:
        """Image files -> float32 (N, H, W, C), as the dataset stored them."""
        if self.name == "synthetic_grid":
            images = [read_image(p) for p in paths]
            # One image at a time: sizes may differ (each is resized to the grid's pixels).
            feats = np.concatenate([grid.extract(im[None], self.feature_shape,
                                                 version=self.version) for im in images])
            return feats.astype(np.float32)
        for p in paths:
            read_image(p)  # a clear error before torch sees the file
        out = [f for _, f in self._extract(list(paths), self._network, self.layer,
                                           std_fix=self.std_fix)]
        return np.stack(out).transpose(0, 2, 3, 1).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Prediction
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Prediction:
    before: str
    after: str
    caption: str
    tokens: list[str]
    log_probs: list[float]  # one per token, the final END included as "<END>"
    heatmap_before: np.ndarray  # (H, W), sums to 1
    heatmap_after: np.ndarray


class Predictor:
    """An exported model ready to caption feature batches (jitted decode + heatmaps)."""

    def __init__(self, exported: ExportedModel, *, beam_size: int = 1,
                 length_penalty: float = 0.0):
        if beam_size < 1:
            raise PredictError(f"beam_size must be >= 1, got {beam_size}")
        self.exported = exported
        self.model = exported.module()
        extra_inputs = conditioning_shapes(self.model)
        if extra_inputs:
            # Such a model needs, per new pair, what data_prep computes for a dataset (e.g. a
            # retrieval over its entity list); predict has no such step yet.
            raise PredictError(
                f"the model in {exported.directory} reads per-pair inputs {sorted(extra_inputs)} "
                "beside the images; predict captions only models that read the two images. "
                "Evaluate it on a prepared dataset with python -m changecap_jax.main "
                "--mode=eval --model=DIR instead")
        self.variables = exported.variables
        self.beam_size, self.length_penalty = beam_size, length_penalty

    def decode(self, before: np.ndarray, after: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.beam_size > 1:
            out = search.beam_search(self.model, self.variables, before, after,
                                       beam_size=self.beam_size, max_len=self.exported.max_len,
                                       length_penalty=self.length_penalty)
        else:
            out = search.greedy_decode(self.model, self.variables, before, after,
                                         max_len=self.exported.max_len)
        return np.asarray(out.ids), np.asarray(out.log_probs)

    def predict(self, before: np.ndarray, after: np.ndarray,
                names: Sequence[tuple[str, str]]) -> list[Prediction]:
        """Features (N, H, W, C) of N pairs -> N predictions."""
        ids, log_probs = self.decode(before, after)
        maps = attention_maps.attention_maps(self.model, self.variables, before, after, ids)
        vocab = self.exported.vocab
        end_id, extra = decoding_rules(self.model).end_id, extra_tokens(self.model)
        out = []
        for i, (b, a) in enumerate(names):
            # The words stop at END, written as 0 (trunk rule) or kept as END followed by the
            # raw ids of a model that decodes all steps.
            row = [int(t) for t in ids[i, 1:]]
            n = next((j for j, t in enumerate(row) if t in (0, end_id)), len(row))
            tokens = [vocab.id_to_word[t] if t in vocab.id_to_word else extra[t]
                      for t in row[:n]]
            lps = [float(x) for x in log_probs[i, 1:n + 2]][: n + 1]
            if n < len(row):  # END was emitted: its log-prob is the last one
                tokens = [*tokens, "<END>"]
            out.append(Prediction(b, a, vocab.decode(ids[i], extra), tokens, lps[: len(tokens)],
                                  maps.before[i], maps.after[i]))
        return out


def render_pair(before_img: np.ndarray, after_img: np.ndarray, prediction: Prediction,
                height: int = 256) -> Image.Image:
    """Before | after, each with its heatmap, and the caption underneath."""
    panels = []
    for image, heat, label in ((before_img, prediction.heatmap_before, "before"),
                               (after_img, prediction.heatmap_after, "after")):
        width = max(1, round(image.shape[1] * height / image.shape[0]))
        resized = np.asarray(Image.fromarray(image).resize((width, height), Image.BILINEAR))
        panel = Image.fromarray(attention_maps.overlay(resized, heat))
        ImageDraw.Draw(panel).text((6, 4), label, fill=(255, 255, 255))
        panels.append(panel)
    gap, strip = 8, 28
    canvas = Image.new("RGB", (panels[0].width + gap + panels[1].width, height + strip),
                       (255, 255, 255))
    canvas.paste(panels[0], (0, 0))
    canvas.paste(panels[1], (panels[0].width + gap, 0))
    ImageDraw.Draw(canvas).text((6, height + 8), prediction.caption or "(empty caption)",
                                fill=(0, 0, 0))
    return canvas


def write_prediction(out_dir: paths.AnyPath, name: str, prediction: Prediction,
                     before_img: np.ndarray, after_img: np.ndarray,
                     settings: dict[str, Any]) -> tuple[paths.AnyPath, paths.AnyPath]:
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / f"{name}.png"
    canvas = render_pair(before_img, after_img, prediction)
    paths.write_atomic(png, lambda fh: canvas.save(fh, format="PNG"), binary=True)
    record = {
        "before": prediction.before, "after": prediction.after, "caption": prediction.caption,
        "tokens": [{"token": t, "log_prob": lp}
                   for t, lp in zip(prediction.tokens, prediction.log_probs, strict=True)],
        "log_prob": float(sum(prediction.log_probs)),
        "heatmap_before": prediction.heatmap_before.round(6).tolist(),
        "heatmap_after": prediction.heatmap_after.round(6).tolist(),
        "grid": list(prediction.heatmap_before.shape),
        **settings,
    }
    path = out_dir / f"{name}.json"
    write_json_atomic(path, record, indent=1)
    return png, path


def predict_pairs(model_dir: str | os.PathLike, pairs: Sequence[tuple[Path, Path]],
                  out_dir: str | os.PathLike, *, names: Sequence[str] | None = None,
                  beam_size: int = 1, length_penalty: float = 0.0, batch_size: int = 16,
                  weights: str | None = None, device: str | None = None,
                  progress: bool = True) -> list[Prediction]:
    """Captions, heatmaps and files for ``pairs`` of image paths (see the module docstring)."""
    for pair in pairs:
        for path in pair:
            check_image(path)
    exported = load_exported(model_dir)
    extractor = FeatureExtractor(exported.extractor, weights, device)
    predictor = Predictor(exported, beam_size=beam_size, length_penalty=length_penalty)
    names = list(names) if names is not None else [f"pair_{i:04d}" for i in range(len(pairs))]
    model_name = (os.fspath(model_dir) if paths.is_remote(model_dir)
                  else str(Path(model_dir).resolve()))
    settings = {"model": model_name, "step": exported.step,
                "beam_size": beam_size, "length_penalty": length_penalty}
    results: list[Prediction] = []
    bar = console.Progress(total=len(pairs), desc="predict", disable=not progress or len(pairs) < 2)
    for before, after in pairs:
        warning = size_mismatch(paths.path(before), paths.path(after))
        if warning:
            logging.warning("%s", warning)
    for start in range(0, len(pairs), batch_size):
        chunk = list(pairs[start:start + batch_size])
        feats_b = extractor([b for b, _ in chunk])
        feats_a = extractor([a for _, a in chunk])
        pad = batch_size - len(chunk) if len(pairs) > batch_size else 0
        if pad:  # one batch shape for every chunk: one compilation
            feats_b = np.concatenate([feats_b, np.repeat(feats_b[-1:], pad, axis=0)])
            feats_a = np.concatenate([feats_a, np.repeat(feats_a[-1:], pad, axis=0)])
        preds = predictor.predict(feats_b, feats_a, [(str(b), str(a)) for b, a in chunk])
        for (b, a), name, pred in zip(chunk, names[start:], preds, strict=False):
            write_prediction(paths.path(out_dir), name, pred, read_image(b), read_image(a),
                             settings)
            results.append(pred)
        bar.update(len(chunk))
    bar.close()
    return results


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    if f.pairs and (f.before or f.after):
        raise app.UsageError("give --pairs or --before/--after, not both")
    if f.pairs:
        pairs, names = read_pairs(f.pairs), None
    elif f.before and f.after:
        pairs, names = [(paths.path(f.before), paths.path(f.after))], [f.name or "pair_0000"]
    else:
        raise app.UsageError("give --before=IMG --after=IMG, or --pairs=FILE.csv")
    results = predict_pairs(f.model, pairs, f.out, names=names, beam_size=f.beam_size,
                            length_penalty=f.length_penalty, batch_size=f.batch_size,
                            weights=f.weights, device=f.device)
    for pred in results:
        print(f"{pred.before} -> {pred.after}: {pred.caption}")
    print(f"wrote {len(results)} pair(s) to {f.out}")


if __name__ == "__main__":
    # The flags exist only when this module is the program (importing it defines none).
    flags.DEFINE_string("model", None, "Exported model directory.", required=True)
    flags.DEFINE_string("before", None, "Before image.")
    flags.DEFINE_string("after", None, "After image.")
    flags.DEFINE_string("pairs", None, "CSV of before,after image paths.")
    flags.DEFINE_string("name", None, "Output name for a single pair (default pair_0000).")
    flags.DEFINE_string("out", "predictions", "Output directory.")
    flags.DEFINE_integer("beam_size", 1, "Beam size (1 = greedy).")
    flags.DEFINE_float("length_penalty", 0.0, "GNMT length penalty alpha for beams.")
    flags.DEFINE_integer("batch_size", 16, "Pairs per decoding batch.")
    flags.DEFINE_string("weights", None, "ResNet-101 weights (overrides the export's).")
    flags.DEFINE_string("device", None, "torch device for ResNet-101 (default: cuda if any).")
    compile_cache.enable()
    cli.run(main)
