"""Does the model look at what changed? ``python -m changecap_jax localize --model=DIR``.

On a dataset whose records carry the changed object's boxes (the synthetic set), decodes the
semantic-change pairs of a split with an exported model, takes each pair's attention heatmap
(``explain``), and plays the pointing game with it: does the heatmap's peak lie inside the
changed object's box in the before or the after image? A peak cell scores its area share
inside the boxes and tied peaks share the score, as in the difficulty bins
(``difficulty.pointing_score``). The baseline is a uniform map: it scores the boxes' share of
the image. Printed per change type.

    --model=DIR        an exported model (python -m changecap_jax export)
    --split=test       which split
    --beam_size=1      decoding (1 = greedy)
    --data_dir=DIR     where the dataset is, if not where the model was trained
"""

from __future__ import annotations

import os
from collections import defaultdict

import numpy as np
from absl import app, flags

from changecap_jax import cli, compile_cache, console
from changecap_jax.commands.predict import Predictor
from changecap_jax.data import datasets
from changecap_jax.decoding import attention_maps
from changecap_jax.exported_model import load_exported


def measure(model_dir: str | os.PathLike, split: str = "test", *, beam_size: int = 1,
            batch_size: int = 50, data_dir: str | None = None
            ) -> dict[str, attention_maps.Localization]:
    """{"all": ..., <change type>: ...} localization of a split's semantic pairs."""
    exported = load_exported(model_dir)
    dataset = datasets.prepare_config(exported.config.dataset, build_if_missing=False,
                                      data_dir=data_dir)
    if dataset.vocab != exported.vocab:
        raise datasets.DatasetError(f"dataset in {dataset.directory} has another vocabulary "
                                    f"than the model in {model_dir}")
    source = dataset.split(split)
    if len(source) == 0 or "bbox_before" not in source[0]:
        raise datasets.DatasetError(
            f"dataset {dataset.name!r} records no changed-object boxes: localization needs them "
            f"(the synthetic set has; CLEVR-Change when built with change_captions_with_bbox.json)")
    if dataset.meta.image_size is None:
        raise datasets.DatasetError(f"dataset {dataset.name!r} does not record its image size")
    predictor = Predictor(exported, beam_size=beam_size)
    heat, boxes_b, boxes_a, types = [], [], [], []
    for start in console.Progress(range(0, len(source), batch_size), desc=f"localize {split}"):
        records = [source[i] for i in range(start, min(start + batch_size, len(source)))]
        take = records + [records[-1]] * (batch_size - len(records))  # one shape, one compile
        before = np.stack([r["before"] for r in take]).astype(np.float32)
        after = np.stack([r["after_semantic"] for r in take]).astype(np.float32)
        ids, _ = predictor.decode(before, after)
        maps = attention_maps.attention_maps(predictor.model, predictor.variables, before,
                                             after, ids)
        for j, r in enumerate(records):
            # Peak over both images' maps (identical for a shared-grid memory).
            heat.append(maps.before[j] + maps.after[j])
            boxes_b.append(r["bbox_before"])
            boxes_a.append(r["bbox_after"])
            types.append(dataset.meta.change_types[int(r["change_type"])])
    heat, boxes_b, boxes_a = np.stack(heat), np.stack(boxes_b), np.stack(boxes_a)
    size = tuple(dataset.meta.image_size)
    groups: dict[str, list[int]] = defaultdict(list)
    for i, t in enumerate(types):
        groups[t].append(i)
    results = {"all": attention_maps.localization(heat, boxes_b, boxes_a, size)}
    for t in dataset.meta.change_types:
        if groups.get(t):
            idx = np.array(groups[t])
            results[t] = attention_maps.localization(heat[idx], boxes_b[idx], boxes_a[idx], size)
    return results


def format_results(results: dict[str, attention_maps.Localization]) -> str:
    lines = [f"{'pairs':<10}{'n':>6}{'pointing':>14}{'uniform':>10}"]
    for name, r in results.items():
        lines.append(f"{name:<10}{r.num_pairs:>6}{100 * r.hit_rate:>13.1f}%"
                     f"{100 * r.uniform_rate:>9.1f}%")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    print(format_results(measure(f.model, f.split, beam_size=f.beam_size,
                                 data_dir=f.data_dir)))


if __name__ == "__main__":
    # The flags exist only when this module is the program (importing it defines none).
    flags.DEFINE_string("model", None, "Exported model directory.", required=True)
    flags.DEFINE_string("split", "test", "Split.")
    flags.DEFINE_integer("beam_size", 1, "Beam size (1 = greedy).")
    flags.DEFINE_string("data_dir", None, "Dataset root, if not the training one.")
    compile_cache.enable()
    cli.run(main)
