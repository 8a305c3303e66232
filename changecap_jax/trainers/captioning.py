"""The model-agnostic trainer: mesh, input, model, update step, evaluation, checkpoints, loop.

A model is a Flax module (``models.build``) returning a :class:`~models.base.ModelOutput`;
the loss is the mean of its caption streams' cross-entropies plus each auxiliary loss times
``config.loss_weights[name]``. Nothing here depends on which model it is.

Section numbers (§) and quirk ids (S-Q, D-Q, I-Q) refer to docs/official/ (see its README.md).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from changecap_jax import console, experiment, exported_model, parallel
from changecap_jax.data import datasets, pipeline
from changecap_jax.data.streams import STREAM_INPUTS
from changecap_jax.decoding import search
from changecap_jax.evaluators import captions, common, idc_protocol
from changecap_jax.evaluators.results import write_results
from changecap_jax.io import checkpoints, paths
from changecap_jax.io.metric_writer import MetricWriter
from changecap_jax.models import contract, precision
from changecap_jax.trainers import loop, on_device_data
from changecap_jax.trainers.caption_step import init_train_state, make_train_step
from changecap_jax.trainers.device_prefetch import DevicePrefetch
from changecap_jax.trainers.optimizers import make_optimizer
from changecap_jax.trainers.update import TrainState


def fresh_state(exp: experiment.Experiment, optimizer: Any, rng: jax.Array) -> TrainState:
    """Fresh parameters and optimiser state of ``exp``'s model, replicated over its mesh; one
    training example of its dataset gives the shapes (:func:`init_train_state`)."""
    example = next(iter(pipeline.train_loader(exp.dataset.split("train"), global_batch_size=1,
                                              seed=0, pair_fields=exp.dataset.pair_fields)))
    return init_train_state(exp.model, optimizer, pipeline.device_fields(example), exp.mesh,
                            rng)


def training_batches(exp: experiment.Experiment) -> pipeline.TrainLoader:
    """This process's training batches of ``exp``, read as ``config.data`` says (workers,
    threads, prefetch); the batches and the checkpointed position do not depend on it."""
    config = exp.config
    return pipeline.train_loader(
        exp.dataset.split("train"), global_batch_size=config.batch_size, seed=config.seed,
        process_index=jax.process_index(), process_count=jax.process_count(),
        swap_prob=config.swap_prob, pair_fields=exp.dataset.pair_fields,
        read=pipeline.read_ahead(config.get("data"), training=True))


# ---------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------


class Trainer:
    """Owns the dataset, model, state, checkpoints and writers of one workdir."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str | os.PathLike,
                 mesh: Any | None = None):
        self.config = config
        self.workdir = paths.path(workdir)
        self.experiment = experiment.build(config, mesh=mesh)
        self.mesh = self.experiment.mesh
        self.is_main = jax.process_index() == 0
        self.dataset, self.model = self.experiment.dataset, self.experiment.model
        self.max_len = self.experiment.max_len
        # Extra per-pair inputs the model reads (e.g. retrieved entities), joined to records.
        self.conditioning = self.experiment.conditioning
        self.extra_tokens = self.experiment.extra_tokens  # ids beyond the vocabulary, e.g. [MASK]
        self.selection_metric = config.get("early_stop_metric", "CIDEr")
        self.steps_per_epoch = self.experiment.steps_per_epoch
        self.optimizer, self.schedule = make_optimizer(config.optim, self.steps_per_epoch)
        self.rng = jax.random.PRNGKey(config.seed)
        self.compute_dtype = self.experiment.compute_dtype
        self.train_step = make_train_step(
            self.model, self.optimizer, dict(config.loss_weights), self.mesh,
            dict(config.optim.zero_grad_rows), self.schedule, compute_dtype=self.compute_dtype,
            skip_nonfinite=config.get("skip_nonfinite_updates", False))
        self.data_sharding = parallel.batch_sharding(self.mesh)
        self.history: list[tuple[int, dict[str, float]]] = []  # logged training metrics

    @property
    def total_train_steps(self) -> int:
        """``num_train_steps``, or with ``finish_last_epoch`` rounded up to whole epochs: the
        official loop tests ``t < max_iter`` only between epochs, so 10,000 iterations at 265
        per epoch run 10,070 updates (reference §3.8)."""
        n = self.config.num_train_steps
        if self.config.get("finish_last_epoch", False):
            n = math.ceil(n / self.steps_per_epoch) * self.steps_per_epoch
        return n

    # -- state --------------------------------------------------------------------------------

    def init_state(self) -> TrainState:
        """Fresh parameters and optimiser state, replicated over the mesh.

        Only the shapes of a batch matter, so the example batch is made of zeros inside the
        jitted function (this also works when the mesh spans several processes).
        """
        return fresh_state(self.experiment, self.optimizer, self.rng)

    def train_loader(self) -> pipeline.TrainLoader:
        """This process's training batches, read as ``config.data`` says (workers, threads,
        prefetch); the batches and the checkpointed position do not depend on it."""
        return training_batches(self.experiment)

    def eval_batches(self, source: Any) -> Iterator[dict[str, Any]]:
        """This process's eval batches of ``source`` (``pipeline.eval_batches``), read as
        ``config.data`` says (``eval_workers``, threads, prefetch)."""
        return pipeline.eval_batches(
            source, global_batch_size=self.config.eval_batch_size,
            process_index=jax.process_index(), process_count=jax.process_count(),
            read=pipeline.read_ahead(self.config.get("data"), training=False))

    def checkpoint_manager(self) -> ocp.CheckpointManager:
        return checkpoints.make_checkpoint_manager(
            self.workdir / "checkpoints", self.config.keep_checkpoints, writer=True,
            asynchronous=self.config.get("async_checkpoints", True))

    def restore(self, manager: ocp.CheckpointManager, state: TrainState, iterator: Any = None,
                step: int | None = None, *, order: list[int] | None = None,
                move_damaged_aside: bool = False) -> TrainState:
        """The state (and ``iterator``'s position) of ``step``, or of the latest intact step
        (of ``order``), passing damaged ones (``checkpoints.restore``)."""

        streams = {"data": iterator} if iterator is not None else {}
        return checkpoints.restore_train_state(manager, state, streams, step, order=order,
                            move_damaged_aside=move_damaged_aside)

    # -- training loop ------------------------------------------------------------------------

    def train(self) -> dict[str, Any]:
        """Runs (or resumes) the training (``loop.run``); returns the last evaluation."""
        return loop.run(self)

    # -- what the loop calls (loop.Task) ------------------------------------------------------

    bar_label = "train"

    @property
    def on_device(self) -> bool:
        """Whether the training split lives on the devices (``config.dataset.on_device``)."""
        return bool(self.config.dataset.get("on_device", False))

    @property
    def prefetch_depth(self) -> int:
        """Streamed batches moved to the devices ahead of the step (``config.data``)."""
        return int((self.config.get("data") or {}).get("device_prefetch", 0))

    @functools.cached_property
    def resident(self) -> on_device_data.ResidentSplit:
        """The training split on the devices, put there on first use."""
        return on_device_data.ResidentSplit(self.dataset.split("train"), self.mesh,
                                            self.dataset.pair_fields)

    @functools.cached_property
    def resident_step(self) -> Any:
        return on_device_data.make_resident_step(self.train_step, self.resident)

    def _resident_update(self, state: TrainState, choices: dict) -> tuple[TrainState, dict]:
        args = (state, self.resident.arrays, choices)
        if "_compiled_resident" not in self.__dict__:
            # Every host compiles before any enters the step's first collective (the
            # gather's reduce-scatter), which gloo abandons when a host is 30 s late.
            self._compiled_resident = self.resident_step.lower(*args).compile()
            parallel.barrier("changecap_jax.on_device_step_compiled")
        return self._compiled_resident(*args)

    def data_streams(self) -> dict[str, Any]:
        loader = self.train_loader()
        if self.on_device:  # the step gathers its batch from the resident split
            return {"data": on_device_data.ResidentIterator(loader, self.resident)}
        stream = iter(loader)
        if self.prefetch_depth:
            stream = DevicePrefetch(
                stream, lambda b: pipeline.to_global(b, self.data_sharding), self.prefetch_depth)
        return {"data": stream}

    def describe(self, state: TrainState, start: int) -> None:
        n_params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
        logging.info("model %s: %d parameters; %d steps per epoch; starting at step %d",
                     self.config.model.name, n_params, self.steps_per_epoch, start)

    def run_step(self, state: TrainState, step: int,
                 streams: dict[str, Any]) -> tuple[TrainState, dict, str]:
        item = next(streams["data"])
        if self.on_device:
            state, metrics = self._resident_update(state, self.resident.to_global(item))
        else:
            batch = item if self.prefetch_depth else pipeline.to_global(item, self.data_sharding)
            state, metrics = self.train_step(state, batch)
        return state, metrics, ""

    def examples_per_step(self, key: str) -> int:
        return self.config.batch_size

    def window_scalars(self, window: list[tuple[str, dict]]) -> dict[str, float]:
        """The last step's metrics (the loss is logged per step, not averaged)."""
        return {k: float(v) for k, v in jax.device_get(window[-1][1]).items()}

    def evaluate_at(self, state: TrainState, step: int, writer: MetricWriter | None,
                    final: bool) -> dict[str, Any]:
        splits = self.config.final_eval_splits if final else self.config.eval_splits
        return {s: self.evaluate(state, s, step, writer) for s in splits}

    # -- evaluation ---------------------------------------------------------------------------

    def decode_fn(self, params: Any, before: jax.Array, after: jax.Array,
                  key: jax.Array, conditioning: dict[str, jax.Array] | None = None) -> jax.Array:
        """Caption ids of a batch as ``config.decode`` says (``search.decode_ids``)."""
        return search.decode_ids(self.model, params, before, after,
                                   decode_config=self.config.decode, max_len=self.max_len,
                                   key=key, conditioning=conditioning,
                                   compute_dtype=self.compute_dtype)

    @functools.cached_property
    def evaluators(self) -> list[common.Evaluator]:
        """What an evaluation computes beside the captions (``common.choose``; built once,
        so the distractor judge compiles once)."""
        return common.choose(self.config, self.dataset, self.model, self.compute_dtype,
                                 self.eval_streams(), tuple(self.conditioning))

    def eval_streams(self) -> tuple[str, ...]:
        return tuple(s for s in STREAM_INPUTS if s in self.model_streams())

    def evaluate(self, state: TrainState, split: str, step: int,
                 writer: MetricWriter | None = None) -> dict[str, Any]:
        """Decodes a split, scores it (process 0) and writes captions/ and metrics/ files."""
        source = self.dataset.split(split)
        # Cast once for the whole split; decode_fn's own cast is then a no-op per batch.
        params = precision.cast_floating(state.params, self.compute_dtype)
        key = jax.random.fold_in(jax.random.fold_in(self.rng, 0xE7A1), step)
        streams = self.eval_streams()
        for evaluator in self.evaluators:
            evaluator.start(split)
        records: list[captions.PairCaption] = []
        total = pipeline.num_eval_batches(len(source), self.config.eval_batch_size)
        for k, batch in enumerate(console.Progress(self.eval_batches(source), total=total,
                                                   desc=f"eval {split}",
                                                   disable=not self.is_main, dynamic_ncols=True)):
            arrays = pipeline.to_global(
                batch, self.data_sharding,
                fields=("before", "mask", *(STREAM_INPUTS[s][0] for s in streams),
                        *(f"{c}_{s}" for c in self.conditioning for s in streams)))
            decoded = {s: common.to_host(self.decode_fn(
                params, arrays["before"], arrays[STREAM_INPUTS[s][0]], jax.random.fold_in(key, k),
                {c: arrays[f"{c}_{s}"] for c in self.conditioning})) for s in streams}
            real_rows = np.flatnonzero(common.to_host(arrays["mask"]))
            pairs = (self._pair_captions(batch, k, real_rows, decoded, source)
                     if self.is_main else [])
            view = common.EvalBatch(state.params, arrays,
                                        {s: STREAM_INPUTS[s][0] for s in streams},
                                        real_rows if self.is_main else None, pairs,
                                        decoded)
            for evaluator in self.evaluators:
                evaluator.add(view)
            records.extend(caption for _, _, caption in pairs)
        if not self.is_main:
            # Wait while process 0 scores, and learn the metric that picks the best checkpoint.
            return {self.selection_metric: _share_from_main(0.0)}
        metrics: dict[str, Any] = {}
        extra: dict[str, dict[str, Any]] = {}  # per pair: the inputs beside the images
        for evaluator in self.evaluators:
            metrics.update(evaluator.finish(records))
            for image_id, fields in evaluator.extra.items():
                extra.setdefault(image_id, {}).update(fields)
        write_results(self.workdir, split, step, records, metrics, extra=extra)
        self._log_evaluation(split, step, records, metrics, extra, writer)
        _share_from_main(loop.selection_value(metrics, self.selection_metric))
        return metrics

    def _pair_captions(self, batch: dict, k: int, real_rows: np.ndarray,
                       decoded: dict[str, np.ndarray],
                       source: Any) -> list[tuple[str, dict, captions.PairCaption]]:
        """(stream, record, caption) of each real row of eval batch ``k`` and each stream."""
        G = self.config.eval_batch_size
        local, process_index = G // jax.process_count(), jax.process_index()
        change_types = self.dataset.meta.change_types
        pairs = []
        for j in real_rows:
            record = (_host_record(batch, j) if j // local == process_index
                      else source[k * G + j])
            for s, ids in decoded.items():
                _, ref_key, suffix = STREAM_INPUTS[s]
                ct = int(record["change_type"])
                change_type = ("no_change" if s == "distractor"
                               else (change_types[ct] if ct >= 0 else ""))
                pairs.append((s, record, captions.PairCaption(
                    image_id=_text(record["image_id"]) + suffix,
                    caption=self.dataset.vocab.decode(ids[j], self.extra_tokens),
                    references=[_text(c) for c in record[ref_key]],
                    change_type=change_type)))
        return pairs

    def _log_evaluation(self, split: str, step: int, records: list[captions.PairCaption],
                        metrics: dict[str, Any], extra: dict[str, dict[str, Any]],
                        writer: MetricWriter | None) -> None:
        """The metrics table, the protocols side by side, a few examples, the scalars."""
        logging.info("%s @ step %d:\n%s", split, step, captions.format_table(metrics))
        if "idc" in metrics:
            logging.info("protocols compared:\n%s", idc_protocol.format_protocol_comparison(
                {"coco": metrics, "idc": metrics["idc"]}))
        every = 2 if len(self.eval_streams()) > 1 else 1
        for r in records[: 2 * self.config.num_logged_examples: every]:
            logging.info("  %s: %r | refs %r%s", r.image_id, r.caption, r.references[:2],
                         f" | inputs {extra[r.image_id]}" if r.image_id in extra else "")
        if writer is not None:
            scalars = {f"{split}/{k}": v for k, v in metrics.items() if isinstance(v, float)}
            if "distractor" in metrics:
                scalars.update({f"{split}/distractor_{k}": metrics["distractor"][k]
                                for k in ("accuracy", "loss")})
            scalars.update({f"{split}/router_{k}": v for k, v in metrics.get("router", {}).items()
                            if k.endswith("accuracy") and v is not None})
            writer.write_scalars(step, scalars)

    def model_streams(self) -> tuple[str, ...]:
        return contract.model_streams(self.model)


def _share_from_main(value: float) -> float:
    """Process 0's value on every process; also a barrier that keeps the others from racing
    ahead (e.g. into the shutdown barrier) while process 0 runs the Java scorers."""
    if jax.process_count() == 1:
        return value
    return float(multihost_utils.broadcast_one_to_all(np.float32(value)))


def _host_record(batch: dict, j: int) -> dict:
    local = len(batch["mask"])
    return {k: v[j % local] for k, v in batch.items()}


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def evaluate_exported(model_dir: str | os.PathLike, workdir: str | os.PathLike,
                      config: ml_collections.ConfigDict | None = None) -> dict[str, Any]:
    """``--mode=eval --model=DIR``: scores an exported model (``changecap_jax.exported_model``)
    on the
    final splits, writing captions/ and metrics/ into ``workdir``. Without ``config`` the run
    uses the exported config; with one, every field but ``model`` comes from it (another
    dataset directory, decoding, splits), and the dataset's vocabulary must be the model's."""
    exported = exported_model.load_exported(model_dir)
    run = exported.config
    if config is not None:
        run = ml_collections.ConfigDict(config.to_dict())
        run.model = exported.config.model
    trainer = Trainer(run, workdir)
    if trainer.dataset.vocab != exported.vocab:
        raise datasets.DatasetError(
            f"dataset {trainer.dataset.name!r} in {trainer.dataset.directory} has another "
            f"vocabulary ({len(trainer.dataset.vocab)} words) than the model in {model_dir} "
            f"({len(exported.vocab)} words)")
    if trainer.max_len != exported.max_len:
        raise datasets.DatasetError(
            f"the model in {model_dir} decodes {exported.max_len} tokens but this run "
            f"{trainer.max_len}; set --config.decode.max_len={exported.max_len}")
    exported_model.check_parameters(exported.params, exported_model.parameter_shapes(
        trainer.model, trainer.dataset.meta, trainer.max_len), str(model_dir))
    params = jax.device_put(exported.params, parallel.replicated(trainer.mesh))
    state = TrainState(step=jnp.int32(exported.step), params=params, opt_state=None,
                       rng=trainer.rng)
    results = {s: trainer.evaluate(state, s, exported.step) for s in run.final_eval_splits}
    if trainer.is_main:
        logging.info("eval results: %s", json.dumps(
            {s: {k: v for k, v in m.items() if isinstance(v, float)} for s, m in results.items()}))
    return results


def evaluate_checkpoint(config: ml_collections.ConfigDict, workdir: str | os.PathLike,
                        step: int | None = None) -> dict[str, Any]:
    """``--mode=eval``: restores a checkpoint (latest by default) and scores the final splits."""
    trainer = Trainer(config, workdir)
    with trainer.checkpoint_manager() as manager:
        if manager.latest_step() is None:
            raise FileNotFoundError(f"no checkpoint in {paths.path(workdir) / 'checkpoints'}")
        state = trainer.restore(manager, trainer.init_state(), step=step)
    results = {s: trainer.evaluate(state, s, int(state.step)) for s in config.final_eval_splits}
    if trainer.is_main:
        logging.info("eval results: %s", json.dumps(
            {s: {k: v for k, v in m.items() if isinstance(v, float)} for s, m in results.items()}))
    return results
