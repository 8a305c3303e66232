"""Official PyTorch snapshot -> orbax checkpoint that the trainer restores.

:func:`convert_checkpoint` (behind ``python -m changecap_jax convert``):

1. reads the snapshot in the model's official format (:mod:`.torch_checkpoint`; reference
   §3.6 / §4.5; IDC-PCL §6: the pretraining dict or the fine-tuning state_dict);
2. checks that it is the model and decoder variant the config builds (the model's converter,
   :func:`.registry.converter_for`; docs/converters.md);
3. decides the data-dependent sizes: from the config's dataset when it is built (as the
   trainer would: vocabulary, feature grid, ``decode.max_len`` or the dataset's caption
   length), and otherwise from the checkpoint's own shapes. IDC-PCL needs the built dataset
   and ``--dict_json``: its token rows are reordered from the authors' dict.json ids to the
   dataset vocabulary (``convert/models/idc_dict_json.py``; dict.json words the dataset
   lacks are dropped and counted in the summary);
4. checks every torch key against the model's key table (missing, unexpected or mis-shaped keys,
   buffer values and tied weights; one message names all of them, each with both shapes) and
   converts it (§1.1, §7). Keys the table marks dropped are checked, not converted: an IDC-PCL
   pretraining checkpoint is restored as finetune.py does (§5.4), without its pooler and
   ``feat_regress.*``;
5. takes parameters that the official checkpoint format lacks (SCORER's CBR, S-Q1) from
   ``--extra_params`` or, with ``--missing=init``, from the trainer's own initialisation; those
   the official restore leaves fresh (``ModelConverter.fresh_params``: the IDC-PCL fine-tuning
   pooler from a pretraining checkpoint) get the trainer's initialisation without asking;
6. checks the result against the Flax model's parameter tree and writes
   ``WORKDIR/checkpoints/<step>`` with the trainer's manager and items: ``state`` =
   ``TrainState(step, params, fresh Adam state, PRNGKey(config.seed))`` and, when the dataset is
   available, ``data`` = a fresh training iterator (so ``--mode=train`` can also fine-tune
   from it). The official snapshots hold no optimizer moments, so Adam starts from zero.

``step`` is the snapshot's iteration when it says (a key of the dict such as IDC-PCL's
``global_step``, else the official file name ``<exp>_checkpoint_<t>.pt``), else 0, unless given.

Section numbers (§) and quirk ids (S-Q, D-Q, I-Q) refer to docs/official/ (see its README.md).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping
from typing import Any

import flax
import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from changecap_jax import models
from changecap_jax.convert import registry, tables
from changecap_jax.convert.errors import ConversionError, KeyMismatchError
from changecap_jax.convert.model_converter import ModelConverter
from changecap_jax.convert.torch_checkpoint import (
    OfficialSnapshot,
    read_state_dict,
)
from changecap_jax.data import datasets, pipeline
from changecap_jax.io import checkpoints, paths, run_config
from changecap_jax.trainers import caption_step, optimizers, update

MISSING_POLICIES = ("error", "init")
MAX_LISTED = 30  # problems listed in an error message (all are in KeyMismatchError.problems)


@dataclasses.dataclass
class ConversionReport:
    """What a conversion did (``summary()`` is what the command prints)."""

    checkpoint: str
    model: str
    variant: str | None
    sizes: tables.Sizes
    dataset: str | None  # the dataset whose shapes were checked, None if unavailable
    step: int = 0
    workdir: str | None = None
    converted_keys: int = 0
    buffers_checked: list[str] = dataclasses.field(default_factory=list)
    num_params: int = 0
    from_extra_params: list[str] = dataclasses.field(default_factory=list)
    initialised: list[str] = dataclasses.field(default_factory=list)
    fresh: list[str] = dataclasses.field(default_factory=list)  # ModelConverter.fresh_params
    dropped: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # why -> keys
    saved_data_iterator: bool = False
    notes: list[str] = dataclasses.field(default_factory=list)

    def summary(self) -> str:
        s = self.sizes
        lines = [
            f"converted {self.checkpoint} ({self.model}"
            f"{', ' + self.variant if self.variant else ''}): {self.converted_keys} torch "
            f"tensors -> {self.num_params:,} Flax parameters",
            f"sizes from {s.origin}: vocabulary {s.vocab_size}, max_len {s.max_len}, features "
            f"{s.grid_height}x{s.grid_width}x{s.feature_channels}",
            f"buffers checked, not converted: {', '.join(self.buffers_checked) or 'none'}",
        ]
        if self.from_extra_params:
            lines.append(f"from --extra_params: {len(self.from_extra_params)} tensors")
        for why, keys in self.dropped.items():
            lines.append(f"read and checked, not converted ({why}): {', '.join(keys)}")
        if self.fresh:
            lines.append(f"freshly initialised as the trainer does (the official restore "
                         f"leaves them fresh): {', '.join(self.fresh)}")
        if s.token_rows is not None:
            t = s.token_rows
            lines.append(f"token rows reordered from {t.origin} ({t.checkpoint_rows} ids) to the "
                         f"model's {len(t.rows)} rows in the dataset vocabulary's order")
            if t.dropped:
                lines.append(
                    f"dropped {len(t.dropped)} tokens of {t.origin} that the dataset vocabulary "
                    f"lacks (e.g. {', '.join(t.dropped[:5])}): a greedy caption changes only "
                    "where one of them would have been the argmax; softmax probabilities and "
                    "losses are normalised without them")
        if self.initialised:
            lines.append(f"initialised (--missing=init), not in the checkpoint: "
                         f"{', '.join(self.initialised)}")
        if self.workdir:
            lines.append(f"wrote step {self.step} to {self.workdir}/checkpoints (items: state"
                         f"{', data' if self.saved_data_iterator else ''})")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------------------------


def open_dataset(config: ml_collections.ConfigDict) -> tuple[Any, str | None]:
    """The config's dataset if it is already built (never builds one), else (None, reason)."""
    try:
        dataset = datasets.prepare_config(config.dataset, build_if_missing=False)
    except datasets.DatasetError as e:
        return None, str(e)
    return dataset, None


def resolve_sizes(
    config: ml_collections.ConfigDict, snapshot_sizes: tables.Sizes, dataset: Any | None
) -> tables.Sizes:
    """The sizes the trainer will build the model with (dataset) or the checkpoint's."""
    if dataset is None:
        max_len = config.decode.max_len or snapshot_sizes.max_len
        return dataclasses.replace(snapshot_sizes, max_len=max_len)
    h, w, c = dataset.meta.feature_shape
    return tables.Sizes(
        vocab_size=len(dataset.vocab),
        max_len=config.decode.max_len or dataset.meta.max_caption_len,
        feature_channels=c, grid_height=h, grid_width=w,
        origin=f"the config's dataset {dataset.name!r}")


def checkpoint_sizes(config: ml_collections.ConfigDict, model_converter: ModelConverter,
                     snapshot: OfficialSnapshot, dataset: Any | None, why: str | None,
                     dict_json: str | os.PathLike[str] | None = None) -> tables.Sizes:
    """What the key table depends on: :func:`resolve_sizes`, the checkpoint's stage and, for a
    model whose checkpoints follow another vocabulary file (IDC-PCL), the token order from
    ``dict_json`` and the dataset vocabulary (both required)."""
    found = model_converter.sizes_from_states(config.model, snapshot.states)
    sizes = dataclasses.replace(resolve_sizes(config, found, dataset),
                                checkpoint_stage=snapshot.stage)
    if model_converter.token_rows is None:
        if dict_json is not None:
            raise ConversionError(f"--dict_json is only read for models whose checkpoints "
                                  f"follow a vocabulary file ({model_converter.title} does not)")
        return sizes
    title = model_converter.title
    if dict_json is None:
        raise ConversionError(f"{title} checkpoints number their tokens by the authors' "
                              "dict.json: pass it with --dict_json=PATH")
    if dataset is None:
        raise ConversionError(
            f"the config's dataset is not available ({why}); converting {title} needs its "
            "vocabulary to reorder the token rows from dict.json")
    rows = model_converter.token_rows(config.model, dataset.vocab, dict_json, found.vocab_size)
    return dataclasses.replace(sizes, token_rows=rows)


# ---------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------


def build_model(config: ml_collections.ConfigDict, sizes: tables.Sizes) -> Any:
    """The Flax model the trainer builds for ``config`` and these sizes."""
    return models.build(config.model, vocab_size=sizes.vocab_size, max_len=sizes.max_len)


def init_params(config: ml_collections.ConfigDict, model: Any, model_converter: ModelConverter,
                sizes: tables.Sizes, *, abstract: bool) -> dict[str, Any]:
    """The model's parameters (shapes only when ``abstract``), drawn as Trainer.init_state."""
    if model_converter.init_inputs is None:
        args, kwargs = (model_converter.example_batch(model, sizes),), {"train": False}
    else:
        args, kwargs = model_converter.init_inputs(model, sizes)
    # The trainer's own initialisation key.
    key = jax.random.fold_in(jax.random.PRNGKey(config.seed), caption_step.INIT_FOLD)
    init = lambda: model.init({"params": key}, *args, **kwargs)["params"]  # noqa: E731
    return jax.eval_shape(init) if abstract else jax.jit(init)()


def _flat(tree: Mapping[str, Any]) -> dict[str, Any]:
    return flax.traverse_util.flatten_dict(dict(tree), sep="/")


def _checked_states(
    model_converter: ModelConverter, entries: list[tables.Entry], snapshot: OfficialSnapshot,
    extra_states: dict[str, Mapping[str, np.ndarray]], sizes: tables.Sizes,
) -> tuple[dict[str, Mapping[str, np.ndarray]], list[str]]:
    """The snapshot's and ``--extra_params``' state_dicts and the sources they give, checked
    against the key table (KeyMismatchError listing every problem)."""
    states: dict[str, Mapping[str, np.ndarray]] = dict(snapshot.states)
    official = [s.name for s in model_converter.sources if s.official]
    unofficial = [s.name for s in model_converter.sources if not s.official]
    unknown = sorted(set(extra_states) - set(unofficial))
    if unknown:
        raise ConversionError(f"--extra_params gives {unknown}, but model "
                              f"{model_converter.name!r} takes extra parameters only for "
                              f"{unofficial}")
    states.update(extra_states)
    sources = official + [name for name in unofficial if name in extra_states]
    problems = tables.check_states(entries, states, sources)
    if problems:
        shown = problems[:MAX_LISTED] + (
            [f"... and {len(problems) - MAX_LISTED} more"] if len(problems) > MAX_LISTED else [])
        raise KeyMismatchError(
            f"{snapshot.path} does not fit config.model ({model_converter.title}, sizes from "
            f"{sizes.origin}); {len(problems)} problems:\n  " + "\n  ".join(shown), problems)
    return states, sources


def _check_against_model(model_converter: ModelConverter, converted: Mapping[str, np.ndarray],
                         abstract: Mapping[str, Any]) -> None:
    """Every converted array is a parameter of the Flax model, with its shape (else the key
    table has a bug)."""
    internal = []
    for path, value in converted.items():
        if path not in abstract:
            internal.append(f"the table maps to {path}, which is not a parameter of the model")
        elif tuple(abstract[path].shape) != value.shape:
            internal.append(f"{path}: converted shape {value.shape} != model shape "
                            f"{tuple(abstract[path].shape)}")
    if internal:
        raise ConversionError(
            f"the key table of {model_converter.name!r} does not match the Flax model (a bug "
            f"in its converter, changecap_jax/convert/models/):\n  " + "\n  ".join(internal))


def _absent_params(model_converter: ModelConverter, entries: list[tables.Entry],
                   absent: list[str], extra_states: Mapping[str, Any], missing: str) -> None:
    """Parameters no file provides: an error naming them and the sources not given, or (with
    ``missing="init"``) a warning."""
    if not absent:
        return
    not_given = [s for s in model_converter.sources
                 if not s.official and s.name not in extra_states]
    detail = "".join(
        f"\n  {s.name} ({s.description}): "
        + ", ".join(e.key for e in entries if e.source == s.name)
        for s in not_given)
    message = (f"{len(absent)} parameters of model {model_converter.name!r} are not in the "
               f"official checkpoint: {', '.join(absent)}{detail}")
    if missing == "error":
        raise ConversionError(message + "\nPass them with --extra_params=PATH (a torch "
                              "state_dict) or initialise them with --missing=init.")
    logging.warning("%s; initialising them (--missing=init)", message)


def _fill_report(report: ConversionReport, entries: list[tables.Entry], sources: list[str],
                 extra_states: Mapping[str, Any], converted: Mapping[str, np.ndarray],
                 fresh: list[str], absent: list[str]) -> None:
    report.converted_keys = sum(1 for e in entries if e.targets and e.source in sources)
    report.buffers_checked = [e.name for e in entries if not e.targets and not e.dropped]
    for e in entries:
        if e.dropped:
            report.dropped.setdefault(e.dropped, []).append(e.key)
    report.fresh = fresh
    report.num_params = int(sum(v.size for v in converted.values()))
    report.from_extra_params = [e.name for e in entries if e.source in extra_states]
    report.initialised = absent


def convert_params(
    config: ml_collections.ConfigDict,
    snapshot: OfficialSnapshot,
    sizes: tables.Sizes,
    *,
    extra_states: Mapping[str, Mapping[str, np.ndarray]] | None = None,
    missing: str = "error",
    report: ConversionReport | None = None,
) -> dict[str, Any]:
    """Checked conversion of a snapshot into the Flax param tree of ``config.model``.

    Args:
      config: the run config (``model``, ``seed``).
      snapshot: the snapshot read by :func:`read_official_snapshot`.
      sizes: data-dependent sizes (:func:`resolve_sizes`).
      extra_states: source name -> torch state_dict for the sources the official snapshot lacks
        (from ``--extra_params``).
      missing: ``"error"`` or ``"init"``: what to do with parameters no file provides.
      report: filled in when given.

    Raises:
      WrongModelError, KeyMismatchError, ConversionError.
    """
    if missing not in MISSING_POLICIES:
        raise ValueError(f"missing must be one of {MISSING_POLICIES}, got {missing!r}")
    model_converter = registry.converter_for(config.model.name)
    entries = model_converter.table(config.model, sizes)
    extra_states = dict(extra_states or {})
    states, sources = _checked_states(model_converter, entries, snapshot, extra_states, sizes)
    converted = tables.apply_table(entries, states)
    model = build_model(config, sizes)
    abstract = _flat(init_params(config, model, model_converter, sizes, abstract=True))
    _check_against_model(model_converter, converted, abstract)
    fresh_by_design = set(model_converter.fresh_params(config.model, sizes))
    fresh = sorted((set(abstract) & fresh_by_design) - set(converted))
    absent = sorted(set(abstract) - set(converted) - fresh_by_design)
    _absent_params(model_converter, entries, absent, extra_states, missing)
    if absent or fresh:  # the trainer's own initialisation
        initial = _flat(init_params(config, model, model_converter, sizes, abstract=False))
        for path in absent + fresh:
            converted[path] = np.asarray(initial[path])
    if report is not None:
        _fill_report(report, entries, sources, extra_states, converted, fresh, absent)
    return flax.traverse_util.unflatten_dict(
        {k: jnp.asarray(v) for k, v in converted.items()}, sep="/")


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


def read_extra_params(
    model_converter: ModelConverter, path: str | os.PathLike[str] | None, *,
    allow_pickle: bool = False,
) -> dict[str, dict[str, np.ndarray]]:
    """``--extra_params``: a torch state_dict for the model's non-official source, as
    {source name: {torch key: array}} ({} when ``path`` is None)."""
    if path is None:
        return {}
    unofficial = [s.name for s in model_converter.sources if not s.official]
    if not unofficial:
        raise ConversionError(f"--extra_params was given, but the official "
                              f"{model_converter.title} checkpoint already holds every parameter")
    state = read_state_dict(path, allow_pickle=allow_pickle)
    if len(unofficial) == 1:
        return {unofficial[0]: state}
    raise ConversionError(f"model {model_converter.name!r} has several extra sources "
                          f"{unofficial}; pass one state_dict per source")  # no such model yet


def _train_state(config: ml_collections.ConfigDict, params: Any, dataset: Any | None,
                 step: int) -> update.TrainState:
    """The trainer's state around ``params``: fresh Adam moments (the official snapshots hold
    none) with the schedule of the config's dataset, the config's PRNG key."""
    steps_per_epoch = 1
    if dataset is not None:
        num_train = dataset.meta.split_sizes.get("train") or len(dataset.split("train"))
        steps_per_epoch = math.ceil(num_train / config.batch_size)
    optimizer, _ = optimizers.make_optimizer(config.optim, steps_per_epoch)
    return update.TrainState(step=jnp.int32(step), params=params,
                            opt_state=optimizer.init(params),
                            rng=jax.random.PRNGKey(config.seed))


def _data_item(config: ml_collections.ConfigDict, dataset: Any | None,
               report: ConversionReport) -> dict[str, Any]:
    """The ``data`` item: a fresh training iterator, when the trainer keeps one and the
    dataset is available (the reason goes to the report otherwise)."""
    if "pretrain" in config:  # the pretraining trainer keeps one stream per task
        report.notes.append("no data iterator saved: pretraining starts its task streams "
                            "fresh when it resumes from this checkpoint")
        return {}
    if dataset is None:
        return {}
    try:
        loader = pipeline.train_loader(
            dataset.split("train"), global_batch_size=config.batch_size,
            seed=config.seed, swap_prob=config.swap_prob)
        item = grain.checkpoint.CheckpointSave(iter(loader))
    except ValueError as e:  # e.g. a split smaller than the batch
        report.notes.append(f"no data iterator saved ({e})")
        return {}
    report.saved_data_iterator = True
    return {"data": item}


def _save(config: ml_collections.ConfigDict, workdir: str | os.PathLike[str], step: int,
          state: update.TrainState, dataset: Any | None, report: ConversionReport) -> None:
    """Writes ``workdir/checkpoints/<step>`` with the trainer's manager and items, into an
    empty workdir only."""
    directory = paths.path(workdir) / "checkpoints"
    manager = checkpoints.make_checkpoint_manager(directory, config.keep_checkpoints)
    try:
        if manager.all_steps():
            raise ConversionError(
                f"{directory} already holds checkpoints (steps {list(manager.all_steps())}); "
                "convert into an empty workdir")
        items = {"state": ocp.args.StandardSave(state), **_data_item(config, dataset, report)}
        manager.save(step, args=ocp.args.Composite(**items), force=True)
        manager.wait_until_finished()
    finally:
        manager.close()


def _start_report(config: ml_collections.ConfigDict, torch_checkpoint: str | os.PathLike[str],
                  model_converter: ModelConverter, snapshot: OfficialSnapshot,
                  sizes: tables.Sizes, dataset: Any | None, why: str | None) -> ConversionReport:
    report = ConversionReport(
        checkpoint=str(torch_checkpoint), model=model_converter.name,
        variant=config.model.get("variant"), sizes=sizes,
        dataset=None if dataset is None else dataset.name)
    if dataset is None:
        report.notes.append(f"the config's dataset is not available ({why}); the model is "
                            "built from the checkpoint's shapes, which the trainer will check "
                            "against the dataset when it restores")
    if snapshot.ignored:
        report.notes.append(f"ignored top-level entries of the snapshot: {list(snapshot.ignored)}")
    return report


def convert_checkpoint(
    config: ml_collections.ConfigDict,
    torch_checkpoint: str | os.PathLike[str],
    workdir: str | os.PathLike[str],
    *,
    extra_params: str | os.PathLike[str] | None = None,
    missing: str = "error",
    step: int | None = None,
    allow_pickle: bool = False,
    dict_json: str | os.PathLike[str] | None = None,
) -> ConversionReport:
    """Converts an official snapshot into ``workdir/checkpoints/<step>`` (module docstring);
    ``dict_json``: the authors' vocabulary file, required for IDC-PCL.

    Raises:
      ConversionError (and its subclasses) for every problem with the inputs; the message
      names the file, the key and both shapes where there are any.
    """
    model_converter = registry.converter_for(config.model.name)
    snapshot = model_converter.read_snapshot(torch_checkpoint, allow_pickle=allow_pickle)
    model_converter.check_identity(config.model, snapshot.states, snapshot.model_cfg)
    dataset, why = open_dataset(config)
    sizes = checkpoint_sizes(config, model_converter, snapshot, dataset, why, dict_json)
    report = _start_report(config, torch_checkpoint, model_converter, snapshot, sizes, dataset,
                           why)
    extra = read_extra_params(model_converter, extra_params, allow_pickle=allow_pickle)
    params = convert_params(config, snapshot, sizes, extra_states=extra, missing=missing,
                            report=report)
    if step is None:
        step = snapshot.iteration or 0
    if step < 0:
        raise ConversionError(f"step must be >= 0, got {step}")
    report.step = int(step)
    _save(config, workdir, step, _train_state(config, params, dataset, step), dataset, report)
    report.workdir = str(workdir)
    run_config.save_config(workdir, config)  # so export / report can rebuild the run
    return report
