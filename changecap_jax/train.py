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
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import flax.struct
import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from changecap_jax import (
    checkpoints,
    console,
    decoding,
    evaluation,
    export,
    models,
    parallel,
    precision,
)
from changecap_jax.data import datasets, entity_inputs, pipeline
from changecap_jax.losses import caption_cross_entropy
from changecap_jax.metric_writer import MetricWriter
from changecap_jax.models.base import conditioning_shapes, extra_tokens

SCALARS_FILE = "scalars.jsonl"  # every logged scalar, one JSON object per line (report's curves)
STREAM_INPUTS = {  # caption stream -> (after-image field, reference field, id suffix)
    "semantic": ("after_semantic", "change_captions", ""),
    "distractor": ("after_distractor", "no_change_captions", "_n"),
}
DISTRACTOR_LABELS = {"semantic": 1, "distractor": 0}  # the official label: 1 = semantic


INIT_FOLD = 0x1A17  # parameters are initialised from fold_in(seed key, INIT_FOLD)
INPUTS_FOLD = 0x1A9B7  # the "inputs" rng of a step is fold_in(step key, INPUTS_FOLD)


class NonFiniteLossError(FloatingPointError):
    pass


@flax.struct.dataclass
class TrainState:
    """Everything a step changes; checkpointed with the data iterator's state.

    ``rng`` is the run's base key (raw uint32): step t draws its dropout keys from
    ``fold_in(rng, t)``, so a resumed run repeats an uninterrupted run's keys exactly.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array


# ---------------------------------------------------------------------------------------------
# Optimiser
# ---------------------------------------------------------------------------------------------


SCHEDULES = ("step_lr", "piecewise", "noam")


def learning_rate_schedule(optim: ml_collections.ConfigDict, steps_per_epoch: int) -> Any:
    """The learning rate of update ``count`` (the number of updates already made).

    ``optim.schedule``:

    * "step_lr" (default): StepLR stepped once per epoch, lr * factor ** floor(epoch /
      decay_every_epochs); update t+1 (1-based) is in epoch floor(t / steps_per_epoch), as the
      official loop (reference §7 item 8). ``decay_every_epochs = 0`` keeps lr constant.
    * "piecewise": lr * factor ** (number of ``optim.boundaries`` <= count), e.g. IDC-PCL's
      fine-tuning 3e-5 / 1.5e-5 / 7.5e-6 at 10k / 20k steps (§5.6).
    * "noam": lr * min(t / warmup, sqrt(warmup / t)) with t = count, and 1e-8 at t = 0, as
      IDC-PCL's pretraining sets it before each step (§5.6).
    """
    kind = optim.get("schedule", "step_lr")
    if kind not in SCHEDULES:
        raise ValueError(f"optim.schedule must be one of {SCHEDULES}, got {kind!r}")
    base = optim.learning_rate
    if kind == "noam":
        warmup = float(optim.warmup_steps)
        if warmup <= 0:
            raise ValueError(f"optim.warmup_steps must be > 0 for the noam schedule, got {warmup}")

        def noam(count: jax.Array) -> jax.Array:
            t = jnp.asarray(count, jnp.float32)
            lr = base * jnp.minimum(t / warmup, jnp.sqrt(warmup / jnp.maximum(t, 1.0)))
            return jnp.where(t > 0, lr, 1e-8)

        return noam
    if kind == "piecewise":
        boundaries = jnp.asarray(sorted(optim.boundaries), jnp.int32)

        def piecewise(count: jax.Array) -> jax.Array:
            passed = jnp.sum(jnp.asarray(count, jnp.int32) >= boundaries)
            return base * optim.decay_factor ** passed.astype(jnp.float32)

        return piecewise
    if not optim.decay_every_epochs:
        return optax.constant_schedule(base)
    return optax.exponential_decay(
        base,
        transition_steps=optim.decay_every_epochs * steps_per_epoch,
        decay_rate=optim.decay_factor,
        staircase=True,
    )


def zero_gradient_rows(grads: Any, rows: dict[str, int]) -> Any:
    """Zeroes given rows of parameters (torch's padding_idx gradient mask, reference §1.2)."""
    if not rows:
        return grads
    flat = flax.traverse_util.flatten_dict(grads, sep="/")
    for path, row in rows.items():
        if path not in flat:
            raise KeyError(f"optim.zero_grad_rows names {path!r}, which is not a parameter; "
                           f"parameters: {sorted(flat)[:20]}...")
        flat[path] = flat[path].at[row].set(0.0)
    return flax.traverse_util.unflatten_dict(flat, sep="/")


def frozen_labels(params: Any, frozen: tuple[str, ...] | list[str]) -> Any:
    """"frozen" for every parameter under one of the ``frozen`` top-level names, else
    "trained" (e.g. a module the official code keeps outside its optimiser)."""
    tops = set(params)
    unknown = sorted(set(frozen) - tops)
    if unknown:
        raise KeyError(f"optim.frozen names {unknown}, which are not top-level parameter "
                       f"groups; groups: {sorted(tops)}")
    return {k: jax.tree.map(lambda _, k=k: "frozen" if k in frozen else "trained", v)
            for k, v in params.items()}


def make_optimizer(optim: ml_collections.ConfigDict, steps_per_epoch: int) -> Any:
    """Adam with the StepLR schedule; ``optim.frozen`` top-level groups are never updated
    (and hold no Adam moments)."""
    schedule = learning_rate_schedule(optim, steps_per_epoch)
    chain = []
    if optim.grad_clip_norm:
        chain.append(optax.clip_by_global_norm(optim.grad_clip_norm))
    if optim.get("weight_decay", 0.0):
        # torch Adam's weight_decay: an L2 term added to the gradient before the moments.
        chain.append(optax.add_decayed_weights(optim.weight_decay))
    chain.append(optax.adam(schedule, b1=optim.b1, b2=optim.b2, eps=optim.eps))
    optimizer = optax.chain(*chain)
    frozen = tuple(optim.get("frozen", ()))
    if frozen:
        optimizer = optax.multi_transform(
            {"trained": optimizer, "frozen": optax.set_to_zero()},
            lambda params: frozen_labels(params, frozen))
    return optimizer, schedule


# ---------------------------------------------------------------------------------------------
# Loss and update step
# ---------------------------------------------------------------------------------------------


def make_loss_fn(model: Any, loss_weights: dict[str, float], mesh: Any,
                 compute_dtype: Any = jnp.float32) -> Any:
    """(params, batch, rng) -> (total loss, metrics), formed over the GLOBAL batch.

    The model runs inside ``shard_map`` on each device's share; its batch-wide losses gather
    what they need over the ``data`` axis, and the caption cross-entropy divides by the global
    count of real tokens, so the result equals a single-device computation. The parameters and
    the floating inputs are cast to ``compute_dtype`` inside the differentiated function, so
    gradients come back in the parameters' float32 (changecap_jax/precision.py).
    """
    axis = parallel.DATA_AXIS

    def per_device(params: Any, batch: dict, rng: jax.Array) -> tuple[jax.Array, dict]:
        params, batch = precision.cast_floating((params, batch), compute_dtype)
        # Each device draws its own dropout masks; "inputs" is the same key everywhere, so
        # per-example input corruption can fold in the global example index (models/base.py).
        dropout_rng = jax.random.fold_in(rng, jax.lax.axis_index(axis))
        out = model.apply({"params": params}, batch, train=True, axis_name=axis,
                          rngs={"dropout": dropout_rng,
                                "inputs": jax.random.fold_in(rng, INPUTS_FOLD)})
        unknown = set(out.aux_losses) ^ set(loss_weights)
        if unknown:
            raise ValueError(
                f"config.loss_weights {sorted(loss_weights)} must name exactly the model's "
                f"auxiliary losses {sorted(out.aux_losses)}"
            )
        reduction = out.caption_reduction
        ce = {s: caption_cross_entropy(out.caption_logits[s], out.caption_targets[s],
                                       axis_name=axis, reduction=reduction)
              for s in out.caption_logits}
        caption = sum(ce.values()) / (len(ce) if reduction == "mean" else 1)
        total = caption + sum(loss_weights[k] * v for k, v in out.aux_losses.items())
        metrics = {"loss": total, "loss/caption": caption,
                   **{f"loss/caption_{s}": v for s, v in ce.items()},
                   **{f"loss/{k}": v for k, v in out.aux_losses.items()}}
        return total, metrics

    sharded = jax.shard_map(
        per_device, mesh=mesh, in_specs=(P(), P(axis), P()), out_specs=(P(), P()),
        check_vma=False,
    )
    return sharded


def make_train_step(
    model: Any, optimizer: Any, loss_weights: dict[str, float], mesh: Any,
    zero_grad_rows: dict[str, int], schedule: Any, *, with_grads: bool = False,
    compute_dtype: Any = jnp.float32,
) -> Any:
    """The jitted update (state, global batch) -> (state, metrics); with ``with_grads`` the
    gradients come back as a third output (for tests: one compile gives both)."""
    loss_fn = make_loss_fn(model, loss_weights, mesh, compute_dtype)

    def train_step(state: TrainState, batch: dict) -> tuple:
        step_rng = jax.random.fold_in(state.rng, state.step)
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state.params, batch, step_rng)
        grads = zero_gradient_rows(grads, zero_grad_rows)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # A model may constrain its parameters after each update (e.g. clamping a logit
        # scale to log 100, as the official loop does after optimizer.step()).
        post_update = getattr(model, "post_update", None)
        if post_update is not None:
            params = post_update(params)
        metrics["learning_rate"] = schedule(state.step)
        new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state,
                               rng=state.rng)
        return (new_state, metrics, grads) if with_grads else (new_state, metrics)

    repl, data = parallel.replicated(mesh), parallel.batch_sharding(mesh)
    return jax.jit(train_step, donate_argnums=0, in_shardings=(repl, data),
                   out_shardings=(repl,) * (3 if with_grads else 2))


def init_train_state(model: Any, optimizer: Any, example: dict[str, Any], mesh: Any,
                     rng: jax.Array) -> TrainState:
    """Fresh parameters and optimiser state, replicated over ``mesh``. Only the shapes and
    dtypes of ``example`` (one example's fields) matter: the batch is made of zeros inside the
    jitted function, which also works when the mesh spans several processes."""
    shapes = {k: ((1, *np.shape(v)[1:]), v.dtype) for k, v in example.items()}
    init_rng = jax.random.fold_in(rng, INIT_FOLD)

    @functools.partial(jax.jit, out_shardings=parallel.replicated(mesh))
    def init() -> TrainState:
        batch = {k: jnp.zeros(shape, dtype) for k, (shape, dtype) in shapes.items()}
        params = model.init({"params": init_rng}, batch, train=False)["params"]
        return TrainState(step=jnp.int32(0), params=params, opt_state=optimizer.init(params),
                          rng=rng)

    return init()


# ---------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------


class Trainer:
    """Owns the dataset, model, state, checkpoints and writers of one workdir."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str | os.PathLike,
                 mesh: Any | None = None):
        self.config = config
        self.workdir = Path(workdir)
        self.mesh = mesh if mesh is not None else parallel.make_mesh()
        parallel.check_global_batch(config.batch_size, self.mesh)
        parallel.check_global_batch(config.eval_batch_size, self.mesh)
        self.is_main = jax.process_index() == 0

        ds = config.dataset
        self.dataset = datasets.prepare(
            ds.name, ds.data_dir or None, ds.variant, dict(ds.options),
            build_if_missing=ds.build_if_missing)
        self.max_len = config.decode.max_len or self.dataset.meta.max_caption_len
        self.model = models.build(config.model, vocab_size=len(self.dataset.vocab),
                                  max_len=self.max_len)
        # Extra per-pair inputs the model reads (e.g. retrieved entities), joined to records.
        self.conditioning = conditioning_shapes(self.model)
        self.extra_tokens = extra_tokens(self.model)  # ids beyond the vocabulary, e.g. [MASK]
        self.selection_metric = config.get("early_stop_metric", "CIDEr")
        self.dataset = datasets.attach_conditioning(self.dataset, self.conditioning)
        if "distractor" in self.model_streams() and not self.dataset.meta.has_distractor:
            raise datasets.DatasetError(
                f"the model trains on distractor pairs but dataset {ds.name!r} has none; set "
                f"--config.model.pairs=semantic_only (or use the dataset's preset)")
        num_train = self.dataset.meta.split_sizes.get("train") or len(self.dataset.split("train"))
        self.steps_per_epoch = math.ceil(num_train / config.batch_size)
        self.optimizer, self.schedule = make_optimizer(config.optim, self.steps_per_epoch)
        self.rng = jax.random.PRNGKey(config.seed)
        self.compute_dtype = precision.compute_dtype(config.get("compute_dtype", "float32"))
        self.train_step = make_train_step(
            self.model, self.optimizer, dict(config.loss_weights), self.mesh,
            dict(config.optim.zero_grad_rows), self.schedule, compute_dtype=self.compute_dtype)
        self.data_sharding = parallel.batch_sharding(self.mesh)
        self.history: list[tuple[int, dict[str, float]]] = []  # logged training metrics
        # The distractor classifier's jitted log-probs (B, 2) for evaluation, if it has one.
        self.judge = (jax.jit(lambda params, before, after: jax.nn.log_softmax(
            self.model.apply(*precision.cast_floating(({"params": params}, before, after),
                                                      self.compute_dtype),
                             method=self.model.classify_distractor).astype(jnp.float32)))
            if hasattr(self.model, "classify_distractor") else None)

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
        source = self.dataset.split("train")
        example = next(iter(pipeline.train_loader(source, global_batch_size=1, seed=0,
                                                  pair_fields=self.dataset.pair_fields)))
        return init_train_state(self.model, self.optimizer, pipeline.device_fields(example),
                                self.mesh, self.rng)

    def train_loader(self) -> pipeline.TrainLoader:
        """This process's training batches, read as ``config.data`` says (workers, threads,
        prefetch); the batches and the checkpointed position do not depend on it."""
        return pipeline.train_loader(
            self.dataset.split("train"), global_batch_size=self.config.batch_size,
            seed=self.config.seed, process_index=jax.process_index(),
            process_count=jax.process_count(), swap_prob=self.config.swap_prob,
            pair_fields=self.dataset.pair_fields,
            read=pipeline.read_ahead(self.config.get("data"), training=True))

    def eval_batches(self, source: Any) -> Iterator[dict[str, Any]]:
        """This process's eval batches of ``source`` (``pipeline.eval_batches``), read as
        ``config.data`` says (``eval_workers``, threads, prefetch)."""
        return pipeline.eval_batches(
            source, global_batch_size=self.config.eval_batch_size,
            process_index=jax.process_index(), process_count=jax.process_count(),
            read=pipeline.read_ahead(self.config.get("data"), training=False))

    def checkpoint_manager(self) -> ocp.CheckpointManager:
        return checkpoints.make_checkpoint_manager(self.workdir / "checkpoints",
                                                   self.config.keep_checkpoints)

    def restore(self, manager: ocp.CheckpointManager, state: TrainState, iterator: Any = None,
                step: int | None = None, *, order: list[int] | None = None,
                move_damaged_aside: bool = False) -> TrainState:
        """The state (and ``iterator``'s position) of ``step``, or of the latest intact step
        (of ``order``), passing damaged ones (``checkpoints.restore``)."""

        def args_for(step: int, items: dict[str, str]) -> dict[str, Any]:
            args = {"state": ocp.args.StandardRestore(state)}
            if iterator is not None:
                if "data" in items:
                    args["data"] = grain.checkpoint.CheckpointRestore(iterator)
                else:  # e.g. converted from PyTorch without the dataset at hand
                    logging.info("checkpoint %d has no data iterator state: the data order "
                                 "starts fresh", step)
            return args

        step, restored = checkpoints.restore(manager, args_for, step=step, order=order,
                                             move_damaged_aside=move_damaged_aside)
        logging.info("restored checkpoint of step %d from %s", step, manager.directory)
        return restored["state"]

    # -- training loop ------------------------------------------------------------------------

    def train(self) -> dict[str, Any]:
        config = self.config
        writer = MetricWriter(self.workdir / "tensorboard", enabled=self.is_main,
                              scalars_file=self.workdir / SCALARS_FILE)
        export.save_config(self.workdir, config)  # what export and report rebuild the run from
        manager = self.checkpoint_manager()
        state = self.init_state()
        iterator = iter(self.train_loader())
        if manager.latest_step() is not None:
            # Damaged newer steps are renamed aside, or orbax would skip this run's saves.
            state = self.restore(manager, state, iterator, move_damaged_aside=True)
            writer.truncate_after(int(state.step))
        elif config.get("init_from", ""):
            state = state.replace(params=init_params_from(
                state.params, config.init_from, tuple(config.get("init_exclude", ()))))
        start = int(state.step)
        stopper = EarlyStopping(self.workdir / BEST_DIR, config.get("early_stop_evals", 0),
                                self.selection_metric)
        if self.is_main:
            n_params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
            logging.info("model %s: %d parameters; %d steps per epoch; starting at step %d",
                         config.model.name, n_params, self.steps_per_epoch, start)
        total_steps = self.total_train_steps
        # ETA from the average step time, compile and evaluations left out (paused).
        bar = console.StepBar(total_steps, start, "train", disable=not self.is_main)
        last_eval: dict[str, Any] = {}
        window_start, window_steps = time.perf_counter(), 0
        for step in range(start + 1, total_steps + 1):
            batch = pipeline.to_global(next(iterator), self.data_sharding)
            state, metrics = self.train_step(state, batch)
            if step == start + 1:
                bar.unpause()  # the bar starts paused: the first call compiled
            window_steps += 1
            bar.update(1)
            if step % config.log_every_steps == 0 or step == total_steps:
                metrics = jax.device_get(metrics)
                if not np.isfinite(metrics["loss"]):
                    raise NonFiniteLossError(f"non-finite loss {metrics['loss']} at step {step}")
                elapsed = time.perf_counter() - window_start
                metrics["examples_per_second"] = window_steps * config.batch_size / elapsed
                writer.write_scalars(step, metrics)
                self.history.append((step, {k: float(v) for k, v in metrics.items()}))
                bar.set_postfix(loss=f"{metrics['loss']:.3f}")
                window_start, window_steps = time.perf_counter(), 0
            do_eval = step % config.eval_every_steps == 0 or step == total_steps
            do_save = do_eval or step % config.checkpoint_every_steps == 0
            stop = False
            if do_eval:
                bar.pause()
                final = step == total_steps and not stopper.enabled
                splits = config.final_eval_splits if final else config.eval_splits
                try:
                    last_eval = {s: self.evaluate(state, s, step, writer) for s in splits}
                except Exception:
                    # Keep the training since the last save: checkpoint, then report.
                    logging.error("evaluation at step %d failed; saved the checkpoint of step "
                                  "%d first, so a rerun resumes here", step, step)
                    _save(manager, step, state, iterator, None)
                    manager.wait_until_finished()
                    raise
                if stopper.enabled:
                    stop = stopper.update(step, last_eval, state)
                bar.unpause()
            if do_save:
                saved_metrics = ({"val_CIDEr": last_eval["val"].get("CIDEr", 0.0)}
                                 if do_eval and "val" in last_eval else None)
                _save(manager, step, state, iterator, saved_metrics)
            if stop:
                logging.info("early stop at step %d: val %s has not improved for %d "
                             "evaluations (best %.4f at step %d)", step, stopper.metric,
                             stopper.patience, stopper.best, stopper.best_step)
                break
        bar.close()
        manager.wait_until_finished()
        if stopper.enabled:  # the final splits are scored with the best validation state
            best = stopper.restore(state)
            logging.info("final evaluation of the best state (step %d)", int(best.step))
            last_eval = {s: self.evaluate(best, s, int(best.step), writer)
                         for s in config.final_eval_splits}
        writer.close()
        return last_eval

    # -- evaluation ---------------------------------------------------------------------------

    def decode_fn(self, params: Any, before: jax.Array, after: jax.Array,
                  key: jax.Array, conditioning: dict[str, jax.Array] | None = None) -> jax.Array:
        params, before, after, conditioning = precision.cast_floating(
            (params, before, after, conditioning), self.compute_dtype)
        variables = {"params": params}
        decode = self.config.decode
        if decode.get("beam_size", 1) > 1:
            if decode.sample:
                raise ValueError("decode.sample and decode.beam_size > 1 exclude each other")
            return decoding.beam_search(self.model, variables, before, after,
                                        beam_size=decode.beam_size, max_len=self.max_len,
                                        length_penalty=decode.get("length_penalty", 0.0),
                                        conditioning=conditioning).ids
        if decode.sample:
            return decoding.sample_decode(self.model, variables, before, after, key,
                                          max_len=self.max_len, conditioning=conditioning).ids
        return decoding.greedy_decode(self.model, variables, before, after,
                                      max_len=self.max_len, conditioning=conditioning).ids

    def evaluate(self, state: TrainState, split: str, step: int,
                 writer: MetricWriter | None = None) -> dict[str, Any]:
        """Decodes a split, scores it (process 0) and writes captions/ and metrics/ files."""
        config = self.config
        source = self.dataset.split(split)
        meta = self.dataset.meta
        # Cast once for the whole split; decode_fn's own cast is then a no-op per batch.
        params = precision.cast_floating(state.params, self.compute_dtype)
        process_count, process_index = jax.process_count(), jax.process_index()
        G = config.eval_batch_size
        local = G // process_count
        records: list[evaluation.PairCaption] = []
        extra: dict[str, dict[str, Any]] = {}  # per pair: the inputs beside the images
        key = jax.random.fold_in(jax.random.fold_in(self.rng, 0xE7A1), step)
        streams = [s for s in STREAM_INPUTS if s in self.model_streams()]
        batches = self.eval_batches(source)
        total = pipeline.num_eval_batches(len(source), G)
        # The §5.6 val pass's distractor accuracy, where the model and the split allow it.
        judge = self.judge if "distractor" in streams else None
        judged = {"correct": 0, "loss": 0.0, "num_pairs": 0}
        for k, batch in enumerate(tqdm(batches, total=total, desc=f"eval {split}",
                                       disable=not self.is_main, dynamic_ncols=True)):
            arrays = pipeline.to_global(
                batch, self.data_sharding,
                fields=("before", "mask", *(STREAM_INPUTS[s][0] for s in streams),
                        *(f"{c}_{s}" for c in self.conditioning for s in streams)))
            decoded = {}
            for s in streams:
                after_key = STREAM_INPUTS[s][0]
                ids = self.decode_fn(params, arrays["before"], arrays[after_key],
                                     jax.random.fold_in(key, k),
                                     {c: arrays[f"{c}_{s}"] for c in self.conditioning})
                decoded[s] = _to_host(ids)
            judge_log_probs = {s: _to_host(judge(state.params, arrays["before"],
                                                 arrays[STREAM_INPUTS[s][0]]))
                               for s in (streams if judge is not None else ())}
            mask = _to_host(arrays["mask"])
            if not self.is_main:
                continue
            real_rows = np.flatnonzero(mask)
            for s, log_probs in judge_log_probs.items():
                real, label = log_probs[real_rows], DISTRACTOR_LABELS[s]
                judged["correct"] += int(np.sum(np.argmax(real, -1) == label))
                judged["loss"] -= float(np.sum(real[:, label], dtype=np.float64))
                judged["num_pairs"] += len(real)
            for j in real_rows:
                index = k * G + j
                record = (_host_record(batch, j) if j // local == process_index
                          else source[index])
                for s in streams:
                    _, ref_key, suffix = STREAM_INPUTS[s]
                    ct = int(record["change_type"])
                    change_type = ("no_change" if s == "distractor"
                                   else (meta.change_types[ct] if ct >= 0 else ""))
                    records.append(evaluation.PairCaption(
                        image_id=_text(record["image_id"]) + suffix,
                        caption=self.dataset.vocab.decode(decoded[s][j], self.extra_tokens),
                        references=[_text(c) for c in record[ref_key]],
                        change_type=change_type))
                    if self.dataset.entities is not None:
                        extra[records[-1].image_id] = {"entities": entity_inputs.entity_texts(
                            self.dataset.entities, record[f"entity_ids_{s}"])}
        if not self.is_main:
            # Wait while process 0 scores, and learn the metric that picks the best checkpoint.
            return {self.selection_metric: _share_from_main(0.0)}
        metrics = evaluation.evaluate_pairs(records, spice=config.spice)
        metrics.update(dataset=self.dataset.name, main_metrics=list(meta.main_metrics),
                       protocol=meta.protocol)
        if judge is not None:  # held-out accuracy of the distractor classifier (§5.6 val pass)
            n = judged["num_pairs"]
            metrics["distractor"] = {"accuracy": 100.0 * judged["correct"] / n,
                                     "loss": judged["loss"] / n, "num_pairs": n}
        protocols = tuple(config.get("eval_protocols", ("coco",)))
        if "idc" in protocols:  # the IDC code's scoring of the same captions, side by side
            metrics["idc"] = evaluation.evaluate_pairs_idc(records)
        evaluation.write_results(self.workdir, split, step, records, metrics, extra=extra)
        logging.info("%s @ step %d:\n%s", split, step, evaluation.format_table(metrics))
        if "idc" in metrics:
            logging.info("protocols compared:\n%s", evaluation.format_protocol_comparison(
                {"coco": metrics, "idc": metrics["idc"]}))
        for r in records[: 2 * config.num_logged_examples: 2 if len(streams) > 1 else 1]:
            logging.info("  %s: %r | refs %r%s", r.image_id, r.caption, r.references[:2],
                         f" | inputs {extra[r.image_id]}" if r.image_id in extra else "")
        if writer is not None:
            scalars = {f"{split}/{k}": v for k, v in metrics.items() if isinstance(v, float)}
            if "distractor" in metrics:
                scalars.update({f"{split}/distractor_{k}": metrics["distractor"][k]
                                for k in ("accuracy", "loss")})
            writer.write_scalars(step, scalars)
        _share_from_main(selection_value(metrics, self.selection_metric))
        return metrics

    def model_streams(self) -> tuple[str, ...]:
        return tuple(getattr(self.model, "streams", ("semantic",)))


BEST_DIR = "best"  # the best-validation state and the early-stopping record


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

    def __init__(self, directory: Path, patience: int, metric: str = "CIDEr"):
        self.directory, self.patience, self.metric = Path(directory), int(patience), metric
        self.best, self.best_step, self.since = -math.inf, -1, 0
        record = self.directory / "record.json"
        if self.enabled and record.exists():
            saved = json.loads(record.read_text())
            self.best, self.best_step, self.since = saved["best"], saved["step"], saved["since"]

    @property
    def enabled(self) -> bool:
        return self.patience > 0

    def _manager(self) -> ocp.CheckpointManager:
        return checkpoints.make_checkpoint_manager(self.directory / "checkpoints", 1)

    def update(self, step: int, results: dict[str, dict[str, Any]], state: TrainState) -> bool:
        """Records one evaluation; saves ``state`` when it is the best. True = stop now."""
        if "val" not in results:
            raise KeyError(f"early stopping reads val {self.metric!r}; the evaluation gave "
                           f"{sorted(results)} (set config.eval_splits to include 'val')")
        value = selection_value(results["val"], self.metric)
        if value > self.best:
            self.best, self.best_step, self.since = value, step, 0
            manager = self._manager()
            manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state)),
                         force=True)
            manager.wait_until_finished()
        else:
            self.since += 1
        if jax.process_index() == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = self.directory / "record.json.tmp"
            tmp.write_text(json.dumps({"metric": self.metric, "best": self.best,
                                       "step": self.best_step, "since": self.since}))
            tmp.replace(self.directory / "record.json")
        return self.since >= self.patience

    def restore(self, like: TrainState) -> TrainState:
        manager = self._manager()
        if manager.latest_step() is None:
            raise FileNotFoundError(f"no best checkpoint in {self.directory}")
        _, restored = checkpoints.restore(
            manager, lambda step, items: {"state": ocp.args.StandardRestore(like)})
        return restored["state"]


def init_params_from(params: Any, workdir: str | os.PathLike,
                     exclude: tuple[str, ...] = ()) -> Any:
    """Parameters initialised from another run's latest checkpoint (e.g. IDC-PCL fine-tuning
    from pretraining, §5.4): every parameter whose path exists there with the same shape is
    copied, except paths containing one of ``exclude`` (the official code skips "pooler");
    the others keep their fresh initialisation. A shared path with another shape is an error."""
    manager = checkpoints.make_checkpoint_manager(Path(workdir) / "checkpoints", 1)
    if manager.latest_step() is None:
        raise FileNotFoundError(f"config.init_from: no checkpoint in {Path(workdir)}/checkpoints")
    step, source = checkpoints.restore(
        manager, lambda step, items: {"state": ocp.args.StandardRestore()})
    source_params = source["state"]["params"]
    flat_src = flax.traverse_util.flatten_dict(source_params, sep="/")
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


def _save(manager: ocp.CheckpointManager, step: int, state: TrainState, iterator: Any,
          metrics: dict[str, float] | None) -> None:
    """Checkpoints the state and the data iterator's position at ``step``."""
    manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(iterator)),
        metrics=metrics)


def _share_from_main(value: float) -> float:
    """Process 0's value on every process; also a barrier that keeps the others from racing
    ahead (e.g. into the shutdown barrier) while process 0 runs the Java scorers."""
    if jax.process_count() == 1:
        return value
    return float(multihost_utils.broadcast_one_to_all(np.float32(value)))


def _to_host(x: jax.Array) -> np.ndarray:
    """A global array on every process -> this process's full numpy copy."""
    if jax.process_count() > 1:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _host_record(batch: dict, j: int) -> dict:
    local = len(batch["mask"])
    return {k: v[j % local] for k, v in batch.items()}


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def evaluate_exported(model_dir: str | os.PathLike, workdir: str | os.PathLike,
                      config: ml_collections.ConfigDict | None = None) -> dict[str, Any]:
    """``--mode=eval --model=DIR``: scores an exported model (``changecap_jax.export``) on the
    final splits, writing captions/ and metrics/ into ``workdir``. Without ``config`` the run
    uses the exported config; with one, every field but ``model`` comes from it (another
    dataset directory, decoding, splits), and the dataset's vocabulary must be the model's."""
    exported = export.load_exported(model_dir)
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
    export.check_parameters(exported.params, export.parameter_shapes(
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
    manager = trainer.checkpoint_manager()
    if manager.latest_step() is None:
        raise FileNotFoundError(f"no checkpoint in {Path(workdir) / 'checkpoints'}")
    state = trainer.restore(manager, trainer.init_state(), step=step)
    results = {s: trainer.evaluate(state, s, int(state.step)) for s in config.final_eval_splits}
    if trainer.is_main:
        logging.info("eval results: %s", json.dumps(
            {s: {k: v for k, v in m.items() if isinstance(v, float)} for s, m in results.items()}))
    return results
