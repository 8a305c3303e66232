"""The per-model files of the built-in synthetic dataset, made when training asks for them.

CHEERS reads retrieved change entities (``entities.json``, ``entity_retrieval/``) and IDC-PCL's
FDA pretraining reads hard negatives (``<split>_neg_tfidf6.json``), beside the dataset. For a
real dataset a person makes them with the commands (``python -m data_prep.entities``,
``data_prep.retrieval``, ``data_prep.hard_negatives``), which take choices (a CLIP checkpoint,
a spaCy pipeline); for the synthetic set nothing needs deciding, so the training command
(``changecap_jax/main.py``) calls :func:`prepare` before it builds the run, and the missing
files are made here: the commands' functions with the commands' defaults, so the files are the
ones the commands would write (``tests/test_first_use.py`` compares them), with the same
progress bars and summaries (logged). Nothing else prepares: the library only reads these
files, and a command that finds them missing (export, report, evaluation) says which command
makes them.

Each runs holding the dataset's lock (``data/building.py``), as the commands do: a second
process waits, then uses the result. Files are written atomically (a temp file or folder renamed
at the end), so an interruption leaves nothing half-written; the temp leftovers of a killed run
are removed by the next.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import ml_collections

from changecap_jax import models
from changecap_jax.data import building, datasets, entity_inputs, negatives
from changecap_jax.models.base import conditioning_shapes
from data_prep.methods import change_entities as entities
from data_prep.methods import entity_retrieval
from data_prep.methods import negative_mining as hn


def prepare(config: ml_collections.ConfigDict) -> list[str]:
    """Makes the files the config's model or task reads beside the built-in synthetic set when
    they are missing (retrieved entities for a model with an ``entities`` input; hard
    negatives for pretraining with the ``fda`` task); returns what it made. Other datasets,
    and a synthetic config with ``dataset.build_if_missing=False``, are left as they are (the
    run then reads the files or stops naming the command that makes them)."""
    ds = config.dataset
    if ds.name != "synthetic" or not ds.get("build_if_missing", True):
        return []
    # What is needed is decided from the config alone, so that a run needing nothing builds
    # no dataset here (the trainer checks its config first, then builds it).
    if "pretrain" in config:
        if "fda" not in tuple(config.pretrain.get("tasks", ())):
            return []
        return [str(p) for p in make_hard_negatives(_built(ds))]
    # The extra inputs' shapes follow the model's config, not the vocabulary or caption length.
    shapes = conditioning_shapes(models.build(config.model, vocab_size=2, max_len=2))
    if "entities" not in shapes:
        return []
    dataset = _built(ds)
    if retrieval_exists(dataset.directory):
        return []
    make_entity_inputs(dataset, shapes["entities"][0])
    return [str(dataset.directory / entity_inputs.RETRIEVAL_DIR)]


def _built(ds: ml_collections.ConfigDict) -> Any:
    return datasets.prepare_config(ds, build_if_missing=True)


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
