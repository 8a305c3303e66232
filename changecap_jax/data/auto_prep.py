"""First-use preparation of the per-model files of the built-in synthetic dataset.

CHEERS reads retrieved change entities (``entities.json``, ``entity_retrieval/``) and IDC-PCL's
FDA pretraining reads hard negatives (``<split>_neg_tfidf6.json``), beside the dataset. For a
real dataset a person makes them with the commands (``python -m data_prep.entities``,
``data_prep.retrieval``, ``data_prep.hard_negatives``), which take choices (a CLIP checkpoint,
a spaCy pipeline); for the synthetic set nothing needs deciding, so a trainer that finds them
missing makes them here: the commands' functions with the commands' defaults, so the files are
the ones the commands would write (``tests/test_auto_prep.py`` compares them), with the same
progress bars and summaries (logged).

Each runs holding the dataset's lock (``data/building.py``), as the commands do: a second
process waits, then uses the result. Files are written atomically (a temp file or folder renamed
at the end), so an interruption leaves nothing half-written; the temp leftovers of a killed run
are removed by the next.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from changecap_jax.data import building, entity_inputs, negatives
from changecap_jax.prep import entities, entity_retrieval
from changecap_jax.prep import hard_negatives as hn


def _remove_temp_files(directory: Path, names: list[str], what: str) -> None:
    """Temp files and folders of killed writers of ``names`` (``jsonio``: ``.<name>.*``)."""
    building.remove_leftovers([p for name in names for p in directory.glob(f".{name}.*")], what)


def retrieval_exists(directory: Path) -> bool:
    return (directory / entity_inputs.RETRIEVAL_DIR / "meta.json").exists()


def make_entity_inputs(dataset: Any, count: int) -> None:
    """Writes ``entities.json`` (unless present) and ``entity_retrieval/`` of ``dataset`` (a
    ``PreparedDataset``), as ``python -m data_prep.entities`` then ``python -m
    data_prep.retrieval`` with their defaults would (``--k=count`` when the model reads more
    than the default 3 entities)."""
    directory = dataset.directory
    what = building.name_of(directory)
    with building.dataset_lock(directory, what):
        if retrieval_exists(directory):
            return  # made by another process while this one waited
        _remove_temp_files(directory, [entities.ENTITIES_FILE, entity_inputs.RETRIEVAL_DIR],
                           what)
        logging.info("%s has no retrieved change entities: making them (first use), as "
                     "python -m data_prep.entities and then data_prep.retrieval would", what)
        if not (directory / entities.ENTITIES_FILE).exists():
            path, extraction = entities.save_dataset_entities(dataset)
            logging.info("change entities of the train change captions:\n%s\nwritten: %s",
                         extraction.summary(), path)
        meta = entity_retrieval.run_retrieval(dataset, k=max(entity_retrieval.DEFAULT_K, count))
        logging.info("entity retrieval (%s, k=%d, %s): %d entities\n%s\nwritten: %s",
                     meta["backbone"], meta["k"], meta["difference"], meta["num_entities"],
                     entity_retrieval.format_accuracy(meta),
                     directory / entity_inputs.RETRIEVAL_DIR)


def make_hard_negatives(dataset: Any) -> list[Path]:
    """Writes the missing ``<split>_neg_tfidf6.json`` of ``dataset`` (a ``PreparedDataset``),
    as ``python -m data_prep.hard_negatives`` with its defaults would (a split's file depends
    only on the train captions and that split's: the present ones are kept). Returns the
    files written."""
    directory = dataset.directory
    what = building.name_of(directory)
    with building.dataset_lock(directory, what):
        splits = list(dataset.builder.info.splits)
        missing = [s for s in splits if not negatives.negatives_path(directory, s).exists()]
        if not missing:
            return []
        _remove_temp_files(directory, [negatives.negatives_path(directory, s).name
                                       for s in missing], what)
        logging.info("%s has no hard negatives for %s: making them (first use), as python -m "
                     "data_prep.hard_negatives would", what, ", ".join(missing))
        result = hn.generate(dataset, splits=missing, progress=True)
        logging.info("hard negatives:\n%s", hn.format_summary(result.summary))
        written = []
        for split, records in result.records.items():
            path = negatives.negatives_path(directory, split)
            hn.write_negatives(records, path)
            logging.info("wrote %d pairs x %d negatives to %s", len(records),
                         negatives.NUM_NEGATIVES, path)
            written.append(path)
        return written
