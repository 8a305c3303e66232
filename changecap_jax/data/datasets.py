"""Finding, building and opening the datasets of the trunk.

A dataset is named in the config (``dataset.name``) and stored by TFDS (ArrayRecord) under
``dataset.data_dir`` (default: ``$CHANGECAP_DATA_DIR``, else ``$XDG_CACHE_HOME/changecap_jax``,
else ``~/.cache/changecap_jax``) as ``<data_dir>/<name>/<variant>/<version>/``. The synthetic
dataset builds itself the first time a config asks for it (one process at a time:
``data/building.py``); the per-model files made from it are made by the training command
(``data_prep/first_use.py``), and only read here. Every other name is a dataset built once
from its raw download (the builders of ``data_prep/builders/``, where each name is registered)
with
``python -m data_prep.build NAME --raw_dir=... --data_dir=...`` and read here from their
directory (no builder code, and so no torch, is needed to read them). Their variant is the
feature extraction (e.g. ``layer3``); when ``dataset.variant`` is empty and only one variant
is built, that one is used. A data dir in a bucket (``gs://...``) is read from a per-host
local copy (:func:`_prepare_remote`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from changecap_jax import console
from changecap_jax.data import building, entity_inputs, schema
from changecap_jax.data.synthetic.builder import SyntheticChange, make_config
from changecap_jax.data.vocab import Vocabulary
from changecap_jax.errors import UserError
from changecap_jax.io import paths


class DatasetError(UserError, RuntimeError):
    """A dataset that is missing, corrupt or does not match what the config expects."""


class DatasetOptionError(DatasetError, ValueError):
    """A variant or build option (``dataset.variant``, ``dataset.options``) the dataset lacks."""


@dataclasses.dataclass
class PreparedDataset:
    """A built dataset: its TFDS builder, directory, metadata and vocabulary."""

    name: str
    builder: tfds.core.DatasetBuilder
    directory: Path
    meta: schema.DatasetMeta
    vocab: Vocabulary
    # Retrieved change entities joined to every record (``with_entities``), or None.
    entities: entity_inputs.EntityInputs | None = None
    entity_count: int = 0

    def split(self, split: str) -> Any:
        """A random-access data source over one split (``len`` and ``[i]``)."""
        source = open_split(self, split)
        if self.entities is not None:
            source = entity_inputs.WithEntities(source, self.entities, split, self.entity_count)
        return source

    @property
    def pair_fields(self) -> tuple[str, ...]:
        """Record fields that exist once per pair orientation (``<field>_semantic`` ...)."""
        return entity_inputs.PAIR_FIELDS if self.entities is not None else ()


def attach_conditioning(dataset: PreparedDataset,
                        shapes: Mapping[str, tuple[int, ...]]) -> PreparedDataset:
    """Joins the extra per-pair inputs a model declares (``models.base.conditioning_shapes``)
    to the dataset's records, checking their shapes; ``entities`` (k, D) is the only kind."""
    unknown = sorted(set(shapes) - {"entities"})
    if unknown:
        raise DatasetError(f"the model reads per-pair inputs {unknown} that no dataset provides "
                           "(known: 'entities')")
    if "entities" not in shapes:
        return dataset
    count, dim = shapes["entities"]
    try:
        dataset = with_entities(dataset, count)
    except entity_inputs.EntityInputError as e:
        raise DatasetError(str(e)) from e
    have = dataset.entities.embeddings.shape[1]
    if have != dim:
        raise DatasetError(
            f"the model expects {dim}-dim entity embeddings but "
            f"{dataset.entities.directory} holds {have}-dim ones; set "
            f"--config.model.entity_dim={have}")
    return dataset


def with_entities(dataset: PreparedDataset, count: int) -> PreparedDataset:
    """The dataset with its first ``count`` retrieved entities per pair joined to each record
    (``data/entity_inputs.py``); training makes them for the synthetic set
    (``data_prep/first_use.py``)."""
    inputs = entity_inputs.load(dataset.directory)
    if not 1 <= count <= inputs.k:
        raise entity_inputs.EntityInputError(
            f"{inputs.directory}: the model reads {count} entities per pair but the retrieval "
            f"kept k={inputs.k}; rerun python -m data_prep.retrieval --k={count}")
    return dataclasses.replace(dataset, entities=inputs, entity_count=count)


def default_data_dir() -> paths.AnyPath:
    if os.environ.get("CHANGECAP_DATA_DIR"):
        return paths.path(os.environ["CHANGECAP_DATA_DIR"])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "changecap_jax"


def _synthetic_builder(data_dir: Path, variant: str, options: Mapping[str, Any]):
    try:
        config = make_config(
            variant,
            seed=int(options.get("seed", 0)),
            num_train=int(options.get("num_train", 3000)),
            num_val=int(options.get("num_val", 300)),
            num_test=int(options.get("num_test", 600)),
            feature_shape=tuple(options.get("feature_shape", (8, 8, 64))),
            feature_dtype=str(options.get("feature_dtype", "float16")),
        )
    except (TypeError, ValueError) as e:  # the config's dataset.variant or dataset.options
        raise DatasetOptionError(f"dataset 'synthetic' (variant {variant!r}): {e}") from e
    # An older builder version is read where it is built (TFDS builds only the newest).
    version = str(options.get("version") or SyntheticChange.VERSION)
    known = [str(v) for v in (SyntheticChange.VERSION, *SyntheticChange.SUPPORTED_VERSIONS)]
    if version not in known:
        raise DatasetOptionError(f"dataset 'synthetic' option version={version!r}: expected one "
                                 f"of {known}")
    # TFDS wants the registered configs by name and custom ones as objects.
    named = config.name if config.name in SyntheticChange.builder_configs else config
    return SyntheticChange(data_dir=str(data_dir), config=named, version=version,
                           file_format="array_record")


# name -> (builder factory, builds itself when missing)
BUILDERS = {"synthetic": (_synthetic_builder, True)}



def _version_key(path: Path) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in path.name.split("."))
    except ValueError:
        return (-1,)


def built_variants(root: paths.AnyPath, name: str) -> dict[str, paths.AnyPath]:
    """variant -> directory of its newest built version, for a real dataset under ``root``."""
    out = {}
    base = root / name
    if not base.is_dir():
        return out
    for config_dir in sorted(p for p in base.iterdir() if p.is_dir()):
        versions = [v for v in config_dir.iterdir() if (v / "dataset_info.json").exists()]
        if versions:
            out[config_dir.name] = max(versions, key=_version_key)
    return out


def _real_directory(name: str, root: paths.AnyPath, variant: str) -> paths.AnyPath:
    """The directory of the newest built version of a real dataset's variant under ``root``.
    """
    how = (f"build it with: python -m data_prep.build {name} --raw_dir=RAW "
           f"--data_dir={root} (see docs/datasets.md)")
    variants = built_variants(root, name)
    if not variants:
        built = sorted(p.name for p in root.iterdir()
                       if p.is_dir() and built_variants(root, p.name)) if root.is_dir() else []
        raise DatasetError(f"dataset {name!r} is not built in {root} (no "
                           f"{root / name}/<variant>/<version>/dataset_info.json; datasets "
                           f"built there: {built or 'none'}; built on first use: "
                           f"{sorted(BUILDERS)}); {how}")
    if variant:
        if variant not in variants:
            raise DatasetError(f"dataset {name!r} has no variant {variant!r} in {root / name}; "
                               f"built variants: {sorted(variants)}")
    elif len(variants) == 1:
        (variant,) = variants
    else:
        raise DatasetError(f"dataset {name!r} has several built variants in {root / name}: "
                           f"{sorted(variants)}; choose one with --config.dataset.variant=...")
    return variants[variant]


def _open_real(name: str, directory: Path) -> PreparedDataset:
    try:
        builder = tfds.builder_from_directory(str(directory))
    except Exception as e:  # TFDS raises several types for a damaged dataset_info.json
        raise DatasetError(f"cannot open dataset {name!r} in {directory}: {e}") from e
    return _read_prepared(name, builder, directory)


def prepare(
    name: str,
    data_dir: str | os.PathLike | None = None,
    variant: str = "",
    options: Mapping[str, Any] | None = None,
    *,
    build_if_missing: bool = True,
    wait_s: float = building.WAIT_S,
) -> PreparedDataset:
    """Finds (or, for self-building datasets, builds) a dataset and reads its metadata.

    ``wait_s``: how long to wait for another process building the same dataset."""
    explicit_dir = data_dir not in (None, "")
    root = paths.path(data_dir) if explicit_dir else default_data_dir()
    if paths.is_remote(root):
        return _prepare_remote(name, root, variant, options or {},
                               build_if_missing=build_if_missing, wait_s=wait_s)
    if name not in BUILDERS:
        return _open_real(name, _real_directory(name, root, variant))
    factory, self_building = BUILDERS[name]
    can_build = self_building and build_if_missing
    if explicit_dir and not root.is_dir() and not can_build:
        raise DatasetError(
            f"data dir {root} does not exist (dataset {name!r}); build the dataset into it "
            f"first: python -m data_prep.build {name} --data_dir={root}"
        )
    builder = factory(root, variant or "moderate", options or {})
    directory = Path(builder.data_dir)
    if not (directory / "dataset_info.json").exists():
        if not can_build:
            raise DatasetError(
                f"dataset {name!r} ({builder.builder_config.name}) is not built in {root}: "
                f"expected {directory}; build it with python -m data_prep.build {name} "
                f"--data_dir={root}"
            )
        try:
            build(builder, wait_s=wait_s)
        except building.LockTimeout as e:
            raise DatasetError(str(e)) from e
        # A fresh builder reads what was written (maybe by another process, while we waited).
        builder = factory(root, variant or "moderate", options or {})
    prepared = _read_prepared(name, builder, directory)
    return prepared


def prepare_config(group: Mapping[str, Any], *, build_if_missing: bool | None = None,
                   data_dir: str | os.PathLike | None = None) -> PreparedDataset:
    """:func:`prepare` of a run config's ``dataset`` group (name, data_dir, variant, options,
    build_if_missing); ``build_if_missing`` and ``data_dir`` override the group's when given."""
    build = group.get("build_if_missing", True) if build_if_missing is None else build_if_missing
    return prepare(group["name"], data_dir or group.get("data_dir") or None,
                   group.get("variant", ""), dict(group.get("options") or {}),
                   build_if_missing=build)


def _prepare_remote(name: str, root: paths.AnyPath, variant: str, options: Mapping[str, Any],
                    *, build_if_missing: bool, wait_s: float) -> PreparedDataset:
    """A dataset whose data dir is in a bucket, read from this host's local copy
    (``paths.local_mirror_dir``): TFDS and grain read ArrayRecord files by random access, one
    small read per record, which over the network would cost a request each. The copy is
    refreshed file by file (a file whose size differs is copied again). A self-building
    dataset missing from the bucket is built locally and uploaded, dataset_info.json last (the
    file that says a dataset is complete)."""
    local_root = paths.local_mirror_dir(root)
    if name not in BUILDERS:
        remote = _real_directory(name, root, variant)
        local = local_root / os.fspath(remote)[len(os.fspath(root)):].strip("/")
        _mirror_dataset(remote, local, name, wait_s)
        return _open_real(name, local)
    factory, self_building = BUILDERS[name]
    can_build = self_building and build_if_missing
    builder = factory(local_root, variant or "moderate", options)
    local = Path(builder.data_dir)
    remote = root / local.relative_to(local_root).as_posix()
    if (remote / "dataset_info.json").exists():
        _mirror_dataset(remote, local, name, wait_s)
    elif not can_build:
        raise DatasetError(
            f"dataset {name!r} ({builder.builder_config.name}) is not built in {root}: "
            f"expected {remote}; build it with python -m data_prep.build {name} "
            f"--data_dir={root}")
    else:
        try:
            build(builder, wait_s=wait_s)
        except building.LockTimeout as e:
            raise DatasetError(str(e)) from e
        if not (remote / "dataset_info.json").exists():  # another host may have uploaded it
            paths.upload(local, remote, describe(builder), last=("dataset_info.json",))
    builder = factory(local_root, variant or "moderate", options)
    prepared = _read_prepared(name, builder, local)
    return prepared


def _mirror_dataset(remote: paths.AnyPath, local: Path, name: str, wait_s: float) -> None:
    """Brings this host's copy of a bucket dataset up to date; one process of the host at a
    time (the local dataset lock), the marker file last."""
    try:
        with building.dataset_lock(local, f"the local copy of {name}", wait_s):
            paths.mirror(remote, local, f"dataset {name}", last=("dataset_info.json",))
    except building.LockTimeout as e:
        raise DatasetError(str(e)) from e
    except OSError as e:
        raise DatasetError(f"cannot copy dataset {name!r} from {remote} to {local}: {e}") from e


def describe(builder: tfds.core.DatasetBuilder) -> str:
    """``<tfds name>/<config> <version>``, how logs and errors name a dataset build."""
    return f"{builder.name}/{builder.builder_config.name} {builder.version}"


def build(builder: tfds.core.DatasetBuilder, *, wait_s: float = building.WAIT_S) -> bool:
    """Builds a dataset unless it is built; True when this call built it.

    Holds the dataset's lock (``data/building.py``): a concurrent build of the same dataset
    waits for it and then finds the dataset built. Leftovers of killed builds are removed
    first. TFDS writes into a temporary directory and renames it only on success; Ctrl-C and
    SIGTERM remove it (the synthetic builder stops its render workers before)."""
    directory = Path(builder.data_dir)
    what = describe(builder)
    with building.dataset_lock(directory, what, wait_s):
        if (directory / "dataset_info.json").exists():
            logging.info("%s is already built in %s", what, directory)
            return False
        building.remove_leftovers(building.incomplete_dirs(directory), what)
        detail = builder.build_detail() if hasattr(builder, "build_detail") else ""
        logging.info("building %s%s in %s", what, f" ({detail})" if detail else "", directory)
        start = time.monotonic()
        if not console.is_terminal():  # TFDS's own bars; off a terminal they are noise
            tfds.disable_progress_bar()
        try:
            with building.sigterm_raises():
                builder.download_and_prepare(
                    download_config=tfds.download.DownloadConfig(
                        compute_stats=tfds.download.ComputeStatsMode.SKIP))
        except BaseException:
            # TFDS's own removal fails when a file appears in the folder meanwhile.
            building.remove_leftovers(building.incomplete_dirs(directory), what)
            raise
        logging.info("built %s in %.0f s", what, time.monotonic() - start)
    return True


def _read_prepared(name: str, builder: Any, directory: Path) -> PreparedDataset:
    try:
        meta = schema.DatasetMeta.load(directory / schema.META_FILE)
        vocab = Vocabulary.load(directory / schema.VOCAB_FILE, meta.tokenizer)
    except (FileNotFoundError, ValueError) as e:
        raise DatasetError(f"dataset {name!r} in {directory} is incomplete or corrupt: {e}") from e
    stored = np.dtype(builder.info.features["before"].np_dtype).name
    if meta.feature_dtype and meta.feature_dtype != stored:
        raise DatasetError(f"dataset {name!r} in {directory}: meta.json says feature_dtype "
                           f"{meta.feature_dtype!r} but the records store {stored!r}")
    meta.feature_dtype = stored  # datasets built before meta.json recorded it
    return PreparedDataset(name=name, builder=builder, directory=directory, meta=meta, vocab=vocab)


def open_split(dataset: PreparedDataset, split: str) -> Any:
    """Opens one split; a missing, truncated or corrupt file gives an error naming it."""
    splits = dataset.builder.info.splits
    if split not in splits:
        raise DatasetError(
            f"dataset {dataset.name!r} in {dataset.directory} has no split {split!r}; "
            f"splits: {sorted(splits)}"
        )
    files = sorted(dataset.directory.glob(f"*-{split}.array_record-*"))
    _check_sizes(dataset, files)
    try:
        source = dataset.builder.as_data_source(split=split)
        n = len(source)
        if n:  # reading the first and last record checks the file's index and footer
            source[0]
            source[n - 1]
    except Exception as e:  # array_record raises several types for damaged files
        raise DatasetError(
            f"cannot read split {split!r} of dataset {dataset.name!r}: file(s) "
            f"{[str(f) for f in files]} are truncated or corrupt ({type(e).__name__}: {e}); "
            f"delete {dataset.directory} and build it again"
        ) from e
    expected = splits[split].num_examples
    if n != expected:
        raise DatasetError(
            f"split {split!r} of {dataset.directory} has {n} records, dataset_info.json "
            f"says {expected}: the files are truncated or were replaced"
        )
    return _CheckedSource(source, files)


def _check_sizes(dataset: PreparedDataset, files: list[Path]) -> None:
    """Compares each record file with the size recorded at build time (cheap, every open)."""
    recorded_path = dataset.directory / schema.FILES_FILE
    if not recorded_path.exists():
        raise DatasetError(f"{recorded_path} is missing: the dataset in {dataset.directory} "
                           "was not completely built; delete it and build it again")
    recorded = json.loads(recorded_path.read_text())
    if not files:
        raise DatasetError(f"no record files in {dataset.directory}")
    for f in files:
        want = recorded.get(f.name, {}).get("bytes")
        size = f.stat().st_size
        if want != size:
            raise DatasetError(
                f"record file {f} has {size} bytes, the build wrote {want}: it is truncated "
                f"or corrupt; delete {dataset.directory} and build it again"
            )


def verify(dataset: PreparedDataset) -> None:
    """Checks every record file against the sha256 recorded at build time (reads all bytes)."""
    recorded = json.loads((dataset.directory / schema.FILES_FILE).read_text())
    for name, info in recorded.items():
        path = dataset.directory / name
        if not path.exists() or schema.file_digest(path) != info["sha256"]:
            raise DatasetError(f"record file {path} is missing or corrupt (sha256 differs from "
                               "the build's)")


class _CheckedSource:
    """Wraps a data source so a record that fails to decode names its file and index."""

    def __init__(self, source: Any, files: list[Path]):
        self._source, self._files = source, files

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> dict[str, Any]:
        try:
            return self._source[index]
        except Exception as e:
            raise DatasetError(
                f"record {index} of {[str(f) for f in self._files]} cannot be read "
                f"({type(e).__name__}: {e})"
            ) from e

    def __repr__(self) -> str:
        return f"CheckedSource({self._files}, n={len(self)})"


def check_feature_shape(
    dataset: PreparedDataset, expected: tuple[int, ...] | None, key: str = "dataset"
) -> None:
    """Errors when a config expects another feature grid than the dataset stores."""
    if expected and tuple(expected) != tuple(dataset.meta.feature_shape):
        raise DatasetError(
            f"{key}: the model expects features of shape {tuple(expected)} but dataset "
            f"{dataset.name!r} in {dataset.directory} stores {tuple(dataset.meta.feature_shape)}"
        )
