"""One static HTML page of an evaluation: ``python -m changecap_jax report --workdir=DIR``.

    --workdir=DIR     a training (or convert) workdir: config.json, checkpoints/, metrics/,
                      captions/ and scalars.jsonl, as the trainer writes them
    --split=test      the evaluated split
    --step=N          the evaluation step (default: the latest with a captions file)
    --out=PATH        the page (default DIR/report_<split>_<step>.html)
    --max_gallery=N   pairs shown, the worst by CIDEr first (default 500)

The page (``report_html``) has the metric table (total and per change type), learning curves
of every logged scalar, and a gallery of pairs sortable by per-pair CIDEr (worst first):
generated caption, references and, where the dataset keeps its images (the synthetic set),
the before and after images with the model's attention heatmap (``explain``), computed from
the checkpoint of that step over the generated caption. No server, no external assets.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import re
from typing import Any

import jax
import numpy as np
from absl import app, flags
from PIL import Image

from changecap_jax import cli, compile_cache, console, experiment, exported_model
from changecap_jax.commands.report_html import GalleryEntry, write_report
from changecap_jax.data import image_files
from changecap_jax.data.vocab import START_ID
from changecap_jax.decoding import attention_maps
from changecap_jax.errors import UserError
from changecap_jax.evaluators import captions
from changecap_jax.io import checkpoints, metric_writer, paths, run_config
from changecap_jax.io.jsonio import read_json

THUMBNAIL_HEIGHT = 160


class ReportError(UserError, ValueError):
    """A workdir that lacks what the report needs (the message says what)."""


def read_curves(path: paths.AnyPath) -> dict[str, list[tuple[int, float]]]:
    """scalars.jsonl -> name -> [(step, value)], the last value logged for a step winning
    (a resumed run logs some steps again)."""
    curves: dict[str, dict[int, float]] = {}
    if not path.exists():
        return {}
    for n, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            step = int(row.pop("step"))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ReportError(f"{path} line {n + 1} is not a scalars record: {e}") from e
        for name, value in row.items():
            curves.setdefault(name, {})[step] = math.nan if value is None else float(value)
    return {name: sorted(points.items()) for name, points in sorted(curves.items())}


def latest_evaluated_step(workdir: paths.AnyPath, split: str) -> int:
    steps = [int(m.group(1)) for p in (workdir / "captions").glob(f"{split}_*.json")
             if (m := re.fullmatch(rf"{re.escape(split)}_(\d+)\.json", p.name))]
    if not steps:
        raise ReportError(f"no evaluation of split {split!r} in {workdir / 'captions'}: run "
                          f"--mode=eval (or train with it in final_eval_splits) first")
    return max(steps)


def _thumbnail(image: np.ndarray) -> bytes:
    """A JPEG thumbnail (a fifth of a PNG's size for these renders: the page stays small)."""
    h, w = image.shape[:2]
    width = max(1, round(w * THUMBNAIL_HEIGHT / h))
    buf = io.BytesIO()
    Image.fromarray(image).resize((width, THUMBNAIL_HEIGHT), Image.BILINEAR).save(
        buf, format="JPEG", quality=85)
    return buf.getvalue()


def caption_ids(caption: str, vocab: Any, max_len: int) -> np.ndarray:
    """A generated caption back to decoder ids (START, words, 0 from END on, as decoding
    writes them); decoded captions never hold UNK, so this is exact."""
    ids = np.zeros((max_len,), np.int32)
    ids[0] = START_ID
    words = [vocab.word_to_id[w] for w in caption.split()][: max_len - 1]
    ids[1:1 + len(words)] = words
    return ids


def _orientation(after_key: str) -> str:
    return after_key.removeprefix("after_")  # after_semantic -> semantic, as record fields


def heatmap_images(exp: experiment.Experiment, params: Any,
                   pairs: list[tuple[dict, str, str]], batch_size: int) -> list[dict[str, bytes]]:
    """For (record, after key, caption) triples: before / after JPEG thumbnails with the
    heatmap of the caption drawn over them (empty dicts where the images are not kept)."""
    dataset, model = exp.dataset, exp.model
    out: list[dict[str, bytes]] = [{} for _ in pairs]
    todo = [i for i, (record, _, _) in enumerate(pairs)
            if image_files.image_paths(dataset, record) is not None]
    for start in console.Progress(range(0, len(todo), batch_size), desc="heatmaps",
                                  dynamic_ncols=True):
        chunk = todo[start:start + batch_size]
        take = chunk + [chunk[-1]] * (batch_size - len(chunk))  # one shape: one compile
        before = np.stack([pairs[i][0]["before"] for i in take]).astype(np.float32)
        after = np.stack([pairs[i][0][pairs[i][1]] for i in take]).astype(np.float32)
        ids = np.stack([caption_ids(pairs[i][2], dataset.vocab, exp.max_len) for i in take])
        # A model's extra per-pair inputs: the record's field of the pair's orientation.
        conditioning = {c: np.stack([pairs[i][0][f"{c}_{_orientation(pairs[i][1])}"]
                                     for i in take]) for c in exp.conditioning}
        maps = attention_maps.attention_maps(model, {"params": params}, before, after, ids,
                                      conditioning)
        for j, i in enumerate(chunk):
            record, after_key, _ = pairs[i]
            files = image_files.image_paths(dataset, record)
            images = {}
            for name, key, heat in (("before", "before", maps.before[j]),
                                    ("after", after_key, maps.after[j])):
                with Image.open(files[key]) as im:
                    pixels = np.asarray(im.convert("RGB"))
                    images[name] = _thumbnail(attention_maps.overlay(pixels, heat))
            out[i] = images
    return out


def build_report(workdir: str | os.PathLike, split: str = "test", step: int | None = None,
                 out: str | os.PathLike | None = None,
                 max_gallery: int = 500) -> paths.AnyPath:
    """Writes the page of ``split``'s evaluation at ``step`` (see the module docstring)."""
    workdir = paths.path(workdir)
    if not workdir.is_dir():
        raise ReportError(f"workdir {workdir} does not exist; pass the --workdir of a training "
                          "run (python -m changecap_jax.main --workdir=...)")
    step = latest_evaluated_step(workdir, split) if step is None else step
    captions_path = workdir / "captions" / f"{split}_{step}.json"
    metrics_path = workdir / "metrics" / f"{split}_{step}.json"
    for path in (captions_path, metrics_path):
        if not path.exists():
            raise ReportError(f"{path} does not exist: no evaluation of {split!r} at step "
                              f"{step}")
    entries = read_json(captions_path, "captions file")
    metrics = read_json(metrics_path, "metrics file")
    config = run_config.load_workdir_config(workdir)
    records = [captions.PairCaption(e["image_id"], e["caption"], list(e["references"]),
                                      e.get("change_type", "")) for e in entries]
    cider = captions.per_pair_cider(records)

    exp = experiment.build(config)
    params = checkpoint_params(workdir, exp, step)
    images: list[dict[str, bytes]] = [{} for _ in entries]
    if params is not None:
        pairs = gallery_pairs(exp, split, entries, captions_path)
        images = heatmap_images(exp, params, pairs, config.eval_batch_size)

    # The inputs a model read beside the images (e.g. retrieved entities), as evaluation
    # wrote them into the captions file.
    extras = [{"retrieved entities": ", ".join(e["entities"])} if "entities" in e else {}
              for e in entries]
    gallery = [GalleryEntry(image_id=r.image_id, caption=r.caption, references=r.references,
                            change_type=r.change_type, cider=cider[r.image_id], images=im,
                            extra=x)
               for r, im, x in zip(records, images, extras, strict=True)]
    where = workdir if paths.is_remote(workdir) else workdir.resolve()
    notes = [f"workdir {where}", f"split {split}, step {step}",
             f"model {config.model.name}, dataset {exp.dataset.name}",
             "heatmaps: decoder cross-attention from the generated words to the grid, averaged "
             "over heads, layers and words (changecap_jax.decoding.attention_maps)"]
    out = paths.path(out) if out else workdir / f"report_{split}_{step}.html"
    write_report(out, title=f"{config.model.name} on {exp.dataset.name} / {split} @ {step}",
                 metrics=metrics, curves=read_curves(workdir / metric_writer.SCALARS_FILE),
                 gallery=gallery, notes=notes, max_gallery=max_gallery)
    if not paths.is_remote(out):
        os.chmod(out, 0o644)  # a page to share (the atomic write creates it 0600)
    return out


def checkpoint_params(workdir: paths.AnyPath, exp: experiment.Experiment,
                      step: int) -> Any | None:
    """The host parameters of checkpoint ``step``, or None (with a warning) when it is not
    kept or is damaged: the captions are scored, so the page is made without heatmaps."""
    directory = workdir / checkpoints.CHECKPOINTS_DIR
    if step not in checkpoints.steps(directory):
        logging.warning("checkpoint %d is not kept in %s: the gallery has no heatmaps", step,
                        directory)
        return None
    like = exported_model.abstract_params(exp.model, exp.dataset.meta, exp.max_len)
    try:
        _, params = checkpoints.restore_params(workdir, like, step=step)
    except checkpoints.CheckpointError as e:
        logging.warning("%s; the gallery has no heatmaps", e)
        return None
    return jax.device_get(params)


def gallery_pairs(exp: experiment.Experiment, split: str, entries: list[dict[str, Any]],
                  captions_path: paths.AnyPath) -> list[tuple[dict, str, str]]:
    """(record, after key, caption) of each captions-file entry; an id ending in "_n" is the
    distractor pair of its record."""
    source = exp.dataset.split(split)
    by_id = {}
    for i in range(len(source)):
        record = source[i]
        by_id[record["image_id"].decode()] = record
    pairs = []
    for e in entries:
        base, distractor = (e["image_id"][:-2], True) if e["image_id"].endswith("_n") \
            else (e["image_id"], False)
        if base not in by_id:
            raise ReportError(f"{captions_path}: image id {e['image_id']!r} is not in "
                              f"split {split!r} of the dataset")
        pairs.append((by_id[base], "after_distractor" if distractor else "after_semantic",
                      e["caption"]))
    return pairs


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    path = build_report(f.workdir, f.split, f.step, f.out, f.max_gallery)
    print(f"wrote {path}")


if __name__ == "__main__":
    # The flags exist only when this module is the program (importing it defines none).
    flags.DEFINE_string("workdir", None, "Workdir of the run.", required=True)
    flags.DEFINE_string("split", "test", "Evaluated split.")
    flags.DEFINE_integer("step", None, "Evaluation step (default: the latest).")
    flags.DEFINE_string("out", None, "Output HTML (default WORKDIR/report_SPLIT_STEP.html).")
    flags.DEFINE_integer("max_gallery", 500, "Pairs in the gallery (worst CIDEr first).")
    compile_cache.enable()
    cli.run(main)
