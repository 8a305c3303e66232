"""A workdir's orbax checkpoints, in one place: the manager, the steps a folder holds, a
training run's save / resume / ``init_from``, and restoring past damaged steps.

A step is *damaged* when its files cannot be read back: the step's or an item's metadata is
missing or is not JSON, an item it lists is missing (a partial step), an item's files fail to
read (TensorStore reports a truncated, corrupt or missing data file), or the data iterator's
state is unreadable. Every item counts: a step whose model state is whole but whose data
iterator state is damaged is damaged.

:func:`restore` tries the requested step only, or without one the latest step and then each
older one, logging one warning line per damaged step it passes. With ``move_damaged_aside``
(a training resume, which saves again) the damaged steps newer than the restored one are
renamed to ``<step>.damaged``: orbax silently skips a save at a step not newer than its latest
step, so a damaged directory left in place would shadow the run's next save of that step.
The renamed directory stays for inspection; orbax lists only all-digit names, so it ignores
it (and never deletes it: the user does).

A training run saves asynchronously (``make_checkpoint_manager(asynchronous=True)``,
``config.async_checkpoints``): :func:`restore` waits for a save in flight before it reads.

Without a trainer: :func:`restore_params` (a model's parameters, as exported or shown in a
report) and :func:`restore_state` (a whole train state shaped like the one given) restore a
workdir's checkpoint through :func:`restore`; :func:`best_first_steps` is the order in which
"the best" checkpoint is looked for.

Section numbers (§) refer to docs/official/ (see its README.md).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import flax.traverse_util
import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils
from orbax.checkpoint import checkpoint_managers

from changecap_jax.errors import UserError
from changecap_jax.io import paths
from changecap_jax.io.jsonio import read_json

METADATA_FILE = "_CHECKPOINT_METADATA"  # a step's: the items it holds, its metrics
ITEM_METADATA_FILE = "_METADATA"  # a pytree item's tree structure
DAMAGED_SUFFIX = ".damaged"
CHECKPOINTS_DIR = "checkpoints"  # a workdir's orbax folder
# TensorStore's status codes for a file that is truncated, corrupt or gone (its errors reach
# us as ValueError("CODE: ...")); a wrong target shape or dtype raises other errors.
COMMIT_FILE = "commit_success.txt"  # orbax's mark of a complete save in a bucket
TENSORSTORE_DAMAGE = re.compile(r"^(DATA_LOSS|OUT_OF_RANGE|NOT_FOUND|FAILED_PRECONDITION): ")


class CheckpointError(UserError, RuntimeError):
    """No checkpoint can be restored: the named step is damaged or absent, or all are damaged."""


def make_checkpoint_manager(directory: str | os.PathLike, keep: int,
                            item_names: tuple[str, ...] = ("state", "data"), *,
                            writer: bool = False,
                            asynchronous: bool = False) -> ocp.CheckpointManager:
    """orbax manager of (train state, data iterator state) items.

    Keeps the latest ``keep`` checkpoints plus the one with the best ``val_CIDEr`` metric;
    every save is atomic (written to a temporary directory, renamed when complete) and
    multi-host safe. A ``writer`` (the run that owns the workdir: ``workdir_lock``) removes
    the temporary directories of saves that a killed run left unfinished.

    ``asynchronous`` (a training run, ``config.async_checkpoints``): ``save`` returns once the
    arrays are copied to host memory and the data streams' positions are written; a
    background thread writes the arrays and renames the step into place. Until then the step
    is a temporary directory that no reader lists, so a kill loses that step only. Whoever
    reads what this manager saved calls ``wait_until_finished()`` first (:func:`restore` and
    ``close()`` do), and the next ``save`` waits for the previous one.
    """
    cm = checkpoint_managers
    policy = cm.AnyPreservationPolicy([
        cm.LatestN(keep),
        # Ascending sort, the last n kept: the highest CIDEr survives.
        cm.BestN(get_metric_fn=lambda m: m["val_CIDEr"], reverse=False, n=1,
                 keep_checkpoints_without_metrics=False),
    ])
    options = ocp.CheckpointManagerOptions(
        preservation_policy=policy, enable_async_checkpointing=asynchronous, create=True,
        cleanup_tmp_directories=writer)
    # orbax takes an epath.Path: a bucket folder as it is, a local one made absolute.
    directory = paths.path(directory)
    if not paths.is_remote(directory):
        directory = directory.absolute()
    return ocp.CheckpointManager(epath.Path(directory), options=options,
                                 item_names=item_names)


# ---------------------------------------------------------------------------------------------
# The steps a folder holds (its listing alone)
# ---------------------------------------------------------------------------------------------


def steps(directory: str | os.PathLike) -> list[int]:
    """The step numbers in ``directory`` (e.g. ``<workdir>/checkpoints``), ascending; [] when
    it does not exist."""
    directory = paths.path(directory)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.name.isdigit() and p.is_dir()]
    if paths.is_remote(directory):
        # A bucket has no folder rename: orbax saves into the step's folder and marks it
        # complete with a last file; a killed save leaves the folder without it.
        found = [p for p in found if (p / COMMIT_FILE).exists()]
    return sorted(int(p.name) for p in found)


def has_steps(directory: str | os.PathLike) -> bool:
    return bool(steps(directory))


def latest_step(directory: str | os.PathLike) -> int | None:
    found = steps(directory)
    return found[-1] if found else None


# ---------------------------------------------------------------------------------------------
# What is damaged
# ---------------------------------------------------------------------------------------------


def saved_items(step_dir: paths.AnyPath) -> dict[str, str] | None:
    """The items a step holds (name -> orbax handler type), or None if its metadata is
    unreadable."""
    try:
        handlers = json.loads((step_dir / METADATA_FILE).read_text())["item_handlers"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return handlers if isinstance(handlers, dict) else None


def _grain_state_file() -> str:
    # grain's CheckpointHandler writes one file per process, named so.
    return f"process_{jax.process_index()}-of-{jax.process_count()}.json"


def data_state_file(item_dir: paths.AnyPath) -> str:
    """The data-stream state file this process restores from ``item_dir``: its own, or, for a
    step saved by another number of processes, the first process's (the training streams'
    position is global, docs/training.md "Multi-host"; ``process_0-of-N.json``)."""
    own = _grain_state_file()
    if (item_dir / own).exists():
        return own
    others = sorted(p.name for p in item_dir.glob("process_0-of-*.json"))
    return others[0] if others else own


def files_damage(step_dir: paths.AnyPath) -> str | None:
    """A short reason why the step's metadata shows it damaged or partial, else None. Cheap:
    reads the metadata files only, not the arrays."""
    if not (step_dir / METADATA_FILE).exists():
        return f"{METADATA_FILE} missing"
    items = saved_items(step_dir)
    if items is None:
        return f"{METADATA_FILE} unreadable"
    for item, handler in items.items():
        if not (step_dir / item).is_dir():
            return f"item {item!r} missing"
        if "grain" in handler:
            name = data_state_file(step_dir / item)
        elif "Standard" in handler or "PyTree" in handler:
            name = ITEM_METADATA_FILE
        else:  # a handler this module does not know: the directory is all it checks
            continue
        path = step_dir / item / name
        try:
            json.loads(path.read_text())
        except FileNotFoundError:
            return f"{item}/{name} missing"
        except (OSError, ValueError):  # ValueError: not JSON, or not UTF-8
            return f"{item}/{name} unreadable"
    return None


def _abandoned_read(unraisable: Any) -> bool:
    """Whether an unraisable exception is the echo of a damaged step's abandoned reads: orbax
    stops reading at the first unreadable array, and its other read coroutines and TensorStore
    callbacks then fail with nobody to catch them ("Exception ignored in: <coroutine
    _read_array_index_and_device_put>", "Event loop is closed"), one traceback each."""
    where = getattr(unraisable.object, "__qualname__", "") or repr(unraisable.object)
    return "_read_array" in where or _abandoned_read_error(unraisable.exc_value)


def _abandoned_read_error(error: BaseException | None) -> bool:
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
        return True
    return error is not None and damage_reason(error) is not None


class _AbandonedReadTasks(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" for an abandoned read: the same
    echo as :func:`_abandoned_read` when the read ran as a task (which depends on timing: a
    loaded machine finishes more reads before orbax gives up). A task that failed otherwise
    still logs."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not ("never retrieved" in str(record.msg) and _abandoned_read_error(error))


def _quiet_abandoned_reads() -> None:
    """From now on, leaves out the tracebacks of :func:`_abandoned_read` (they arrive while a
    damaged step is read and after it has been passed with its one warning line), those
    unraisable and those asyncio logs for a task; every other unraisable exception still
    reaches the hook that was installed before."""
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _AbandonedReadTasks) for f in asyncio_log.filters):
        asyncio_log.addFilter(_AbandonedReadTasks())
    previous = sys.unraisablehook
    if getattr(previous, "_changecap_quiet_reads", False):
        return

    def hook(unraisable: Any) -> None:
        if not _abandoned_read(unraisable):
            previous(unraisable)

    hook._changecap_quiet_reads = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def damage_reason(error: BaseException) -> str | None:
    """A short reason when ``error`` (or its cause) is a read or decode error of damaged
    files, else None: a mismatch between the checkpoint and the model, or a bug, is not
    damage and must surface as it is."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, json.JSONDecodeError):
            return f"unreadable JSON: {error.msg}"
        if isinstance(error, OSError):
            name = Path(error.filename).name if error.filename else ""
            return f"{error.strerror or type(error).__name__} {name}".strip()
        if isinstance(error, ValueError):
            match = TENSORSTORE_DAMAGE.match(str(error))
            if match:
                return f"unreadable arrays, TensorStore {match.group(1)}"
        # orbax wraps TensorStore's read error in a plain Exception raised from it. Only the
        # explicit cause is followed: an implicit __context__ may be any error handled earlier.
        error = error.__cause__
    return None


# ---------------------------------------------------------------------------------------------
# Restoring
# ---------------------------------------------------------------------------------------------


def restore(manager: ocp.CheckpointManager,
            args_for: Callable[[int, dict[str, str]], dict[str, Any]], *,
            step: int | None = None, order: Sequence[int] | None = None,
            move_damaged_aside: bool = False) -> tuple[int, Any]:
    """Restores ``step``, or the first intact step of ``order`` (default: latest first).

    ``args_for(step, items)`` gives the orbax restore args of each item to restore, ``items``
    being the ones the step holds (name -> handler). Returns (restored step, restored
    Composite). A named ``step`` that is damaged raises :class:`CheckpointError` listing the
    intact steps; without one, each damaged step is passed with one warning line, and
    :class:`CheckpointError` lists them all when none is intact. ``move_damaged_aside``
    renames the passed steps to ``<step>.damaged`` (see the module docstring).
    """
    # A save of this manager still in flight is not listed on disk yet, and would be read
    # half-written: wait for it (a no-op for a synchronous manager or none pending).
    manager.wait_until_finished()
    directory = paths.path(manager.directory)
    steps = sorted(manager.all_steps(), reverse=True)
    if step is not None:
        if step not in steps:
            raise CheckpointError(f"no checkpoint of step {step} in {directory}; there are "
                                  f"{sorted(steps) or 'none'}")
        restored, reason = _try(manager, step, args_for)
        if reason is None:
            return step, restored
        intact = sorted(s for s in steps if s != step and _intact(manager, s, args_for))
        raise CheckpointError(f"checkpoint {step} in {directory} is damaged ({reason}); intact "
                              f"steps: {intact}")
    candidates = list(order) if order is not None else steps
    if not candidates:
        raise CheckpointError(f"no checkpoint in {directory}")
    damaged: list[tuple[int, str]] = []
    for candidate in candidates:
        restored, reason = _try(manager, candidate, args_for)
        if reason is None:
            _report(manager, damaged, candidate, move_damaged_aside)
            return candidate, restored
        damaged.append((candidate, reason))
    listed = "; ".join(f"step {s}: {r}" for s, r in damaged)
    raise CheckpointError(f"no intact checkpoint in {directory}; all are damaged ({listed})")


def _try(manager: ocp.CheckpointManager, step: int,
         args_for: Callable[[int, dict[str, str]], dict[str, Any]]) -> tuple[Any, str | None]:
    """(restored items, None), or (None, why the step is damaged); the same answer on every
    process (one process's damaged file makes the step damaged for all)."""
    step_dir = paths.path(manager.directory) / str(step)
    reason = files_damage(step_dir)
    restored = None
    if reason is None:
        _quiet_abandoned_reads()  # before reading: the first echoes come during the read
        try:
            restored = manager.restore(step, args=ocp.args.Composite(
                **args_for(step, saved_items(step_dir))))
        except Exception as error:  # orbax wraps read errors in a plain Exception
            reason = damage_reason(error)
            if reason is None:  # not damage: a mismatch or a bug, shown as it is
                raise
    if not _everywhere_intact(reason is None):
        reason = reason or "damaged on another process"
    return (None, reason) if reason is not None else (restored, None)


def _intact(manager: ocp.CheckpointManager, step: int,
            args_for: Callable[[int, dict[str, str]], dict[str, Any]]) -> bool:
    """Whether ``step`` restores, for an error message: any failure counts as not intact,
    so that listing the others never hides the error being reported."""
    try:
        return _try(manager, step, args_for)[1] is None
    except Exception:  # see the docstring
        return False


def _everywhere_intact(intact: bool) -> bool:
    if jax.process_count() == 1:
        return intact
    return bool(np.all(multihost_utils.process_allgather(np.int32(intact))))


def _report(manager: ocp.CheckpointManager, damaged: Iterable[tuple[int, str]], restored: int,
            move_aside: bool) -> None:
    """One warning line per damaged step passed; with ``move_aside``, renames it first."""
    directory = paths.path(manager.directory)
    damaged = list(damaged)
    moved: dict[int, str] = {}
    if move_aside and damaged:
        if jax.process_index() == 0:
            for s, _ in damaged:
                target = _free_name(directory, f"{s}{DAMAGED_SUFFIX}")
                (directory / str(s)).rename(directory / target)
                moved[s] = target
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("changecap_jax.io.checkpoints.move_aside")
        manager.reload()  # the manager caches its steps
    for s, reason in damaged:
        kept = f", kept as {moved[s]}" if s in moved else ""
        logging.warning("checkpoint %d in %s is damaged (%s%s); falling back to step %d",
                        s, directory, reason, kept, restored)


def _free_name(directory: paths.AnyPath, name: str) -> str:
    """``name``, or ``name.1``, ``name.2``... whichever does not exist yet in ``directory``."""
    candidate, k = name, 0
    while (directory / candidate).exists():
        k += 1
        candidate = f"{name}.{k}"
    return candidate


# ---------------------------------------------------------------------------------------------
# A training run's save, resume and init_from
# ---------------------------------------------------------------------------------------------


def save(manager: ocp.CheckpointManager, step: int, state: Any, streams: dict[str, Any],
         metrics: dict[str, float] | None = None) -> float:
    """Checkpoints the state and every data stream's position at ``step``; returns the
    seconds the caller was blocked (an asynchronous manager: waiting for the previous save,
    the copy to host memory and the streams' positions; a synchronous one: the whole save).

    The streams' positions are written before this returns in both modes (grain's handler is
    synchronous), so the next batch drawn never leaks into this step's checkpoint."""
    items = {name: grain.checkpoint.CheckpointSave(it) for name, it in streams.items()}
    began = time.perf_counter()
    manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), **items),
                 metrics=metrics)
    return time.perf_counter() - began


def restore_train_state(manager: ocp.CheckpointManager, state: Any, streams: dict[str, Any],
                        step: int | None = None, *, order: list[int] | None = None,
            move_damaged_aside: bool = False) -> Any:
    """The state (and the streams' positions) of ``step``, or of the latest intact step (of
    ``order``), passing damaged ones (``checkpoints.restore``). A stream the checkpoint lacks
    (enabled since, or converted from PyTorch without the dataset at hand) starts fresh."""

    other_layout: dict[str, paths.AnyPath] = {}  # streams saved by another number of processes

    def args_for(step: int, items: dict[str, str]) -> dict[str, Any]:
        args = {"state": ocp.args.StandardRestore(state)}
        other_layout.clear()
        for name, iterator in streams.items():
            if name not in items:
                logging.info("checkpoint %d has no %s stream: it starts fresh", step, name)
                continue
            item_dir = paths.path(manager.directory) / str(step) / name
            state_file = data_state_file(item_dir)
            if state_file == _grain_state_file():
                args[name] = grain.checkpoint.CheckpointRestore(iterator)
            else:
                other_layout[name] = item_dir / state_file
        return args

    step, restored = restore(manager, args_for, step=step, order=order,
                             move_damaged_aside=move_damaged_aside)
    for name, path in other_layout.items():
        streams[name].set_state(path.read_text().encode())
        streams[name].start_prefetch()
        logging.info("data stream %s resumed from %s (saved by another number of processes)",
                     name, path.name)
    logging.info("restored checkpoint of step %d from %s", step, manager.directory)
    return restored["state"]


def init_params_from(params: Any, workdir: str | os.PathLike,
                     exclude: tuple[str, ...] = ()) -> Any:
    """Parameters initialised from another run's latest checkpoint (e.g. IDC-PCL fine-tuning
    from pretraining, §5.4): every parameter whose path exists there with the same shape is
    copied, except paths containing one of ``exclude`` (the official code skips "pooler");
    the others keep their fresh initialisation. A shared path with another shape is an error."""
    with make_checkpoint_manager(paths.path(workdir) / "checkpoints", 1) as manager:
        if manager.latest_step() is None:
            raise FileNotFoundError(
                f"config.init_from: no checkpoint in {paths.path(workdir) / 'checkpoints'}")
        step, source = restore(
            manager, lambda step, items: {"state": ocp.args.StandardRestore()})
    flat_src = flax.traverse_util.flatten_dict(source["state"]["params"], sep="/")
    flat = flax.traverse_util.flatten_dict(params, sep="/")
    copied, skipped = [], []
    for path, value in flat.items():
        if path not in flat_src or any(e in path for e in exclude):
            skipped.append(path)
            continue
        src = flat_src[path]
        if tuple(src.shape) != tuple(value.shape):
            raise ValueError(f"config.init_from: {path} has shape {tuple(src.shape)} in "
                             f"{workdir} (step {step}) but {tuple(value.shape)} here")
        flat[path] = jax.device_put(jnp.asarray(src, value.dtype), value.sharding)
        copied.append(path)
    if not copied:
        raise ValueError(f"config.init_from: no parameter of this model is in {workdir}")
    logging.info("init_from %s (step %d): %d parameters copied, %d fresh: %s", workdir, step,
                 len(copied), len(skipped), skipped[:20])
    return flax.traverse_util.unflatten_dict(flat, sep="/")


# ---------------------------------------------------------------------------------------------
# Restoring without a trainer
# ---------------------------------------------------------------------------------------------


def best_first_steps(workdir: str | os.PathLike) -> list[int]:
    """A workdir's checkpoints, best val CIDEr (``metrics/val_<step>.json``) first, then the
    unscored ones latest first: where "the best" checkpoint is looked for, passing damaged
    ones."""
    workdir = paths.path(workdir)
    scored, unscored = [], []
    for step in steps(workdir / CHECKPOINTS_DIR):
        path = workdir / "metrics" / f"val_{step}.json"
        if path.exists():
            scored.append((float(read_json(path, "metrics file")["CIDEr"]), step))
        else:
            unscored.append(step)
    return [int(s) for _, s in sorted(scored, reverse=True)] + sorted(unscored, reverse=True)


def _restore_item(workdir: str | os.PathLike, state_args: Any,
                  step: int | str | None) -> tuple[int, Any]:
    """(step, the "state" item) of ``step``: a number, None (the latest intact) or "best"
    (the first intact of :func:`best_first_steps`)."""
    directory = paths.path(workdir) / CHECKPOINTS_DIR
    if not has_steps(directory):  # before the manager, which would create the folder
        raise CheckpointError(f"no checkpoint in {directory}")
    if step == "best":
        order, step = best_first_steps(workdir), None
    else:
        order = None
    with make_checkpoint_manager(directory, 1) as manager:
        restored_step, restored = restore(manager, lambda s, items: {"state": state_args},
                                          step=step, order=order)
    logging.info("restored checkpoint of step %d from %s", restored_step, directory)
    return restored_step, restored["state"]


def restore_state(workdir: str | os.PathLike, like_state: Any, *,
                  step: int | str | None = None) -> tuple[int, Any]:
    """(step, train state) of a workdir's checkpoint, restored into the structure, dtypes and
    shardings of ``like_state`` (e.g. a freshly initialised one). ``step``: a number, None
    (the latest intact) or "best"; damaged steps are passed as :func:`restore` does."""
    return _restore_item(workdir, ocp.args.StandardRestore(like_state), step)


def restore_params(workdir: str | os.PathLike, like_params: Any, *,
                   step: int | str | None = None) -> tuple[int, Any]:
    """(step, parameters) of a workdir's checkpoint, without its optimiser state: no optimiser
    is needed to describe what to restore. ``like_params`` (arrays or ``jax.ShapeDtypeStruct``)
    gives the tree, shapes and dtypes, and the sharding where its leaves have one; a
    checkpoint of another tree or shape is an error. ``step`` as :func:`restore_state`."""
    _, state = _restore_item(workdir, ocp.args.StandardRestore(), step)
    params = _like(like_params, state["params"], f"checkpoint in {workdir}")
    return int(state["step"]), params


def _like(like: Any, restored: Any, where: str) -> Any:
    """``restored`` in ``like``'s dtypes (and shardings, where given); errors naming the first
    difference of tree or shape."""
    like_paths = dict(jax.tree_util.tree_flatten_with_path(like)[0])
    got_paths = dict(jax.tree_util.tree_flatten_with_path(restored)[0])
    if like_paths.keys() != got_paths.keys():
        differ = sorted(jax.tree_util.keystr(k) for k in like_paths.keys() ^ got_paths.keys())
        raise ValueError(f"{where}: the parameters do not fit the model; differing: {differ[:8]}")
    for path, leaf in like_paths.items():
        if tuple(np.shape(got_paths[path])) != tuple(leaf.shape):
            raise ValueError(f"{where}: parameter {jax.tree_util.keystr(path)} has shape "
                             f"{tuple(np.shape(got_paths[path]))}, the model's is {leaf.shape}")

    def put(leaf: Any, value: Any) -> Any:
        value = jnp.asarray(value, leaf.dtype)
        sharding = getattr(leaf, "sharding", None)
        return jax.device_put(value, sharding) if sharding is not None else value

    leaves = [put(leaf, got_paths[path]) for path, leaf in like_paths.items()]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), leaves)
