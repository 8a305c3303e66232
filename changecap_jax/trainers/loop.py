"""The one training loop: start-up, restore or ``init_from``, steps, logging, evaluation,
checkpoints and early stopping, for any :class:`Task`.

A task (captioning: ``captioning.Trainer``; IDC-PCL pretraining: ``pretraining.PretrainTrainer``,
whose losses live in ``models/idc_pcl_pretraining.py``) says what differs: its state, its
checkpointed data streams, its update per step (possibly a task drawn per step), how a log
window becomes scalars, and its evaluation. Everything else is here, once, so both tasks log
the same timing scalars (``steps_per_second`` and ``examples_per_second``), check for a
non-finite update the same way (:class:`FiniteGuard`: before every log, evaluation and save, so
no checkpoint holds a diverged state), save before re-raising a failed evaluation, and save and
stop at the next step after a preemption notice (``trainers/preemption.py``).

Saves are asynchronous by default (``config.async_checkpoints``, ``checkpoints``): the loop
waits for the save in flight before it reads a checkpoint or names the last one kept, before
raising :class:`Preempted`, and however it ends (``manager.close()``), and logs the seconds it
was blocked in saves (``checkpoint_wait_s``, per log window).

Section numbers (§) refer to docs/official/ (see its README.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from typing import Any, Protocol

import jax
import ml_collections
import orbax.checkpoint as ocp

from changecap_jax import console
from changecap_jax.cpu import allocator
from changecap_jax.errors import TrainingDivergedError
from changecap_jax.io import checkpoints, paths, run_config
from changecap_jax.io.jsonio import write_json_atomic
from changecap_jax.io.metric_writer import SCALARS_FILE, MetricWriter
from changecap_jax.trainers import profiling
from changecap_jax.trainers.preemption import Preempted, PreemptionNotice
from changecap_jax.trainers.update import NONFINITE_METRIC, TrainState

BEST_DIR = "best"  # the best-validation state and the early-stopping record


class Task(Protocol):
    """What :func:`run` calls on a task; ``history`` receives (step, scalars) per log."""

    config: ml_collections.ConfigDict
    workdir: paths.AnyPath
    is_main: bool
    history: list[tuple[int, dict[str, float]]]
    selection_metric: str
    bar_label: str  # the progress bar's description

    @property
    def total_train_steps(self) -> int: ...

    def checkpoint_manager(self) -> ocp.CheckpointManager: ...

    def init_state(self) -> TrainState: ...

    def data_streams(self) -> dict[str, Any]:
        """Checkpoint item name -> this process's endless, checkpointable batch iterator."""

    def describe(self, state: TrainState, start: int) -> None:
        """Logs what is trained, once at start-up."""

    def run_step(self, state: TrainState, step: int,
                 streams: dict[str, Any]) -> tuple[TrainState, dict, str]:
        """Update ``step`` (1-based): (new state, device metrics, window key)."""

    def examples_per_step(self, key: str) -> int: ...

    def window_scalars(self, window: list[tuple[str, dict]]) -> dict[str, float]:
        """The scalars logged for the (key, metrics) steps since the last log."""

    def evaluate_at(self, state: TrainState, step: int, writer: MetricWriter | None,
                    final: bool) -> dict[str, Any]:
        """Evaluates ``state``; ``final``: the last evaluation of a run without early stop."""


# ---------------------------------------------------------------------------------------------
# Early stopping
# ---------------------------------------------------------------------------------------------


def selection_value(metrics: dict[str, Any], name: str) -> float:
    """The metric that selects checkpoints: a top-level key ("CIDEr") or PROTOCOL/KEY of a
    second protocol's scores ("idc/CIDEr")."""
    if name in metrics:  # also how other processes receive process 0's value
        return float(metrics[name])
    node: Any = metrics
    for part in name.split("/"):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(f"selection metric {name!r} is not in the evaluation results "
                           f"(keys: {sorted(metrics)}); set config.early_stop_metric, and "
                           "config.eval_protocols to include 'idc' for idc/...")
        node = node[part]
    return float(node)


class EarlyStopping:
    """Early stopping on a validation metric (IDC-PCL ``finetune.py``: stop after
    ``patience`` evaluations without improvement, then test the best checkpoint).

    The best state is saved to ``<workdir>/best`` with a ``record.json`` holding the best value,
    its step and the count of evaluations since, so a resumed run continues the count.
    ``patience = 0`` disables it (the trainer then scores the last state)."""

    def __init__(self, directory: str | os.PathLike, patience: int, metric: str = "CIDEr"):
        self.directory, self.patience, self.metric = paths.path(directory), int(patience), metric
        self.best, self.best_step, self.since = -math.inf, -1, 0
        record = self.directory / "record.json"
        if self.enabled and record.exists():
            saved = json.loads(record.read_text())
            self.best, self.best_step, self.since = saved["best"], saved["step"], saved["since"]

    @property
    def enabled(self) -> bool:
        return self.patience > 0

    def _manager(self) -> ocp.CheckpointManager:
        return checkpoints.make_checkpoint_manager(self.directory / "checkpoints", 1, writer=True)

    def update(self, step: int, results: dict[str, dict[str, Any]], state: TrainState) -> bool:
        """Records one evaluation; saves ``state`` when it is the best. True = stop now."""
        if "val" not in results:
            raise KeyError(f"early stopping reads val {self.metric!r}; the evaluation gave "
                           f"{sorted(results)} (set config.eval_splits to include 'val')")
        value = selection_value(results["val"], self.metric)
        if value > self.best:
            self.best, self.best_step, self.since = value, step, 0
            with self._manager() as manager:
                manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state)),
                             force=True)
                manager.wait_until_finished()
        else:
            self.since += 1
        if jax.process_index() == 0:
            write_json_atomic(self.directory / "record.json",
                              {"metric": self.metric, "best": self.best,
                               "step": self.best_step, "since": self.since})
        return self.since >= self.patience

    def restore(self, like: TrainState) -> TrainState:
        with self._manager() as manager:
            if manager.latest_step() is None:
                raise FileNotFoundError(f"no best checkpoint in {self.directory}")
            _, restored = checkpoints.restore(
                manager, lambda step, items: {"state": ocp.args.StandardRestore(like)})
        return restored["state"]


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------


def start(task: Task, manager: ocp.CheckpointManager, writer: MetricWriter,
          streams: dict[str, Any]) -> TrainState:
    """The state to train from: the latest checkpoint (damaged newer steps renamed aside, or
    orbax would skip this run's saves of them), else fresh or ``config.init_from``."""
    config = task.config
    state = task.init_state()
    if manager.latest_step() is not None:
        state = checkpoints.restore_train_state(manager, state, streams,
                                                 move_damaged_aside=True)
        writer.truncate_after(int(state.step))
    elif config.get("init_from", ""):
        state = state.replace(params=checkpoints.init_params_from(
            state.params, config.init_from, tuple(config.get("init_exclude", ()))))
    return state


class _Window:
    """The steps since the last log and their wall-clock time."""

    def __init__(self, checkpoint_wait: float = 0.0) -> None:
        self.steps: list[tuple[str, dict]] = []
        self.examples = 0
        self.start = time.perf_counter()
        # Seconds the loop was blocked in checkpoint saves: a save comes after the log of
        # its step, so it is counted in the next window.
        self.checkpoint_wait = checkpoint_wait

    def add(self, key: str, metrics: dict, examples: int) -> None:
        self.steps.append((key, metrics))
        self.examples += examples

    def scalars(self, task: Task) -> dict[str, float]:
        scalars = task.window_scalars(self.steps)
        elapsed = time.perf_counter() - self.start
        scalars["steps_per_second"] = len(self.steps) / elapsed
        scalars["examples_per_second"] = self.examples / elapsed
        scalars["checkpoint_wait_s"] = self.checkpoint_wait
        return scalars


class FiniteGuard:
    """Reads the steps' non-finite flags (``update.NONFINITE_METRIC``) when the loop syncs
    with the device anyway (a log, an evaluation, a save), so it adds no sync of its own.

    Without ``skip``, a non-finite step raises :class:`TrainingDivergedError` naming it and
    the last checkpoint kept, before anything of it is saved or evaluated. With ``skip`` (the
    update step then left the state as it was) the skipped steps are logged and counted.
    """

    def __init__(self, skip: bool):
        self.skip = skip
        self.unchecked: list[tuple[int, Any]] = []
        self.skipped_since_log = 0

    def add(self, step: int, metrics: dict) -> None:
        """Takes ``step``'s flag out of its metrics (it is no scalar to log)."""
        self.unchecked.append((step, metrics.pop(NONFINITE_METRIC)))

    def check(self, manager: ocp.CheckpointManager) -> None:
        if not self.unchecked:
            return
        flags = jax.device_get([flag for _, flag in self.unchecked])
        bad = [step for (step, _), flag in zip(self.unchecked, flags, strict=True) if flag]
        self.unchecked = []
        if not bad:
            return
        if not self.skip:
            manager.wait_until_finished()
            kept = manager.latest_step()
            raise TrainingDivergedError(
                f"training diverged: step {bad[0]} gave a non-finite loss, gradient or "
                "parameter; stopped before saving it. "
                + (f"The last checkpoint, step {kept} in {manager.directory}, is finite and "
                   "kept" if kept is not None else "No checkpoint was saved before it")
                + ". Lower config.optim.learning_rate, or set "
                "--config.skip_nonfinite_updates=True to skip such updates")
        self.skipped_since_log += len(bad)
        logging.warning("skipped %d non-finite update(s) (steps %s); the parameters stayed "
                        "as they were", len(bad), ", ".join(map(str, bad[:10])))

    def take_skipped(self) -> int:
        """The skipped updates since the last call (a log window's count)."""
        count, self.skipped_since_log = self.skipped_since_log, 0
        return count


def _evaluate(task: Task, manager: ocp.CheckpointManager, state: TrainState, step: int,
              streams: dict[str, Any], writer: MetricWriter, final: bool) -> dict[str, Any]:
    """The task's evaluation; on failure the training since the last save is kept first."""
    try:
        results = task.evaluate_at(state, step, writer, final)
        allocator.release()  # what fragmentation kept since the last one (cpu/allocator.py)
        return results
    except Exception:
        logging.error("evaluation at step %d failed; saved the checkpoint of step %d first, "
                      "so a rerun resumes here", step, step)
        checkpoints.save(manager, step, state, streams)
        manager.wait_until_finished()  # on disk before the error ends the run
        raise


def _checkpoint_metrics(results: dict[str, Any]) -> dict[str, float] | None:
    """What the checkpoint manager keeps the best step by (``checkpoints``: val_CIDEr)."""
    if "val" not in results or not isinstance(results["val"], dict):
        return None
    return {"val_CIDEr": results["val"].get("CIDEr", 0.0)}


def run(task: Task) -> dict[str, Any]:
    """Runs (or resumes) ``task`` to ``task.total_train_steps``; returns the last evaluation
    (with early stopping: the best validation state's on the final splits)."""
    config = task.config
    writer = MetricWriter(task.workdir / "tensorboard", enabled=task.is_main,
                          scalars_file=task.workdir / SCALARS_FILE)
    manager = None
    streams: dict[str, Any] = {}
    notice = PreemptionNotice()
    # Closed however the start ends too (a restore that fails, a user error): on Python 3.12
    # tensorboardX's exit hook cannot close a writer left open, and prints a traceback.
    try:
        run_config.save_config(task.workdir, config)  # what export and report rebuild from
        manager = task.checkpoint_manager()
        streams = task.data_streams()
        state = start(task, manager, writer, streams)
        stopper = EarlyStopping(task.workdir / BEST_DIR, config.get("early_stop_evals", 0),
                                task.selection_metric)
        if task.is_main:
            task.describe(state, int(state.step))
        return _train(task, manager, writer, streams, state, stopper, notice)
    finally:
        notice.close()
        for stream in streams.values():  # reading threads (device prefetch, grain) end here
            if hasattr(stream, "close"):
                stream.close()
        if manager is not None:
            manager.close()  # waits for a save in flight: a run ends with its saves on disk
        writer.close()


def _log(task: Task, writer: MetricWriter, window: _Window, guard: FiniteGuard,
         bar: console.StepBar, step: int, key: str) -> None:
    """Writes the scalars of the log window that ends at ``step``."""
    scalars = window.scalars(task)
    if guard.skip:
        scalars["skipped_updates"] = float(guard.take_skipped())
    writer.write_scalars(step, scalars)
    task.history.append((step, scalars))
    bar.set_postfix(loss=f"{scalars.get(f'{key}/loss', scalars.get('loss')):.3f}")


def _train(task: Task, manager: ocp.CheckpointManager, writer: MetricWriter,
           streams: dict[str, Any], state: TrainState, stopper: EarlyStopping,
           notice: PreemptionNotice) -> dict[str, Any]:
    """The steps of :func:`run` from ``state`` on; returns the last evaluation. Raises
    :class:`Preempted` after saving the step a preemption notice stopped at."""
    config = task.config
    first, total = int(state.step), task.total_train_steps
    # ETA from the average step time, compiles and evaluations left out (paused).
    bar = console.StepBar(total, first, task.bar_label, disable=not task.is_main)
    results: dict[str, Any] = {}
    window = _Window()
    guard = FiniteGuard(skip=config.get("skip_nonfinite_updates", False))
    profiler = profiling.StepProfiler(config.get("profile_steps", ()), task.workdir,
                                      task.is_main, first)
    # Both closed on an error too: an open bar would swallow the error's line, and an open
    # trace would hold the profile of the steps before it.
    with bar, contextlib.closing(profiler):
        for step in range(first + 1, total + 1):
            state, metrics, key = profiler.step(step, task.run_step, state, step, streams)
            if step == first + 1:
                bar.unpause()  # the bar starts paused: the first call compiled
            guard.add(step, metrics)
            window.add(key, metrics, task.examples_per_step(key))
            bar.update(1)
            preempted = notice.reached(step)
            do_log = step % config.log_every_steps == 0 or step == total or preempted
            do_eval = (step % config.eval_every_steps == 0 or step == total) and not preempted
            do_save = do_eval or step % config.checkpoint_every_steps == 0 or preempted
            if do_log or do_save:  # each syncs with the device anyway
                guard.check(manager)
            if do_log:
                _log(task, writer, window, guard, bar, step, key)
                window = _Window()
            stop = False
            if do_eval:
                bar.pause()
                final = step == total and not stopper.enabled
                results = _evaluate(task, manager, state, step, streams, writer, final)
                if stopper.enabled:
                    stop = stopper.update(step, results, state)
                bar.unpause()
            if do_save:
                window.checkpoint_wait += checkpoints.save(
                    manager, step, state, streams,
                    _checkpoint_metrics(results) if do_eval else None)
            if preempted:
                manager.wait_until_finished()  # the run stops with this step on disk
                raise Preempted(step, manager.directory)
            if stop:
                logging.info("early stop at step %d: val %s has not improved for %d "
                             "evaluations (best %.4f at step %d)", step, stopper.metric,
                             stopper.patience, stopper.best, stopper.best_step)
                break
    manager.wait_until_finished()  # the run's last save on disk before anything reads it
    if stopper.enabled:  # the final splits are scored with the best validation state
        best = stopper.restore(state)
        logging.info("final evaluation of the best state (step %d)", int(best.step))
        results = task.evaluate_at(best, int(best.step), writer, True)
    return results
