"""``--evaluate=SPLIT``: after the steps, both trained models caption a split and are scored
the trainer's way, so a run of the official modules on the project's batches says whether they
learn where ours does (or does not), not just whether the losses agree.

Both sides are decoded by the project's decoder (the official final weights converted by the
converter, as ``python -m changecap_jax convert`` would): the decoders' parity is checked
elsewhere (tests/test_idc_pcl_convert.py: greedy ids), so a difference between the two rows
comes from the training. Each side's captions and metrics files are written under
``OUT/ours`` and ``OUT/official`` (``captions/SPLIT_STEP.json``, ``metrics/...``).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np

from changecap_jax.models import precision
from changecap_jax.trainers import update
from changecap_jax.trainers.captioning import Trainer

SIDES = ("ours", "official")
GROUPS = ("semantic", "no_change")  # subsets of the metrics files, besides the total


def caption_spread(captions_file: Path) -> dict[str, Any]:
    """How many different captions a split got, and the share of the most frequent one (1.0:
    the model writes one caption for every pair)."""
    import json

    entries = json.loads(captions_file.read_text())
    counts = Counter(e["caption"] for e in entries)
    caption, top = counts.most_common(1)[0]
    return {"distinct_captions": len(counts), "top_caption": caption,
            "top_caption_share": top / len(entries)}


def evaluate_sides(config: ml_collections.ConfigDict, params: dict[str, Any], step: int,
                   out: Path, splits: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """side -> split -> {CIDEr x100, its semantic / no-change values, the caption spread} for
    each side in ``params`` ("ours", "official"); writes
    each side's captions and metrics under ``out / side``."""
    results: dict[str, dict[str, Any]] = {}
    for side in (s for s in SIDES if s in params):
        trainer = Trainer(config, out / side)
        cast = precision.cast_floating(jax.device_get(params[side]), np.float32)
        state = update.TrainState(step=np.int32(step), params=cast, opt_state=None, rng=None)
        results[side] = {}
        for split in splits:
            metrics = trainer.evaluate(state, split, step)
            row = {"CIDEr": metrics["CIDEr"]}
            row.update({f"CIDEr_{g}": metrics[g]["CIDEr"] for g in GROUPS if g in metrics})
            row.update(caption_spread(out / side / "captions" / f"{split}_{step}.json"))
            results[side][split] = row
    return results


def format_results(results: dict[str, dict[str, Any]]) -> str:
    """One line per side and split."""
    lines = []
    for side, by_split in results.items():
        for split, r in by_split.items():
            groups = ", ".join(f"{g} {r[f'CIDEr_{g}']:.1f}" for g in GROUPS
                               if f"CIDEr_{g}" in r)
            lines.append(f"{side:>8} {split}: CIDEr {r['CIDEr']:.1f} ({groups}); "
                         f"{r['distinct_captions']} distinct captions, the most frequent on "
                         f"{r['top_caption_share']:.0%} of the pairs: {r['top_caption']!r}")
    return "\n".join(lines)
