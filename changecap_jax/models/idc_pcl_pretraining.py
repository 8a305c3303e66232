"""IDC-PCL's pretraining losses over the GLOBAL batch (reference §5.1, §5.3) and their
update step; the pretraining task that draws them (data, validation) is
``changecap_jax/trainers/pretraining.py``.

Each loss runs inside ``shard_map`` over the data axis and every reduction spans the GLOBAL
batch, so N devices compute one device's loss (and a 1-device mesh the plain batch's):

- ``mlm``: captions masked by ``idc_pcl.mask_caption`` (§5.1), each sample's key folded from
  the step's "inputs" key and its GLOBAL index; mean CE over every labelled token of the
  global batch (psum of sums / psum of counts).
- ``mvcl``: per sample 15 % of one image's N regions (img1 or img2 with p = 0.5, at least one)
  set to 0; a masked region's regressed feature is scored against the true features of every
  masked region and the model's regressions at every unmasked region of the global batch
  (``all_gather`` over the data axis), CE to its own target; psum of the row losses over the
  global masked-region count.
- ``fda``: each sample's caption, then its 6 hard negatives in file order, with the images
  repeated per caption (groups of 7 stay on one device); CE of the positive among the 7
  cosine similarities, mean over the global samples.
- the cross-task classification losses of A.3 (``ClassifyLosses``; the choices the paper
  leaves open are listed in ``changecap_jax/trainers/pretraining.py``'s docstring).

Section numbers (§) and quirk ids (S-Q, D-Q, I-Q) refer to docs/official/ (see its README.md).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from changecap_jax import parallel
from changecap_jax.errors import UserError
from changecap_jax.models import idc_pcl, precision
from changecap_jax.models.base import INPUTS_FOLD

TASKS = ("mlm", "mvcl", "fda")
REGION_MASK_PROBABILITY = 0.15  # §5.1 MVM masking
EXTRA_FOLD = 0xE17A  # the classification heads' dropout: fold_in(the device's dropout key, it)


class PretrainError(UserError, ValueError):
    """A pretraining config or input that cannot work (names the field or the file)."""


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
    # The batch is already in the compute dtype (make_task_loss casts it).
    x = jnp.asarray(x)
    return x.reshape(x.shape[0], -1, x.shape[-1]) if x.ndim == 4 else x


def mlm_inputs(model: idc_pcl.IDCPCL, keys: jax.Array,
               ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """§5.1: each caption masked by ``idc_pcl.mask_caption`` with its sample's key: (masked
    ids, labels, -1 = no loss). Public so ``reproduce`` gives the official side these masks."""
    mask = functools.partial(
        idc_pcl.mask_caption, eos_id=model.eos_id, mask_id=model.mask_token,
        num_tokens=model.num_tokens, word_probability=model.word_mask_probability,
        eos_probability=model.eos_mask_probability)
    return jax.vmap(mask)(keys, jnp.asarray(ids, jnp.int32))


def mvcl_mask(keys: jax.Array, num_regions: int,
              pseudo: jax.Array | None = None) -> jax.Array:
    """§5.1: each sample's region mask (s, 2N), True = masked (:func:`region_mask`); public
    so ``reproduce`` gives the official side these masks."""
    pseudo = jnp.zeros(keys.shape[0], bool) if pseudo is None else pseudo
    return jax.vmap(functools.partial(region_mask, num_regions=num_regions))(
        keys, real_only=pseudo)


# ---------------------------------------------------------------------------------------------
# Losses over the GLOBAL batch (inside shard_map; §5.3)
# ---------------------------------------------------------------------------------------------


def _global_mean(total: jax.Array, count: jax.Array, axis: str) -> jax.Array:
    return jax.lax.psum(total, axis) / jax.lax.psum(count, axis)


def mlm_metrics(logits: jax.Array, labels: jax.Array, axis: str) -> dict[str, jax.Array]:
    """§5.3 MLM: mean CE (and accuracy) over every labelled (label != -1) token of the GLOBAL
    batch."""
    ce, keep = idc_pcl.token_cross_entropy(logits, labels)
    hit = (jnp.argmax(logits, -1) == labels) & keep
    return {"loss": _global_mean(jnp.sum(ce), jnp.sum(keep), axis),
            "accuracy": _global_mean(jnp.sum(hit), jnp.sum(keep), axis)}


def _mlm(model: idc_pcl.IDCPCL, forward: Any, batch: dict, keys: jax.Array,
         axis: str) -> dict[str, jax.Array]:
    ids, labels = mlm_inputs(model, keys, batch["ids"])
    return mlm_metrics(forward(batch["img1"], batch["img2"], ids).mlm_logits, labels, axis)


def mvcl_row_losses(regressed: jax.Array, mask: jax.Array, features: jax.Array,
                    empty: jax.Array | None = None, *,
                    axis: str) -> tuple[jax.Array, jax.Array]:
    """§5.3 MVCL per masked region: regressed / features (s, 2N, C), mask (s, 2N) bool, True =
    masked, each sample's masked regions on one image; ``empty`` (s, 2N) marks regions of no
    image (a pseudo pair's second image), never negatives. Returns (the NCE of each region of
    each sample's masked image, 0 at unmasked ones, (s * N,); their mask), in batch order."""
    n, c = mask.shape[1] // 2, features.shape[-1]
    pred = idc_pcl.l2_normalize(precision.at_least_float32(regressed))  # (s, 2N, C)
    true = idc_pcl.l2_normalize(features)
    empty = jnp.zeros_like(mask) if empty is None else empty
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
    return jnp.where(row_masked, per_row, 0.0), row_masked


def mvcl_metrics(regressed: jax.Array, mask: jax.Array, features: jax.Array,
                 empty: jax.Array | None = None, *, axis: str) -> dict[str, jax.Array]:
    """§5.3 MVCL: the mean of :func:`mvcl_row_losses` over the GLOBAL masked regions."""
    per_row, masked = mvcl_row_losses(regressed, mask, features, empty, axis=axis)
    return {"loss": _global_mean(jnp.sum(per_row), jnp.sum(masked), axis)}


def _mvcl(model: idc_pcl.IDCPCL, forward: Any, batch: dict, keys: jax.Array,
          axis: str) -> dict[str, jax.Array]:
    del model
    t1, t2 = _tokens(batch["img1"]), _tokens(batch["img2"])
    n = t1.shape[1]
    # Pseudo pairs of a caption source (A.3): only the real image is masked, and the empty
    # image's regions are no negatives (they are no image's regions).
    pseudo = batch.get("pseudo", jnp.zeros(t1.shape[0], bool))
    mask = mvcl_mask(keys, n, pseudo)  # (s, 2N)
    empty = jnp.concatenate([jnp.zeros((t1.shape[0], n), bool),
                             jnp.broadcast_to(pseudo[:, None], (t1.shape[0], n))], 1)
    out = forward(jnp.where(mask[:, :n, None], 0.0, t1), jnp.where(mask[:, n:, None], 0.0, t2),
                  batch["ids"])
    return mvcl_metrics(out.regressed, mask, jnp.concatenate([t1, t2], 1), empty, axis=axis)


def fda_metrics(visual: jax.Array, text_cls: jax.Array, samples: int, axis: str,
                temperature: float = 1.0) -> dict[str, jax.Array]:
    """§5.3 FDA: cosine(visual, text) per row; each sample's 1 + K consecutive rows (positive
    first) form its logits / temperature; CE to 0 (and accuracy, mean positive and negative
    similarity), means over the GLOBAL samples."""
    sim = jnp.sum(idc_pcl.l2_normalize(visual) * idc_pcl.l2_normalize(text_cls),
                  -1).reshape(samples, -1)  # (s, 1 + K), the positive first
    log_probs = jax.nn.log_softmax(sim / temperature, -1)
    count = jnp.asarray(samples, sim.dtype)  # float64 in reproduce's float64 runs
    return {"loss": _global_mean(-jnp.sum(log_probs[:, 0]), count, axis),
            "accuracy": _global_mean(jnp.sum(jnp.argmax(sim, -1) == 0), count, axis),
            "positive_similarity": _global_mean(jnp.sum(sim[:, 0]), count, axis),
            "negative_similarity": _global_mean(jnp.sum(sim[:, 1:]),
                                                count * (sim.shape[1] - 1), axis)}


def _fda(forward: Any, batch: dict, axis: str, temperature: float) -> dict[str, jax.Array]:
    img1, img2, captions = fda_rows(batch["img1"], batch["img2"], batch["ids"],
                                    batch["negatives"])
    out = forward(img1, img2, captions)
    return fda_metrics(out.visual, out.text_cls, batch["ids"].shape[0], axis, temperature)


def on_one_device(loss: Any, *args: Any, **kwargs: Any) -> Any:
    """``loss(*args, axis=..., **kwargs)`` inside ``shard_map`` on a 1-device mesh: the plain
    batch's value, as a single-device function computes it (tests and parity checks)."""
    axis = parallel.DATA_AXIS
    return jax.shard_map(lambda *a: loss(*a, axis=axis, **kwargs), mesh=parallel.make_mesh(1),
                         in_specs=P(), out_specs=P(), check_vma=False)(*args)


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
                   fda_temperature: float = 1.0, classify: ClassifyLosses | None = None,
                   compute_dtype: Any = jnp.float32) -> Any:
    """(params, global batch, rng) -> (loss, metrics) of one task over the GLOBAL batch.

    ``rng`` is the step's key: the masks use ``fold_in(rng, INPUTS_FOLD)`` folded with
    each sample's global index, dropout ``fold_in(rng, device index)`` (as the trunk).
    ``classify``: the batch also holds a classification source's ``extra_*`` rows, whose
    weighted losses are added to the task's (``task_loss`` is the task's alone).
    ``compute_dtype``: float32 in training; float64 in ``reproduce --precision=float64``."""
    if task not in TASKS:
        raise PretrainError(f"unknown pretraining task {task!r}; tasks: {TASKS}")
    axis = parallel.DATA_AXIS

    def per_device(params: Any, batch: dict, rng: jax.Array) -> tuple[jax.Array, dict]:
        # Pretraining computes in float32: half-precision stored grids are upcast here.
        params, batch = precision.cast_floating((params, batch), compute_dtype)
        local = batch["ids"].shape[0]
        device = jax.lax.axis_index(axis)
        keys = sample_keys(jax.random.fold_in(rng, INPUTS_FOLD),
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
