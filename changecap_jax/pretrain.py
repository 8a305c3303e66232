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
  presets, §5.6). The losses run inside ``shard_map`` over the data axis and every reduction
  spans the GLOBAL batch, so N devices compute one device's loss:

  - ``mlm``: captions masked by ``idc_pcl.mask_caption`` (§5.1), each sample's key folded from
    the step's "inputs" key and its GLOBAL index; mean CE over every labelled token of the
    global batch (psum of sums / psum of counts) = ``idc_pcl.pretrain_mlm_loss``.
  - ``mvcl``: per sample 15 % of one image's N regions (img1 or img2 with p = 0.5, at least
    one) set to 0; a masked region's regressed feature is scored against the true features of
    every masked region and the model's regressions at every unmasked region of the global
    batch (``all_gather`` over the data axis), CE to its own target; psum of the row losses
    over the global masked-region count = ``idc_pcl.mvcl_loss``.
  - ``fda``: each sample's caption, then its 6 hard negatives in file order, with the images
    repeated per caption (groups of 7 stay on one device); CE of the positive among the 7
    cosine similarities, mean over the global samples = ``idc_pcl.fda_loss``.
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
import time
from pathlib import Path
from typing import Any

import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import PartitionSpec as P

from changecap_jax import checkpoints, console, export, parallel, precision, train
from changecap_jax.data import auto_prep, extra_source, negatives, pipeline
from changecap_jax.data.pretrain_samples import PairSamples, sample_loader
from changecap_jax.errors import UserError
from changecap_jax.metric_writer import MetricWriter
from changecap_jax.models import idc_pcl

TASKS = ("mlm", "mvcl", "fda")
REGION_MASK_PROBABILITY = 0.15  # §5.1 MVM masking
VAL_FOLD = 0x7A11  # validation masks come from fold_in(fold_in(seed key, VAL_FOLD), batch)
VAL_SEED = 0  # the val batches' shuffle: the same batches at every validation
EXTRA_FOLD = 0xE17A  # the classification heads' dropout: fold_in(the device's dropout key, it)


class PretrainError(UserError, ValueError):
    """A pretraining config or input that cannot work (names the field or the file)."""


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
# Per-sample inputs (§5.1, §5.3)
# ---------------------------------------------------------------------------------------------


def sample_keys(key: jax.Array, index: jax.Array) -> jax.Array:
    """One key per sample from its GLOBAL index, so masks do not depend on the device count."""
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(index)


def region_mask(key: jax.Array, num_regions: int,
                probability: float = REGION_MASK_PROBABILITY,
                real_only: jax.Array | bool = False) -> jax.Array:
    """§5.1 MVM mask (2N,) bool, True = masked: each region with ``probability`` (one at random
    when none was drawn), on img1 with p = 0.5, else on img2. ``real_only`` (a pseudo pair of
    a caption source, A.3): always on img1, the real image; the same draws otherwise."""
    k_pick, k_one, k_side = jax.random.split(key, 3)
    region = jax.random.uniform(k_pick, (num_regions,)) < probability
    one = jnp.arange(num_regions) == jax.random.randint(k_one, (), 0, num_regions)
    region = jnp.where(jnp.any(region), region, one)
    first = (jax.random.uniform(k_side) < 0.5) | real_only
    return jnp.concatenate([region & first, region & ~first])


def fda_rows(img1: jax.Array, img2: jax.Array, ids: jax.Array,
             negative_ids: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """§5.3 FDA layout: sample i gives rows i*G .. i*G+G-1 (G = 1 + K): its caption, then its
    K negatives in file order, each with the sample's images (repeated, interleaved)."""
    captions = jnp.concatenate([ids[:, None], negative_ids], 1)  # (S, G, L)
    group = captions.shape[1]
    return (jnp.repeat(img1, group, 0), jnp.repeat(img2, group, 0),
            captions.reshape(-1, captions.shape[-1]))


def _tokens(x: jax.Array) -> jax.Array:
    x = jnp.asarray(x, jnp.float32)
    return x.reshape(x.shape[0], -1, x.shape[-1]) if x.ndim == 4 else x


# ---------------------------------------------------------------------------------------------
# Losses over the GLOBAL batch (inside shard_map; §5.3)
# ---------------------------------------------------------------------------------------------


def _global_mean(total: jax.Array, count: jax.Array, axis: str) -> jax.Array:
    return jax.lax.psum(total, axis) / jax.lax.psum(count, axis)


def _mlm(model: idc_pcl.IDCPCL, forward: Any, batch: dict, keys: jax.Array,
         axis: str) -> dict[str, jax.Array]:
    mask = functools.partial(
        idc_pcl.mask_caption, eos_id=model.eos_id, mask_id=model.mask_token,
        num_tokens=model.num_tokens, word_probability=model.word_mask_probability,
        eos_probability=model.eos_mask_probability)
    ids, labels = jax.vmap(mask)(keys, jnp.asarray(batch["ids"], jnp.int32))
    logits = forward(batch["img1"], batch["img2"], ids).mlm_logits
    ce, keep = idc_pcl.token_cross_entropy(logits, labels)
    hit = (jnp.argmax(logits, -1) == labels) & keep
    return {"loss": _global_mean(jnp.sum(ce), jnp.sum(keep), axis),
            "accuracy": _global_mean(jnp.sum(hit), jnp.sum(keep), axis)}


def _mvcl(model: idc_pcl.IDCPCL, forward: Any, batch: dict, keys: jax.Array,
          axis: str) -> dict[str, jax.Array]:
    del model
    t1, t2 = _tokens(batch["img1"]), _tokens(batch["img2"])
    n, c = t1.shape[1], t1.shape[2]
    # Pseudo pairs of a caption source (A.3): only the real image is masked, and the empty
    # image's regions are no negatives (they are no image's regions).
    pseudo = batch.get("pseudo", jnp.zeros(t1.shape[0], bool))
    mask = jax.vmap(functools.partial(region_mask, num_regions=n))(
        keys, real_only=pseudo)  # (s, 2N)
    empty = jnp.concatenate([jnp.zeros((t1.shape[0], n), bool),
                             jnp.broadcast_to(pseudo[:, None], (t1.shape[0], n))], 1)
    out = forward(jnp.where(mask[:, :n, None], 0.0, t1), jnp.where(mask[:, n:, None], 0.0, t2),
                  batch["ids"])
    pred = idc_pcl.l2_normalize(out.regressed.astype(jnp.float32))  # (s, 2N, C)
    true = idc_pcl.l2_normalize(jnp.concatenate([t1, t2], 1))
    # A sample's masked regions lie on one image: its N regions are the only candidate rows
    # (half the work of scoring all 2N), and their true features the only positive columns.
    first = jnp.any(mask[:, :n], -1)

    def masked_image(x: jax.Array) -> jax.Array:
        side = first.reshape(-1, *([1] * (x.ndim - 1)))
        return jnp.where(side, x[:, :n], x[:, n:]).reshape(-1, *x.shape[2:])

    rows, row_true, row_masked = masked_image(pred), masked_image(true), masked_image(mask)
    # Columns span the GLOBAL batch: every masked region's true feature, and the model's
    # regression at every unmasked region (the official negatives, §5.3).
    gather = functools.partial(jax.lax.all_gather, axis_name=axis, tiled=True)
    true_cols, true_ok = gather(row_true), gather(row_masked)
    pred_cols = gather(pred.reshape(-1, c))
    pred_ok = ~gather(mask.reshape(-1)) & ~gather(empty.reshape(-1))
    logits = jnp.concatenate([jnp.where(true_ok[None], rows @ true_cols.T, -jnp.inf),
                              jnp.where(pred_ok[None], rows @ pred_cols.T, -jnp.inf)], 1)
    per_row = jax.nn.logsumexp(logits, -1) - jnp.sum(rows * row_true, -1)  # nce_temp 1 (I-Q5)
    return {"loss": _global_mean(jnp.sum(jnp.where(row_masked, per_row, 0.0)),
                                 jnp.sum(row_masked), axis)}


def _fda(forward: Any, batch: dict, axis: str, temperature: float) -> dict[str, jax.Array]:
    img1, img2, captions = fda_rows(batch["img1"], batch["img2"], batch["ids"],
                                    batch["negatives"])
    out = forward(img1, img2, captions)
    samples = batch["ids"].shape[0]
    sim = jnp.sum(idc_pcl.l2_normalize(out.visual) * idc_pcl.l2_normalize(out.text_cls),
                  -1).reshape(samples, -1)  # (s, 1 + K), the positive first
    log_probs = jax.nn.log_softmax(sim / temperature, -1)
    count = jnp.float32(samples)
    return {"loss": _global_mean(-jnp.sum(log_probs[:, 0]), count, axis),
            "accuracy": _global_mean(jnp.sum(jnp.argmax(sim, -1) == 0), count, axis),
            "positive_similarity": _global_mean(jnp.sum(sim[:, 0]), count, axis),
            "negative_similarity": _global_mean(jnp.sum(sim[:, 1:]),
                                                count * (sim.shape[1] - 1), axis)}


@dataclasses.dataclass(frozen=True)
class ClassifyLosses:
    """A.3's FGVC losses on a classification source's rows (config.pretrain.extra_source;
    the choices the paper leaves open are in the module docstring)."""

    classify_weight: float = 1.0
    contrastive_weight: float = 1.0
    match_weight: float = 1.0
    contrastive: str = "transfg"  # the margin loss A.3 cites; or "supcon"
    temperature: float = 1.0  # supcon
    margin: float = 0.4  # transfg (TransFG's alpha)
    pooling: str = "mean"
    match_pooling: str = "cls"


CONTRASTIVE_LOSSES = ("supcon", "transfg")


def global_contrastive(z: jax.Array, labels: jax.Array, axis: str,
                       settings: ClassifyLosses) -> jax.Array:
    """The contrastive loss of this device's images ``z`` (n, d) against every image of the
    GLOBAL batch (all_gather over ``axis``; inside shard_map): SupCon's mean over the anchors
    that have a positive, or TransFG's sum / N^2."""
    gather = functools.partial(jax.lax.all_gather, axis_name=axis, tiled=True)
    columns, column_labels = gather(z), gather(labels)
    if settings.contrastive == "transfg":
        rows = idc_pcl.transfg_row_losses(z, labels, columns, column_labels, settings.margin)
        return jax.lax.psum(jnp.sum(rows), axis) / jnp.float32(columns.shape[0]) ** 2
    own = jax.lax.axis_index(axis) * z.shape[0] + jnp.arange(z.shape[0])  # global columns
    rows, has_positive = idc_pcl.supcon_row_losses(z, labels, own, columns, column_labels,
                                                   settings.temperature)
    # Anchors without a positive in the global batch have no term (SupCon's convention).
    return jax.lax.psum(jnp.sum(rows), axis) / jnp.maximum(
        jax.lax.psum(jnp.sum(has_positive), axis), 1)


def _fgvc(classify: Any, batch: dict, axis: str,
          settings: ClassifyLosses) -> dict[str, jax.Array]:
    """Classification CE of both images, the contrastive loss over every image of the GLOBAL
    batch (gathered columns; ``settings.contrastive``) and the pair's same-class CE; each a mean
    over the global batch."""
    out = classify(batch["extra_img1"], batch["extra_img2"])
    pairs, dim = out.single.shape[0], out.single.shape[-1]
    labels = jnp.stack([batch["extra_label1"], batch["extra_label2"]], 1).astype(jnp.int32)
    ce, _ = idc_pcl.token_cross_entropy(out.class_logits, labels)
    hit = jnp.argmax(out.class_logits, -1) == labels
    images = jnp.float32(2 * pairs)
    contrastive = global_contrastive(out.single.reshape(2 * pairs, dim), labels.reshape(-1),
                                     axis, settings)
    same = batch["extra_same"].astype(jnp.int32)
    match_ce, _ = idc_pcl.token_cross_entropy(out.match_logits, same)
    count = jnp.float32(pairs)
    return {
        "fgvc_classify": _global_mean(jnp.sum(ce), images, axis),
        "fgvc_accuracy": _global_mean(jnp.sum(hit), images, axis),
        "fgvc_contrastive": contrastive,
        "fgvc_match": _global_mean(jnp.sum(match_ce), count, axis),
        "fgvc_match_accuracy": _global_mean(
            jnp.sum(jnp.argmax(out.match_logits, -1) == same), count, axis),
    }


def make_task_loss(model: idc_pcl.IDCPCL, task: str, mesh: Any, *, train_mode: bool = True,
                   fda_temperature: float = 1.0, classify: ClassifyLosses | None = None) -> Any:
    """(params, global batch, rng) -> (loss, metrics) of one task over the GLOBAL batch.

    ``rng`` is the step's key: the masks use ``fold_in(rng, train.INPUTS_FOLD)`` folded with
    each sample's global index, dropout ``fold_in(rng, device index)`` (as the trunk).
    ``classify``: the batch also holds a classification source's ``extra_*`` rows, whose
    weighted losses are added to the task's (``task_loss`` is the task's alone)."""
    if task not in TASKS:
        raise PretrainError(f"unknown pretraining task {task!r}; tasks: {TASKS}")
    axis = parallel.DATA_AXIS

    def per_device(params: Any, batch: dict, rng: jax.Array) -> tuple[jax.Array, dict]:
        # Pretraining computes in float32: half-precision stored grids are upcast here.
        batch = precision.cast_floating(batch, jnp.float32)
        local = batch["ids"].shape[0]
        device = jax.lax.axis_index(axis)
        keys = sample_keys(jax.random.fold_in(rng, train.INPUTS_FOLD),
                           device * local + jnp.arange(local))
        dropout = jax.random.fold_in(rng, device)

        def forward(img1: jax.Array, img2: jax.Array, ids: jax.Array) -> Any:
            return model.apply({"params": params}, img1, img2, ids, train=train_mode,
                               rngs={"dropout": dropout}, method="pretrain")

        if task == "fda":
            metrics = _fda(forward, batch, axis, fda_temperature)
        else:
            metrics = (_mlm if task == "mlm" else _mvcl)(model, forward, batch, keys, axis)
        if classify is not None:
            def heads(img1: jax.Array, img2: jax.Array) -> Any:
                return model.apply(
                    {"params": params}, img1, img2, pooling=classify.pooling,
                    match_pooling=classify.match_pooling, train=train_mode,
                    rngs={"dropout": jax.random.fold_in(dropout, EXTRA_FOLD)},
                    method="cross_task_classify")

            extra = _fgvc(heads, batch, axis, classify)
            metrics["task_loss"] = metrics["loss"]
            metrics["loss"] = (metrics["loss"]
                               + classify.classify_weight * extra["fgvc_classify"]
                               + classify.contrastive_weight * extra["fgvc_contrastive"]
                               + classify.match_weight * extra["fgvc_match"])
            metrics.update(extra)
        return metrics["loss"], metrics

    return jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(axis), P()),
                         out_specs=(P(), P()), check_vma=False)


def make_task_step(model: idc_pcl.IDCPCL, task: str, optimizer: Any, mesh: Any, schedule: Any,
                   *, fda_temperature: float = 1.0, classify: ClassifyLosses | None = None,
                   with_grads: bool = False) -> Any:
    """The jitted update of one task, (state, global batch) -> (state, metrics) (and the
    gradients with ``with_grads``, for tests). Keys as the trunk: fold_in(state.rng, step)."""
    loss_fn = make_task_loss(model, task, mesh, fda_temperature=fda_temperature,
                             classify=classify)

    def step(state: train.TrainState, batch: dict) -> tuple:
        rng = jax.random.fold_in(state.rng, state.step)
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state.params, batch, rng)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        metrics["learning_rate"] = schedule(state.step)
        state = state.replace(step=state.step + 1, opt_state=opt_state,
                              params=optax.apply_updates(state.params, updates))
        return (state, metrics, grads) if with_grads else (state, metrics)

    repl, data = parallel.replicated(mesh), parallel.batch_sharding(mesh)
    return jax.jit(step, donate_argnums=0, in_shardings=(repl, data),
                   out_shardings=(repl,) * (3 if with_grads else 2))


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


class PretrainTrainer(train.Trainer):
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
        self.task_steps = {t: make_task_step(self.model, t, self.optimizer, self.mesh,
                                             self.schedule, fda_temperature=temperature,
                                             classify=classify)
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
        meta_path = Path(cfg.dir) / "meta.json"
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
                    path = negatives.negatives_path(cfg.dir, source.split)
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
        if not path.exists() and self.dataset.auto_prepare:  # the synthetic set, first use
            auto_prep.make_hard_negatives(self.dataset)
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

    def init_state(self) -> train.TrainState:
        """Fresh parameters and optimiser state, replicated (compiled once per trainer)."""
        return self._init()

    @functools.cached_property
    def _init(self) -> Any:
        sample = self.samples("mlm", "train")[0]
        img = np.asarray(sample["img1"]).shape
        length = np.asarray(sample["captions"]).shape[-1]
        init_rng = jax.random.fold_in(self.rng, train.INIT_FOLD)

        @functools.partial(jax.jit, out_shardings=parallel.replicated(self.mesh))
        def init() -> train.TrainState:
            params = self.model.init(
                {"params": init_rng}, jnp.zeros((1, *img), jnp.float32),
                jnp.zeros((1, *img), jnp.float32), jnp.zeros((1, length), jnp.int32),
                method="pretrain")["params"]
            return train.TrainState(step=jnp.int32(0), params=params,
                                    opt_state=self.optimizer.init(params), rng=self.rng)

        return init

    def checkpoint_manager(self) -> ocp.CheckpointManager:
        # The state (what fine-tuning's init_from reads) and one data iterator per task.
        extra = tuple(f"data_{s}" for s in self.extra_streams())
        return checkpoints.make_checkpoint_manager(
            self.workdir / "checkpoints", self.config.keep_checkpoints,
            ("state", *(f"data_{t}" for t in self.tasks), *extra))

    def save(self, manager: ocp.CheckpointManager, step: int, state: train.TrainState,
             iterators: dict[str, Any]) -> None:
        items = {f"data_{t}": grain.checkpoint.CheckpointSave(it) for t, it in iterators.items()}
        manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), **items))

    def restore_all(self, manager: ocp.CheckpointManager, state: train.TrainState,
                    iterators: dict[str, Any]) -> train.TrainState:
        """The latest intact step's state and task streams (``checkpoints.restore``: damaged
        newer steps are renamed aside, or orbax would skip this run's saves of them)."""

        def args_for(step: int, items: dict[str, str]) -> dict[str, Any]:
            args = {"state": ocp.args.StandardRestore(state)}
            for task, iterator in iterators.items():
                if f"data_{task}" in items:
                    args[f"data_{task}"] = grain.checkpoint.CheckpointRestore(iterator)
                else:  # a task enabled since that checkpoint was written
                    logging.info("checkpoint %d has no %s stream: it starts fresh", step, task)
            return args

        step, restored = checkpoints.restore(manager, args_for, move_damaged_aside=True)
        logging.info("restored pretraining checkpoint of step %d", step)
        return restored["state"]

    # -- validation ---------------------------------------------------------------------------

    def validate(self, state: train.TrainState, step: int) -> dict[str, float]:
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

    # -- the loop -----------------------------------------------------------------------------

    def _window_scalars(self, window: dict[str, list], step: int) -> dict[str, float]:
        """Each task's metrics averaged over its steps since the last log."""
        scalars: dict[str, float] = {}
        for task, entries in window.items():
            if not entries:
                continue
            fetched = jax.device_get(entries)
            scalars.update({f"{task}/{name}": float(np.mean([m[name] for m in fetched]))
                            for name in fetched[0] if name != "learning_rate"})
            scalars["learning_rate"] = float(fetched[-1]["learning_rate"])
            scalars[f"{task}/steps"] = float(len(entries))
            if not np.isfinite(scalars[f"{task}/loss"]):
                raise train.NonFiniteLossError(
                    f"non-finite {task} loss {scalars[f'{task}/loss']} before step {step}")
        return scalars

    def train(self) -> dict[str, float]:
        """Runs (or resumes) pretraining; returns the last validation's metrics."""
        config = self.config
        writer = MetricWriter(self.workdir / "tensorboard", enabled=self.is_main,
                              scalars_file=self.workdir / train.SCALARS_FILE)
        export.save_config(self.workdir, config)
        manager = self.checkpoint_manager()
        state = self.init_state()
        iterators = self.iterators()
        if manager.latest_step() is not None:
            state = self.restore_all(manager, state, iterators)
            writer.truncate_after(int(state.step))
        elif config.get("init_from", ""):
            state = state.replace(params=train.init_params_from(
                state.params, config.init_from, tuple(config.get("init_exclude", ()))))
        start, total = int(state.step), self.total_train_steps
        if self.is_main:
            n_params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
            logging.info("pretraining %s: %d parameters, tasks %s with probabilities %s, "
                         "samples per step %s, extra %s rows %d; starting at step %d",
                         config.model.name, n_params, self.tasks,
                         np.round(self.probabilities, 4).tolist(), self.batch_sizes,
                         self.extra.task if self.extra else None,
                         self.extra.rows if self.extra else 0, start)
        # ETA from the average step time, compiles and validations left out (paused).
        bar = console.StepBar(total, start, "pretrain", disable=not self.is_main)
        last: dict[str, float] = {}
        window: dict[str, list] = {t: [] for t in self.tasks}
        window_start, window_steps = time.perf_counter(), 0
        for step in range(start + 1, total + 1):
            task = draw_task(config.seed, step, self.tasks, self.probabilities)
            batch = pipeline.to_global(self.host_batch(task, iterators), self.data_sharding)
            state, metrics = self.task_steps[task](state, batch)
            if step == start + 1:
                bar.unpause()  # the bar starts paused: the first call compiled
            window[task].append(metrics)
            window_steps += 1
            bar.update(1)
            if step % config.log_every_steps == 0 or step == total:
                scalars = self._window_scalars(window, step)
                scalars["steps_per_second"] = window_steps / (time.perf_counter() - window_start)
                writer.write_scalars(step, scalars)
                self.history.append((step, scalars))
                bar.set_postfix(task=task, loss=f"{scalars[f'{task}/loss']:.3f}")
                window = {t: [] for t in self.tasks}
                window_start, window_steps = time.perf_counter(), 0
            if step % config.eval_every_steps == 0 or step == total:
                bar.pause()
                last = self.validate(state, step)
                if last:
                    writer.write_scalars(step, last)
                bar.unpause()
            if step % config.checkpoint_every_steps == 0 or step == total:
                self.save(manager, step, state, iterators)
        bar.close()
        manager.wait_until_finished()
        writer.close()
        return last
