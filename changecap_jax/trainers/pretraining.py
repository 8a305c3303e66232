"""IDC-PCL pretraining: one task drawn per step (reference §5.3, §5.6).

    python -m changecap_jax.main --config=configs/idc_pcl.py:pretrain[/DATASET] --workdir=P

``main`` runs this for any config with a ``pretrain`` block; the fine-tuning preset then starts
from it with ``--config.init_from=P`` (same ``checkpoints/`` layout, a ``state`` item).

* Task draw (§5.3): update t (1-based) draws one of ``pretrain.tasks`` with probabilities
  proportional to their weights in ``pretrain.task_ratio`` (one weight per task of
  :data:`TASKS`, official 8:1:2; 9:1:2 for Birds-to-Words) from a numpy Generator seeded
  [seed, t]: a function of (seed, t) alone, so every process draws the same task and a resumed
  run draws what the uninterrupted run would have.
* Data (§5.1, ``data/pretrain_samples.py``): one sample per image pair (semantic pairs and,
  where the dataset has them, distractor pairs), each task with its own endless seeded grain
  iterator (the official per-task loaders, restarted on exhaustion). A step reads the next
  batch of the drawn task's iterator: ``batch_size`` examples' worth of pairs (batch_size x
  streams samples) for MLM and MVCL, ``pretrain.fda_batch_size`` samples for FDA.
* One jitted update per task (compiled once each), Adam with ``optim``'s schedule (noam in the
  presets, §5.6), built by the trunk's ``update.make_update_step`` over the task's loss; the
  losses over the GLOBAL batch (mlm, mvcl, fda, and the classification source's) are
  ``models/idc_pcl_pretraining.py``. The steps run in the trunk's one loop (``loop.run``).
* Checkpoints: the state and each task's iterator in one orbax Composite (the task draw needs
  no counter), so a resumed run continues every stream exactly.
* Validation every ``eval_every_steps``: each task's loss (MLM and FDA accuracy, FDA positive
  and negative similarity) averaged over ``pretrain.val_batches`` fixed val batches with fixed
  masks, to the MetricWriter, the log and ``metrics/pretrain_val_<step>.json``.

Cross-task source (paper §2.4, appendix A.3; ``config.pretrain.extra_source``; I-Q16: the
official bird/ code is not in the reference, so this follows the paper alone). A directory of
``python -m data_prep.cross_task``, read by ``data/extra_source.py`` (its meta.json says caption
or classify), joins EVERY step: with P = batch_size x pair streams IDC rows (the MLM/MVCL
batch), ``ratio`` = (p, e) adds P * e / p source rows (a whole multiple of the devices; 200 : 50
for Birds-to-Words at the paper's 4 : 1) from the source's own endless seeded grain stream,
each process reading its shard and the stream checkpointed as ``data_extra`` (exact resume).

* caption (GIC, CUB): each image is a pseudo pair, (its grid, an EMPTY second image read as a
  zero grid of the same shape), with one of its captions drawn per visit. The rows are
  appended to the MLM or MVCL batch (``pseudo`` marks them) and count like IDC rows in the
  task's global means. MVCL masks only the real image (``region_mask``'s ``real_only``) and
  leaves the empty image's regressions out of the negatives (they are no image's regions; the
  paper is silent). FDA steps read a second stream ("extra_fda", checkpointed as
  ``data_extra_fda``) of fda_batch_size * e / p pseudo pairs, each with the 6 negatives of
  the source's ``<split>_neg_tfidf6.json`` (``data_prep.cross_task --negatives``: 3 Retrieve +
  3 Replace per image, no Confuse, A.3), grouped with its caption as the IDC pairs are.
* classify (FGVC, NABirds): a fixed set of ``num_pairs`` pairs made once by
  ``classification_pairs`` (half same-class, seeded by ``config.seed``; default one pair per
  image, as A.3 builds 48,562 pairs from NABirds' 48,562 images), reshuffled every pass, in
  ``extra_*`` fields beside the task's batch. They go through the image difference
  encoder only (no text, no cross-modal encoder) and the step's loss is
  task loss + classify_weight * CE + contrastive_weight * contrastive + match_weight * match.
  What the paper leaves open, each a field of ``extra_source``:

  - ``pooling`` ("mean"): a single-image encoding is the mean of the single-image encoder's N
    region outputs (CLS left out); "cls" takes its CLS output. Both the classifier
    (``fgvc_classifier``, one linear layer d -> classes) and the contrastive loss read it.
  - ``contrastive`` ("transfg"): the loss A.3 cites (He et al. 2021, TransFG): over the
    L2-normalised pooled encodings of every image of the GLOBAL batch (both images of every
    pair, all_gather over the data axis), 1/N^2 times the sum over pairs (i, j) of 1 - cos for
    the same label and max(cos - ``margin``, 0) otherwise, ``margin`` 0.4 as TransFG; no
    projection head. "supcon": SupCon (Khosla et al. 2020, L_out) over the same global batch,
    anchors with no positive skipped, ``temperature`` 1.0 (the paper sets its contrastive
    temperatures to 1).
  - ``match_pooling`` ("cls"): the matcher (``fgvc_matcher``, 2d -> 2, label 1 = same class)
    reads cat(CLS1, CLS2) of the pair encoder's output, as the fine-tuning pooler does on the
    cross-modal encoder's; "mean": cat(mean of img1's regions, mean of img2's).
  - the weights (1.0 each) and the plain sum with the drawn task's loss; every term is a mean
    over the global batch (images for the CE, pairs for the matching).
  - FDA steps get the same rows: the ratio is taken against the MLM/MVCL batch, so one stream
    of one batch shape serves every task.

  ``fgvc_classifier`` / ``fgvc_matcher`` exist only in a pretraining model with a
  classification source (``model.fgvc_classes`` is set from its meta.json); fine-tuning's
  ``init_exclude`` names them. Validation stays on the IDC val split.

Not as the official code: steps stop at ``num_train_steps`` (the official loop runs one more,
global_step 0..250000), and each visit of a pair draws one of its captions (the official files
hold one sample per sentence).

Section numbers (§) and quirk ids (S-Q, D-Q, I-Q) refer to docs/official/ (see its README.md).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
from pathlib import Path
from typing import Any

import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from changecap_jax import parallel
from changecap_jax.data import extra_source, negatives, pipeline
from changecap_jax.data.pretrain_samples import PairSamples, sample_loader
from changecap_jax.errors import UserError
from changecap_jax.io import checkpoints
from changecap_jax.io.metric_writer import MetricWriter
from changecap_jax.models import contract
from changecap_jax.models.idc_pcl_pretraining import (
    CONTRASTIVE_LOSSES,
    TASKS,
    ClassifyLosses,
    PretrainError,
    make_task_loss,
)
from changecap_jax.trainers import caption_step, captioning, loop, update
from changecap_jax.trainers.update import make_update_step

VAL_FOLD = 0x7A11  # validation masks come from fold_in(fold_in(seed key, VAL_FOLD), batch)
VAL_SEED = 0  # the val batches' shuffle: the same batches at every validation


# ---------------------------------------------------------------------------------------------
# Task draw (§5.3)
# ---------------------------------------------------------------------------------------------


def task_probabilities(tasks: tuple[str, ...], ratio: tuple[float, ...]) -> np.ndarray:
    """Probabilities of the enabled ``tasks`` from ``ratio``, one weight per task of
    :data:`TASKS` (the weights of disabled tasks are ignored)."""
    tasks, ratio = tuple(tasks), tuple(ratio)
    if not tasks or len(set(tasks)) != len(tasks) or set(tasks) - set(TASKS):
        raise PretrainError(f"config.pretrain.tasks {tasks} must be distinct tasks among "
                            f"{TASKS}, e.g. ('mlm',), ('mlm', 'mvcl') (Table 4)")
    if len(ratio) != len(TASKS):
        raise PretrainError(f"config.pretrain.task_ratio {ratio} must hold one weight per task "
                            f"of {TASKS} (official (8, 1, 2)), got {len(ratio)}")
    weights = np.array([float(ratio[TASKS.index(t)]) for t in tasks])
    if not np.all(np.isfinite(weights) & (weights > 0)):
        raise PretrainError(f"config.pretrain.task_ratio {ratio}: every enabled task {tasks} "
                            "needs a positive weight (disable a task with pretrain.tasks)")
    return weights / weights.sum()


def draw_task(seed: int, step: int, tasks: tuple[str, ...], probabilities: np.ndarray) -> str:
    """The task of update ``step``: a function of (seed, step) only, equal on every process."""
    rng = np.random.default_rng([seed, step])
    return tasks[int(rng.choice(len(tasks), p=probabilities))]


# ---------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------


def negatives_command(dataset: ml_collections.ConfigDict) -> str:
    """The command that writes a dataset's hard-negatives files."""
    parts = ["python -m data_prep.hard_negatives", f"--dataset={dataset.name}"]
    if dataset.get("data_dir"):
        parts.append(f"--data_dir={dataset.data_dir}")
    if dataset.get("variant"):
        parts.append(f"--variant={dataset.variant}")
    for key, value in dict(dataset.get("options", {})).items():
        if isinstance(value, (tuple, list)):
            value = ",".join(str(v) for v in value)
        parts.append(f"--option={key}={value}")
    return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class ExtraStream:
    """A cross-task source whose ``rows`` rows join every step's batch (module docstring)."""

    task: str  # extra_source.CAPTION or CLASSIFY
    rows: int  # global rows per step
    samples: Any  # extra_source.CaptionPseudoPairs or ClassificationPairs
    classify: ClassifyLosses | None  # the FGVC losses (classification sources)
    # A caption source in FDA: its own stream of pseudo pairs with their negatives, at the
    # ratio of the FDA batch (0 / None for a classification source: its FDA steps take
    # ``rows`` of ``samples``).
    fda_rows: int = 0
    fda_samples: Any = None

    def stream(self, task: str) -> str:
        """The iterator a step of ``task`` reads: "extra", or "extra_fda"."""
        return "extra_fda" if task == "fda" and self.fda_rows else "extra"

    def join(self, pairs: dict, extra: dict) -> dict:
        """The drawn task's local batch with this source's local rows."""
        if self.task == extra_source.CAPTION:
            return extra_source.join_caption_rows(pairs, extra)
        return extra_source.join_classify_rows(pairs, extra)


POOLINGS = {"pooling": ("mean", "cls"), "match_pooling": ("cls", "mean")}


def _classify_losses(cfg: ml_collections.ConfigDict) -> ClassifyLosses:
    settings = ClassifyLosses(**{f.name: type(f.default)(cfg.get(f.name, f.default))
                                 for f in dataclasses.fields(ClassifyLosses)})
    for name, allowed in POOLINGS.items():
        if getattr(settings, name) not in allowed:
            raise PretrainError(f"config.pretrain.extra_source.{name} = "
                                f"{getattr(settings, name)!r}, expected one of {allowed}")
    if settings.contrastive not in CONTRASTIVE_LOSSES:
        raise PretrainError(f"config.pretrain.extra_source.contrastive = "
                            f"{settings.contrastive!r}, expected one of {CONTRASTIVE_LOSSES}")
    if not settings.temperature > 0:
        raise PretrainError(f"config.pretrain.extra_source.temperature = "
                            f"{settings.temperature}, expected > 0")
    return settings


class PretrainTrainer(captioning.Trainer):
    """Pretraining on the trunk's dataset, model builder, optimiser, mesh and checkpoints
    (module docstring)."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str | Path,
                 mesh: Any | None = None):
        if "pretrain" not in config:
            raise PretrainError("the config has no pretrain block (configs/idc_pcl.py:pretrain)")
        pre = config.pretrain
        # Config errors first: they need neither the dataset nor the model.
        self.tasks = tuple(pre.tasks)
        self.probabilities = task_probabilities(self.tasks, tuple(pre.task_ratio))
        if config.model.get("stage") != "pretrain":
            raise PretrainError("pretraining needs config.model.stage = 'pretrain', got "
                                f"{config.model.get('stage')!r}")
        if config.get("compute_dtype", "float32") != "float32":
            raise PretrainError("pretraining computes in float32 only (config.compute_dtype = "
                                f"{config.compute_dtype!r}); fine-tuning takes bfloat16")
        extra_meta = self._extra_meta(pre)
        if extra_meta is not None and extra_meta["task"] == extra_source.CLASSIFY:
            # The class count sizes the model's fgvc_classifier: it comes from the source.
            config = copy.deepcopy(config)
            with config.unlocked():
                config.model.fgvc_classes = len(extra_meta["labels"])
        super().__init__(config, workdir, mesh=mesh)
        self.streams = self.model.streams
        pairs = config.batch_size * len(self.streams)
        self.batch_sizes = {t: int(pre.fda_batch_size) if t == "fda" else pairs
                            for t in self.tasks}
        devices = self.mesh.devices.size
        for task, size in self.batch_sizes.items():
            if size <= 0 or size % devices:
                what = ("config.pretrain.fda_batch_size" if task == "fda"
                        else "config.batch_size x pair streams")
                raise PretrainError(f"{what} = {size} samples of task {task!r} must be a "
                                    f"positive multiple of the {devices} devices")
        self.val_batches = int(pre.get("val_batches", 0))
        self.negatives: dict[str, Any] = {}
        if "fda" in self.tasks:  # read now: a missing file fails before any compilation
            for split in ("train", "val") if self.val_batches > 0 else ("train",):
                self.negatives[split] = self.load_negatives(split)
        self.extra = (self._extra_stream(pre.extra_source, extra_meta)
                      if extra_meta is not None else None)
        classify = self.extra.classify if self.extra is not None else None
        temperature = float(pre.get("fda_temperature", 1.0))
        self.task_steps = {t: make_task_step(
            self.model, t, self.optimizer, self.mesh, self.schedule, fda_temperature=temperature,
            classify=classify, zero_grad_rows=dict(config.optim.zero_grad_rows),
            skip_nonfinite=config.get("skip_nonfinite_updates", False))
            for t in self.tasks}
        self.task_losses = {t: jax.jit(make_task_loss(
            self.model, t, self.mesh, train_mode=False, fda_temperature=temperature))
            for t in self.tasks}

    # -- the cross-task source (A.3) -----------------------------------------------------------

    def _extra_meta(self, pre: ml_collections.ConfigDict) -> dict | None:
        """The extra source's checked meta.json, or None without one."""
        cfg = pre.get("extra_source")
        if cfg is None or not cfg.get("dir"):
            return None
        try:
            meta = extra_source.read_meta(cfg.dir)
        except extra_source.ExtraSourceError as e:
            raise PretrainError(str(e)) from e
        return meta

    def _extra_rows(self, ratio: tuple[int, ...], idc_rows: int, what: str) -> int:
        rows, rest = divmod(idc_rows * ratio[1], ratio[0])
        devices = self.mesh.devices.size
        if rest or rows <= 0 or rows % devices:
            raise PretrainError(
                f"config.pretrain.extra_source.ratio = {ratio}: the step's {idc_rows} IDC rows "
                f"({what}) give {idc_rows * ratio[1] / ratio[0]:g} extra rows, which must be a "
                f"positive whole multiple of the {devices} devices")
        return rows

    def _extra_stream(self, cfg: ml_collections.ConfigDict, meta: dict) -> ExtraStream:
        """Opens the source's split and checks it against the dataset and the batch."""
        ratio = tuple(cfg.get("ratio", (4, 1)))
        if len(ratio) != 2 or not all(isinstance(n, int) and n > 0 for n in ratio):
            raise PretrainError(f"config.pretrain.extra_source.ratio = {ratio}, expected two "
                                "positive integers IDC rows : extra rows (A.3: (4, 1))")
        rows = self._extra_rows(ratio, self.config.batch_size * len(self.streams),
                                "config.batch_size x pair streams")
        fda_rows, fda_samples = 0, None
        try:
            source = extra_source.open_source(cfg.dir, cfg.get("split", "train"))
        except extra_source.ExtraSourceError as e:
            raise PretrainError(str(e)) from e
        meta_path = source.directory / "meta.json"
        sample = self.samples("mlm", "train")[0]
        grid, length = np.asarray(sample["img1"]).shape, np.asarray(sample["captions"]).shape[-1]
        shape = tuple(meta["feature_shape"])
        classify = None
        if source.task == extra_source.CAPTION:
            if meta["vocab_size"] != len(self.dataset.vocab):
                raise PretrainError(
                    f"{meta_path}: key 'vocab_size' is {meta['vocab_size']}, the dataset's "
                    f"vocabulary has {len(self.dataset.vocab)} words: build the source with "
                    "its vocab.json (python -m data_prep.cross_task --vocab=...)")
            if shape != grid:
                raise PretrainError(f"{meta_path}: key 'feature_shape' is {list(shape)}, the "
                                    f"dataset's grids are {list(grid)} (pseudo pairs join "
                                    "its batches)")
            try:
                samples: Any = extra_source.CaptionPseudoPairs(source, length)
                if "fda" in self.tasks:
                    fda_rows = self._extra_rows(ratio, self.batch_sizes["fda"],
                                                "config.pretrain.fda_batch_size")
                    path = negatives.negatives_path(source.directory, source.split)
                    fda_samples = extra_source.CaptionPseudoPairs(
                        source, length, negatives=self._source_negatives(path),
                        vocab=self.dataset.vocab, origin=str(path))
            except extra_source.ExtraSourceError as e:
                raise PretrainError(str(e)) from e
        else:
            if shape[-1] != self.model.image_dim:
                raise PretrainError(f"{meta_path}: key 'feature_shape' is {list(shape)}: "
                                    f"{shape[-1]} channels, config.model.image_dim is "
                                    f"{self.model.image_dim}")
            count = int(cfg.get("num_pairs", 0)) or len(source)
            try:
                chosen = extra_source.classification_pairs(source.labels, count,
                                                           seed=self.config.seed)
            except ValueError as e:
                raise PretrainError(f"{source.directory / (source.split + '.npz')}: "
                                    f"'labels': {e}") from e
            samples = extra_source.ClassificationPairs(source, chosen)
            classify = _classify_losses(cfg)
        if len(samples) < max(rows, fda_rows):
            raise PretrainError(f"{meta_path}: split {source.split!r} gives {len(samples)} "
                                f"rows, fewer than the {max(rows, fda_rows)} extra rows per "
                                "step")
        return ExtraStream(source.task, rows, samples, classify, fda_rows, fda_samples)

    def _source_negatives(self, path: Path) -> dict:
        """(image_id, True) -> the FDA negatives of a caption source's pseudo pairs."""
        if not path.exists():
            raise PretrainError(
                f"{path} does not exist: FDA with a caption source reads each image's "
                "Retrieve/Replace negatives from it (A.3). Rebuild the source with "
                "python -m data_prep.cross_task --source=cub ... --negatives, or leave fda out "
                "of config.pretrain.tasks")
        try:
            return negatives.negatives_by_pair(negatives.load_negatives(path))
        except negatives.NegativesFileError as e:
            raise PretrainError(str(e)) from e

    def extra_loader(self, stream: str = "extra") -> grain.DataLoader:
        """An endless stream of the extra source ("extra", or "extra_fda": the pseudo pairs
        with negatives of FDA steps), this process's share of each step's rows."""
        assert self.extra is not None
        fda = stream == "extra_fda"
        seed = int(np.random.SeedSequence([self.config.seed, len(TASKS) + fda])
                   .generate_state(1)[0])
        return sample_loader(self.extra.fda_samples if fda else self.extra.samples,
                             global_batch_size=self.extra.fda_rows if fda else self.extra.rows,
                             seed=seed, process_index=jax.process_index(),
                             process_count=jax.process_count(),
                             pick_caption=self.extra.task == extra_source.CAPTION)

    def host_batch(self, task: str, iterators: dict[str, Any]) -> dict:
        """This process's rows of the next step of ``task`` (with the extra source's)."""
        batch = next(iterators[task])
        if self.extra is not None:
            batch = self.extra.join(batch, next(iterators[self.extra.stream(task)]))
        return batch

    def extra_streams(self) -> tuple[str, ...]:
        if self.extra is None:
            return ()
        return ("extra", "extra_fda") if self.extra.fda_rows else ("extra",)

    def iterators(self) -> dict[str, Any]:
        """Each task's stream and the extra source's ("extra", "extra_fda")."""
        iterators = {t: iter(self.task_loader(t)) for t in self.tasks}
        iterators.update({s: iter(self.extra_loader(s)) for s in self.extra_streams()})
        return iterators

    # -- data ---------------------------------------------------------------------------------

    def negatives_path(self, split: str) -> Path:
        return negatives.negatives_path(self.dataset.directory, split)

    def load_negatives(self, split: str) -> dict:
        """(image_id, semantic) -> negatives of ``split``, from the dataset's directory."""
        path = self.negatives_path(split)
        if not path.exists():
            raise PretrainError(
                f"{path} does not exist: the fda task reads each pair's hard negatives from "
                f"it. Make them with: {negatives_command(self.config.dataset)} (or leave fda "
                "out of config.pretrain.tasks)")
        return negatives.negatives_by_pair(negatives.load_negatives(path))

    def samples(self, task: str, split: str) -> PairSamples:
        fda = task == "fda"
        return PairSamples(self.dataset.split(split), self.streams,
                           negatives=self.negatives[split] if fda else None,
                           vocab=self.dataset.vocab, origin=str(self.negatives_path(split)))

    def task_loader(self, task: str) -> grain.DataLoader:
        # Each task shuffles on its own, as the official per-task DataLoaders.
        seed = int(np.random.SeedSequence([self.config.seed, TASKS.index(task)])
                   .generate_state(1)[0])
        return sample_loader(self.samples(task, "train"),
                             global_batch_size=self.batch_sizes[task], seed=seed,
                             process_index=jax.process_index(),
                             process_count=jax.process_count())

    # -- state and checkpoints ----------------------------------------------------------------

    def init_state(self) -> update.TrainState:
        """Fresh parameters and optimiser state, replicated (compiled once per trainer)."""
        return self._init()

    @functools.cached_property
    def _init(self) -> Any:
        sample = self.samples("mlm", "train")[0]
        img = np.asarray(sample["img1"]).shape
        length = np.asarray(sample["captions"]).shape[-1]
        init_rng = jax.random.fold_in(self.rng, caption_step.INIT_FOLD)

        @functools.partial(jax.jit, out_shardings=parallel.replicated(self.mesh))
        def init() -> update.TrainState:
            params = self.model.init(
                {"params": init_rng}, jnp.zeros((1, *img), jnp.float32),
                jnp.zeros((1, *img), jnp.float32), jnp.zeros((1, length), jnp.int32),
                method="pretrain")["params"]
            return update.TrainState(step=jnp.int32(0), params=params,
                                    opt_state=self.optimizer.init(params), rng=self.rng)

        return init

    def checkpoint_manager(self) -> ocp.CheckpointManager:
        # The state (what fine-tuning's init_from reads) and one data iterator per task.
        extra = tuple(f"data_{s}" for s in self.extra_streams())
        return checkpoints.make_checkpoint_manager(
            self.workdir / "checkpoints", self.config.keep_checkpoints,
            ("state", *(f"data_{t}" for t in self.tasks), *extra), writer=True,
            asynchronous=self.config.get("async_checkpoints", True))

    def save(self, manager: ocp.CheckpointManager, step: int, state: update.TrainState,
             iterators: dict[str, Any]) -> None:
        checkpoints.save(manager, step, state, {f"data_{t}": it for t, it in iterators.items()})

    def restore_all(self, manager: ocp.CheckpointManager, state: update.TrainState,
                    iterators: dict[str, Any]) -> update.TrainState:
        """The latest intact step's state and task streams (``checkpoints.restore``: damaged
        newer steps are renamed aside, or orbax would skip this run's saves of them); a task
        enabled since that checkpoint was written starts its stream fresh."""
        streams = {f"data_{t}": it for t, it in iterators.items()}
        return checkpoints.restore_train_state(manager, state, streams, move_damaged_aside=True)

    # -- validation ---------------------------------------------------------------------------

    def validate(self, state: update.TrainState, step: int) -> dict[str, float]:
        """Each task's metrics averaged over ``val_batches`` val batches; the same batches and
        masks at every validation."""
        results: dict[str, float] = {}
        if self.val_batches <= 0:
            return results
        devices = self.mesh.devices.size
        key = jax.random.fold_in(self.rng, VAL_FOLD)
        for task in self.tasks:
            samples = self.samples(task, "val")
            # The training batch, or what a small val split holds (a multiple of the devices).
            size = min(self.batch_sizes[task], len(samples) // devices * devices)
            if size == 0:
                raise PretrainError(f"the val split has {len(samples)} pairs, fewer than the "
                                    f"{devices} devices; set config.pretrain.val_batches=0")
            loader = sample_loader(samples, global_batch_size=size, seed=VAL_SEED,
                                   process_index=jax.process_index(),
                                   process_count=jax.process_count())
            values: dict[str, list[float]] = {}
            for k, batch in zip(range(self.val_batches), loader, strict=False):
                _, metrics = self.task_losses[task](
                    state.params, pipeline.to_global(batch, self.data_sharding),
                    jax.random.fold_in(key, k))
                for name, v in jax.device_get(metrics).items():
                    values.setdefault(name, []).append(float(v))
            results.update({f"val/{task}_{n}": float(np.mean(v)) for n, v in values.items()})
        if self.is_main:
            logging.info("pretraining val @ step %d: %s", step, json.dumps(results))
            out = self.workdir / "metrics"
            out.mkdir(parents=True, exist_ok=True)
            (out / f"pretrain_val_{step}.json").write_text(json.dumps(results, indent=1))
        return results

    # -- what the loop calls (loop.Task) ------------------------------------------------------

    bar_label = "pretrain"

    def train(self) -> dict[str, float]:
        """Runs (or resumes) pretraining (``loop.run``); returns the last validation's
        metrics."""
        return loop.run(self)

    def data_streams(self) -> dict[str, Any]:
        """Each task's stream and the extra source's, by checkpoint item name."""
        if self.on_device:  # its samples are not the captioning loader's batches
            raise UserError("config.dataset.on_device is for captioning training; "
                            "pretraining streams its samples: set it to False")
        return {f"data_{name}": it for name, it in self.iterators().items()}

    def describe(self, state: update.TrainState, start: int) -> None:
        n_params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
        logging.info("pretraining %s: %d parameters, tasks %s with probabilities %s, "
                     "samples per step %s, extra %s rows %d; starting at step %d",
                     self.config.model.name, n_params, self.tasks,
                     np.round(self.probabilities, 4).tolist(), self.batch_sizes,
                     self.extra.task if self.extra else None,
                     self.extra.rows if self.extra else 0, start)

    def run_step(self, state: update.TrainState, step: int,
                 streams: dict[str, Any]) -> tuple[update.TrainState, dict, str]:
        """The update of the task drawn for ``step``, on that task's next batch."""
        task = draw_task(self.config.seed, step, self.tasks, self.probabilities)
        iterators = {name.removeprefix("data_"): it for name, it in streams.items()}
        batch = pipeline.to_global(self.host_batch(task, iterators), self.data_sharding)
        state, metrics = self.task_steps[task](state, batch)
        return state, metrics, task

    def examples_per_step(self, key: str) -> int:
        return self.batch_sizes[key]

    def window_scalars(self, window: list[tuple[str, dict]]) -> dict[str, float]:
        """Each task's metrics averaged over its steps since the last log."""
        scalars: dict[str, float] = {}
        for task in self.tasks:
            entries = [metrics for key, metrics in window if key == task]
            if not entries:
                continue
            fetched = jax.device_get(entries)
            scalars.update({f"{task}/{name}": float(np.mean([m[name] for m in fetched]))
                            for name in fetched[0] if name != "learning_rate"})
            scalars["learning_rate"] = float(fetched[-1]["learning_rate"])
            scalars[f"{task}/steps"] = float(len(entries))
        return scalars

    def evaluate_at(self, state: update.TrainState, step: int, writer: MetricWriter | None,
                    final: bool) -> dict[str, float]:
        """The validation losses (the same at every evaluation, final or not)."""
        results = self.validate(state, step)
        if results and writer is not None:
            writer.write_scalars(step, results)
        return results


def make_task_step(model: Any, task: str, optimizer: Any, mesh: Any, schedule: Any,
                   *, fda_temperature: float = 1.0, classify: ClassifyLosses | None = None,
                   zero_grad_rows: dict[str, int] | None = None,
                   with_grads: bool = False, skip_nonfinite: bool = False,
                   compute_dtype: Any = jnp.float32) -> Any:
    """The jitted update of one task, (state, global batch) -> (state, metrics) (and the
    gradients with ``with_grads``, for tests): ``update.make_update_step`` over
    :func:`~changecap_jax.models.idc_pcl_pretraining.make_task_loss`, with the trunk's gradient row
    mask and the model's
    ``post_update`` where it has one. Keys as the trunk: fold_in(state.rng, step).
    ``compute_dtype``: float64 for ``reproduce --precision=float64`` only."""
    loss_fn = make_task_loss(model, task, mesh, fda_temperature=fda_temperature,
                             classify=classify, compute_dtype=compute_dtype)
    return make_update_step(loss_fn, optimizer, mesh, schedule, zero_grad_rows=zero_grad_rows,
                            post_update=contract.post_update_fn(model),
                            with_grads=with_grads, skip_nonfinite=skip_nonfinite)
