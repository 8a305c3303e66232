"""An oracle retrieval for the synthetic set: CHEERS fed the right change entities.

    python -m data_prep.oracle_entities --out_data_dir=DIR [--data_dir=SRC] \\
        [--variant=moderate] [--fraction=1.0 --seed=0]

CHEERS reads the top-k entities of a retrieval (paper §3.1.2, Eq. 1); on the synthetic set the
trained retrieval rarely names the changed object (``data_prep.entity_recall``:
recall@3 15.7 % on the test split). This command asks what the model does when the retrieval
is right. It writes a copy of a prepared synthetic dataset under ``DIR`` (every file a symbolic
link to the source, except ``entity_retrieval/``) whose retrieval is the source's with one
change: for each semantic pair, the entities that refer to the changed object
(:func:`entity_recall.true_entities`) come first, in the source's rank order where it ranked
them, then by id; the remaining slots keep the source's ranking. Distractor orientations are
kept as they are (nothing changed in them: there is no right entity to give). Train on it with
``--config.dataset.data_dir=DIR`` (docs/ablations.md, "CHEERS, measured piece by piece").

``--fraction=F`` gives the oracle's order to a random F of each split's semantic pairs (drawn
with ``--seed``) and keeps the source's ranking for the others: a retrieval between the trained
one and the oracle, to measure how CHEERS' score grows with the retrieval's recall.

The true entities need the scene of each record, which only the synthetic builder regenerates
(``builder.make_example``); real datasets have no oracle here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from changecap_jax.data import entity_inputs
from changecap_jax.io.jsonio import replaced_folder
from data_prep import entity_recall

ORACLE_BACKBONE = "oracle"


def oracle_ids(stored: np.ndarray, relevant: np.ndarray) -> np.ndarray:
    """(N, k) ids: each row's relevant entities first (stored rank order, then by id), then
    the row's stored ids that are not already placed, in their order.

    ``stored``: (N, k) ids best first; ``relevant``: (N, M) bool, the true entities of a row.
    """
    n, k = stored.shape
    out = np.empty_like(stored)
    for i in range(n):
        true_ids = np.flatnonzero(relevant[i])
        ranked_first = [int(e) for e in stored[i] if relevant[i, e]]
        rest_true = [int(e) for e in true_ids if int(e) not in ranked_first]
        chosen = (ranked_first + rest_true)[:k]
        fill = [int(e) for e in stored[i] if int(e) not in chosen]
        out[i] = (chosen + fill)[:k]
    return out


def _link_tree(source: Path, target: Path) -> None:
    """``target`` mirrors ``source`` as symbolic links, except the retrieval folder."""
    target.mkdir(parents=True, exist_ok=True)
    for entry in source.iterdir():
        if entry.name in (entity_inputs.RETRIEVAL_DIR,) or entry.name.startswith("."):
            continue
        link = target / entry.name
        if link.is_symlink() or link.exists():
            continue
        os.symlink(entry.resolve(), link)


def _check_fraction(fraction: float) -> None:
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"oracle fraction must lie in [0, 1], got {fraction}")


def oracle_rows(num_rows: int, fraction: float, seed: int, split_index: int) -> np.ndarray:
    """(num_rows,) bool: the ``round(fraction * num_rows)`` rows of a split that get the
    oracle's order, drawn from (seed, split_index) so each split's draw is its own."""
    _check_fraction(fraction)
    chosen = np.zeros(num_rows, bool)
    order = np.random.default_rng([seed, split_index]).permutation(num_rows)
    chosen[order[:round(fraction * num_rows)]] = True
    return chosen


def write_oracle(dataset: Any, out_dataset_dir: Path, fraction: float = 1.0,
                 seed: int = 0) -> dict[str, Any]:
    """Writes ``out_dataset_dir`` (links to ``dataset``'s files plus an oracle
    ``entity_retrieval/``) and returns the oracle's meta.json content, which records per
    split the fraction of semantic pairs with a true entity among the written top k (the
    written retrieval's recall@k; with ``fraction`` 1 also the oracle's ceiling).
    ``fraction`` < 1 orders only that share of each split's semantic pairs
    (:func:`oracle_rows`); the others keep the source's ids."""
    from changecap_jax.data.synthetic import builder as synthetic_builder

    _check_fraction(fraction)
    stored = entity_inputs.load(dataset.directory)
    config = dataset.builder.builder_config
    table = entity_recall._attribute_table(stored.texts)
    _link_tree(dataset.directory, out_dataset_dir)
    coverage = {}
    with replaced_folder(out_dataset_dir, entity_inputs.RETRIEVAL_DIR) as tmp:
        for split_index, split in enumerate(stored.meta["splits"]):
            kept = stored.split(split)
            relevant = np.zeros((len(kept.record_ids), len(stored.texts)), bool)
            for i, record_id in enumerate(kept.record_ids):
                obj, scene = entity_recall.changed_object(
                    synthetic_builder.make_example(config, int(record_id)))
                relevant[i] = entity_recall.true_entities(stored.texts, obj, scene, table)
            arrays = {"record_ids": kept.record_ids}
            chosen = oracle_rows(len(kept.record_ids), fraction, seed, split_index)
            for o in stored.orientations:
                ids = kept.ids[o]
                if o == "semantic":
                    ids = np.where(chosen[:, None], oracle_ids(ids, relevant), ids)
                arrays[f"ids_{o}"] = ids.astype(np.int32)
                # The oracle has no Eq. 1 score; the source's scores keep their places.
                arrays[f"scores_{o}"] = kept.scores[o]
                arrays[f"constrained_{o}"] = kept.constrained[o]
            np.savez(tmp / f"{split}.npz", **arrays)
            coverage[split] = float(np.take_along_axis(relevant, arrays["ids_semantic"], 1)
                                    .any(1).mean())
        np.save(tmp / "embeddings.npy", stored.embeddings)
        (tmp / "texts.json").write_text(json.dumps(stored.texts))
        meta = {**stored.meta, "backbone": ORACLE_BACKBONE,
                "backbone_details": {"name": ORACLE_BACKBONE,
                                     "source": str(dataset.directory),
                                     "source_backbone": stored.meta["backbone"],
                                     "fraction": fraction, "seed": seed,
                                     "semantic_pairs_with_a_true_entity": coverage}}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1, allow_nan=False))
    return meta


def main(argv: Sequence[str] | None = None) -> int:
    from changecap_jax.data import datasets

    parser = argparse.ArgumentParser(prog="python -m data_prep.oracle_entities",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out_data_dir", required=True,
                        help="Root of the copy (pass it as --config.dataset.data_dir).")
    parser.add_argument("--data_dir", default=None, help="The source dataset's root.")
    parser.add_argument("--variant", default="")
    parser.add_argument("--fraction", type=float, default=1.0,
                        help="Share of each split's semantic pairs given the oracle's order "
                             "(the others keep the source's ranking).")
    parser.add_argument("--seed", type=int, default=0, help="Draws the --fraction rows.")
    args = parser.parse_args(argv)
    try:
        _check_fraction(args.fraction)
    except ValueError as e:
        parser.error(str(e))
    dataset = datasets.prepare("synthetic", args.data_dir, args.variant,
                               build_if_missing=False)
    root = Path(datasets.default_data_dir() if not args.data_dir else args.data_dir)
    relative = Path(dataset.directory).resolve().relative_to(root.resolve())
    target = Path(args.out_data_dir) / relative
    meta = write_oracle(dataset, target, args.fraction, args.seed)
    cover = meta["backbone_details"]["semantic_pairs_with_a_true_entity"]
    print(f"wrote {target} (semantic pairs with a true entity in the top k: "
          + ", ".join(f"{s} {100 * v:.1f}%" for s, v in cover.items()) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
