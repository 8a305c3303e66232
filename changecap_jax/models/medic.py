"""MEDIC (ECCV 2026): change-type-specialized experts for robust change captioning, as the
official code ``VisualAIKHU/MEDIC`` computes it (``models/model.py``, ``train/train_*_final.py``;
docs/models.md, "MEDIC"; docs/adding_a_model.md, "Plug-ins").

A plug-in: it reads the host model's paired difference features (DIRL's ``diff_bef`` and
``diff_aft``, (B, N, D) on an H x W grid) and returns expert features the host concatenates to
its decoder input, the routing outputs and its losses. The host stays unchanged when the plug-in
is off.

Method
------
1. Paired map. P = cat(diff_bef, diff_aft) on the grid, (B, H, W, 2D).
2. Two-stage router. Stage 1 (is there a change): ``change_classifier`` = Conv3x3(2D -> 512) ->
   ReLU -> Conv3x3(512 -> 2), averaged over the grid: change logits (B, 2); p_change =
   softmax(logits / cls_temperature); predicted change: argmax == 1. Stage 2 (which type):
   ``type_classifier``, the same shape with K outputs (K = 5: color, material, add, drop,
   move): type logits (B, K).
3. Experts. One key-value memory per change type and one for no change: a token x (2D) reads
   softmax(cos(x, keys) / 0.1) @ values (memory_size slots, 100 in the official code).
4. Routing (official ``DIRL.forward``). A pair goes to the change experts when the router
   predicts a change AND its label is a change; its output is sum_k w_k expert_k(P), w =
   stop_grad(softmax(type_logits / type_temperature) * p_change[1]). It goes to the no-change
   expert when the router predicts no change AND its label is no change: stop_grad(p_change[0]) *
   expert_nc(P). Any other pair gets zeros. Without labels (:meth:`MEDIC.__call__` with
   ``labels=None``: our decoding path) only the router decides; the official test script passes
   the labels at test time too. Two fields of ours, off by default (the official behaviour):
   ``feature_routing="router"`` routes the features by the router alone in training too (the
   losses keep the label masks), ``detach_host_features`` reads the host's features through
   stop_gradient (MEDIC trains itself and never reshapes them).
5. Losses (train). ``change_cls`` = CE(change logits, label != no-change) over the batch;
   ``change_type_cls`` = CE(type logits, label) over the pairs routed to the change experts (0 if
   none); ``expert_disentangle`` = lambda_inter * inter + lambda_intra * intra on the expert
   output's per-group mean directions (groups: each type among predicted changes, and all
   predicted no-change pairs): inter = mean_k relu(cos(z_nc, z_k) - margin_inter)^2, intra =
   mean_{k<l} relu(cos(z_k, z_l) - margin_intra)^2; ``expert_consistency`` = sum over experts of
   the mean over the pairs of that expert's label (routed) of 1 -/+ cos(E(cat(a, b)),
   E(cat(b, a))) (token-mean cosine; ``+`` for the directional types, add and drop).

The official weights (``run/run_*_final.sh``; docs/models.md): lambda_cls = lambda_type = 0.1;
lambda_disentangle / lambda_consistency 0.1 / 0.1 (CLEVR-Change), 0.1 / 0.01 (CLEVR-DC),
0.01 / 0.01 (Spot-the-Diff).

Labels. ``labels`` are MEDIC's indices: 0..K-1 a change type (``type_names`` order), K no
change, -1 a change of unknown type (counts as a change, as the official code's -1 does; it
gets no type loss). :func:`medic_labels` maps the dataset's ``change_type`` to them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from changecap_jax.errors import UserError

Array = jax.Array

TYPE_NAMES = ("color", "material", "add", "drop", "move")  # official type_to_label 0..4
DIRECTIONAL = ("add", "drop")  # official compute_cosine_consistency_loss: 1 + cos
ADDRESS_TEMPERATURE = 0.1  # ExpertMemory: softmax(sim / 0.1)
LOSSES = ("change_cls", "change_type_cls", "expert_disentangle", "expert_consistency")


class MEDICOutput(NamedTuple):
    features: Array  # (B, N, 2D): the experts' output, [before half | after half]
    change_logits: Array  # (B, 2): 0 no change, 1 change
    type_logits: Array  # (B, K)
    losses: dict[str, Array]  # LOSSES (train with labels), else empty


class NoChangeTypesError(UserError, ValueError):
    """The dataset has no change-type labels, or types MEDIC has no expert for."""


def check_change_types(dataset_types: Sequence[str], configured: Sequence[str],
                       type_names: Sequence[str] = TYPE_NAMES) -> None:
    """Refuses (one line) a dataset whose ``change_types`` MEDIC cannot use."""
    if not dataset_types:
        raise NoChangeTypesError(
            "MEDIC needs change-type labels and this dataset has none (DatasetMeta.change_types "
            "is empty); train without model.medic or build the dataset with change types")
    if tuple(dataset_types) != tuple(configured):
        raise NoChangeTypesError(
            f"MEDIC: the dataset's change types {list(dataset_types)} differ from "
            f"model.medic.dataset_types {list(configured)}; set them to the dataset's")
    unknown = [t for t in dataset_types if t not in type_names]
    if unknown:
        raise NoChangeTypesError(f"MEDIC has no expert for change types {unknown}; its types "
                                 f"are {list(type_names)}")


def label_table(dataset_types: Sequence[str], type_names: Sequence[str] = TYPE_NAMES
                ) -> np.ndarray:
    """dataset change-type index -> MEDIC index (by name; -1 where MEDIC has no such type)."""
    return np.asarray([type_names.index(t) if t in type_names else -1 for t in dataset_types],
                      np.int32)


def medic_labels(change_type: Array, dataset_types: Sequence[str], *, no_change: bool,
                 type_names: Sequence[str] = TYPE_NAMES) -> Array:
    """Batch ``change_type`` (index into DatasetMeta.change_types, -1 none) -> MEDIC labels;
    every pair of a no-change stream (distractor pairs) is K, no change."""
    k = len(type_names)
    if no_change:
        return jnp.full(change_type.shape, k, jnp.int32)
    table = jnp.asarray(np.append(label_table(dataset_types, type_names), -1))
    return table[jnp.where(change_type < 0, len(dataset_types), change_type)]


def stream_labels(batch: Mapping[str, Array], medic: Mapping[str, Any], stream: str,
                  type_names: Sequence[str] = TYPE_NAMES) -> Array:
    """A host's MEDIC labels of one caption stream of ``batch`` (``medic``: the host's
    ``config.model.medic``). The batch's ``change_type``, or -1 (a change of unknown type) in
    the example batches of ``model.init``, which carry only the stream fields."""
    change_type = (batch["change_type"] if "change_type" in batch
                   else jnp.full(batch["before"].shape[:1], -1, jnp.int32))
    return medic_labels(change_type, medic["dataset_types"], no_change=stream == "distractor",
                        type_names=type_names)


def check_host_dataset(medic: Mapping[str, Any] | None, meta: Any) -> None:
    """A host's capability ``check_dataset``: refuses (one line) a dataset without the change
    types its plug-in needs; nothing to check when the plug-in is off."""
    if enabled(medic):
        check_change_types(meta.change_types, medic["dataset_types"],
                           medic.get("type_names", TYPE_NAMES))


# ---- the experts (paper: key-value memory experts) -------------------------------------------


def _normalize(x: Array, axis: int = -1, eps: float = 1e-12) -> Array:
    """torch F.normalize: x / max(||x||, eps), with a finite gradient at x = 0 (an empty
    group's mean, zero expert rows), where ``jnp.linalg.norm``'s gradient is NaN."""
    sq = jnp.sum(jnp.square(x), axis=axis, keepdims=True)
    return x / jnp.sqrt(jnp.maximum(sq, eps * eps))


class ExpertMemory(nn.Module):
    """One expert: read(x) = softmax(cos(x, keys) / 0.1) @ values (official ExpertMemory)."""

    memory_size: int
    dim: int

    @nn.compact
    def __call__(self, x: Array) -> Array:
        init = nn.initializers.orthogonal()  # official reset_parameters
        keys = self.param("key_memory", init, (self.memory_size, self.dim))
        values = self.param("value_memory", init, (self.memory_size, self.dim))
        sim = _normalize(x) @ _normalize(keys).T
        return jax.nn.softmax(sim / ADDRESS_TEMPERATURE, axis=-1) @ values


class Classifier(nn.Module):
    """Conv3x3(2D -> hidden) -> ReLU -> Conv3x3(hidden -> n), averaged over the grid."""

    num_outputs: int
    hidden: int = 512

    @nn.compact
    def __call__(self, paired_map: Array) -> Array:
        conv = lambda n, name: nn.Conv(n, (3, 3), padding=1, name=name,
                                       kernel_init=nn.initializers.kaiming_normal())
        h = nn.relu(conv(self.hidden, "conv_0")(paired_map))
        return jnp.mean(conv(self.num_outputs, "conv_2")(h), axis=(1, 2))


# ---- losses (official compute_*_loss) ---------------------------------------------------------


def _global_sum(x: Array, axis_name: str | None) -> Array:
    """A batch sum over every device's share (inside ``shard_map``): the losses below are
    means over the GLOBAL batch, so 8 devices compute what one does."""
    return x if axis_name is None else jax.lax.psum(x, axis_name)


def _cross_entropy(logits: Array, labels: Array, weight: Array,
                   axis_name: str | None = None) -> Array:
    """Mean CE over the rows with weight 1 (0 when there are none)."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    safe = jnp.clip(labels, 0, logits.shape[-1] - 1)  # rows outside the loss: any valid index
    nll = -jnp.take_along_axis(logp, safe[:, None], axis=-1)[:, 0]
    n = _global_sum(jnp.sum(weight), axis_name)
    total = _global_sum(jnp.sum(jnp.where(weight > 0, nll, 0.0) * weight), axis_name)
    return jnp.where(n > 0, total / jnp.maximum(n, 1.0), 0.0)


def disentangle_loss(features: Array, labels: Array, is_change: Array, num_types: int,
                     margins: tuple[float, float], lambdas: tuple[float, float],
                     axis_name: str | None = None) -> Array:
    """Official compute_cosine_margin_disentangle_loss: group directions of the expert output."""
    groups = [(labels == k) & is_change for k in range(num_types)] + [~is_change]
    masks = jnp.stack(groups).astype(features.dtype)  # (K+1, B)
    counts = _global_sum(masks.sum(-1) * features.shape[1], axis_name)
    sums = _global_sum(jnp.einsum("gb,bnd->gd", masks, features), axis_name)
    means = sums / jnp.maximum(counts, 1.0)[:, None]
    z, present = _normalize(means), counts > 0
    cos = z @ z.T
    pair = lambda a, b, m: jnp.where(present[a] & present[b],
                                     jnp.square(nn.relu(cos[a, b] - m)), 0.0)
    pair_on = lambda a, b: (present[a] & present[b]).astype(features.dtype)
    nc = num_types
    inter = sum(pair(nc, k, margins[0]) for k in range(num_types))
    n_inter = sum(pair_on(nc, k) for k in range(num_types))
    ij = [(i, j) for i in range(num_types) for j in range(i + 1, num_types)]
    intra = sum(pair(i, j, margins[1]) for i, j in ij)
    n_intra = sum(pair_on(i, j) for i, j in ij)
    return (lambdas[0] * inter / jnp.maximum(n_inter, 1.0)
            + lambdas[1] * intra / jnp.maximum(n_intra, 1.0))


def consistency_term(out: Array, out_reversed: Array, weight: Array, directional: bool,
                     axis_name: str | None = None) -> Array:
    """One expert's term: mean over the weighted pairs of 1 -/+ token-mean cosine (0 if none)."""
    cos = jnp.mean(jnp.sum(_normalize(out) * _normalize(out_reversed), -1), -1)
    per_pair = 1.0 + cos if directional else 1.0 - cos
    n = _global_sum(jnp.sum(weight), axis_name)
    total = _global_sum(jnp.sum(per_pair * weight), axis_name)
    return jnp.where(n > 0, total / jnp.maximum(n, 1.0), 0.0)


# ---- the plug-in -----------------------------------------------------------------------------


class MEDIC(nn.Module):
    """Router + experts on the host's paired difference features (module docstring)."""

    dim: int  # D, the width of each difference feature
    type_names: tuple[str, ...] = TYPE_NAMES
    memory_size: int = 100
    classifier_hidden: int = 512
    cls_temperature: float = 1.0
    type_temperature: float = 1.0
    margin_inter: float = 0.2
    margin_intra: float = 0.7
    lambda_inter: float = 1.0
    lambda_intra: float = 1.0
    # Not in the official code (docs/models.md, "MEDIC on SCORER+CBR"): with labels, "labels"
    # routes the expert features by router AND label (official), "router" by the router alone,
    # as at test; the losses' routing masks keep the labels either way.
    feature_routing: str = "labels"
    # True: MEDIC reads stop_gradient(host features), so its losses and its features' gradient
    # train the router and experts but never reshape the host's features.
    detach_host_features: bool = False

    def setup(self) -> None:
        k = len(self.type_names)
        self.change_classifier = Classifier(2, self.classifier_hidden)
        self.type_classifier = Classifier(k, self.classifier_hidden)
        self.experts = [ExpertMemory(self.memory_size, 2 * self.dim) for _ in range(k)]
        self.no_change_expert = ExpertMemory(self.memory_size, 2 * self.dim)

    def route(self, diff_before: Array, diff_after: Array, grid_hw: tuple[int, int]
              ) -> tuple[Array, Array]:
        """The router alone (method step 2): change logits (B, 2) and type logits (B, K)."""
        paired = jnp.concatenate([diff_before, diff_after], axis=-1)  # (B, N, 2D)
        paired_map = paired.reshape(paired.shape[0], *grid_hw, paired.shape[-1])
        return self.change_classifier(paired_map), self.type_classifier(paired_map)

    def __call__(self, diff_before: Array, diff_after: Array, grid_hw: tuple[int, int],
                 labels: Array | None = None, *, train: bool = False,
                 axis_name: str | None = None) -> MEDICOutput:
        """diff_* (B, N = H*W, D) -> :class:`MEDICOutput`; ``labels`` (B,) MEDIC indices;
        ``axis_name``: the data axis when run inside ``shard_map`` (losses over the global
        batch)."""
        k = len(self.type_names)
        if self.feature_routing not in ("labels", "router"):
            raise ValueError(f"model.medic.feature_routing must be 'labels' or 'router', got "
                             f"{self.feature_routing!r}")
        if self.detach_host_features:
            diff_before, diff_after = map(jax.lax.stop_gradient, (diff_before, diff_after))
        paired = jnp.concatenate([diff_before, diff_after], axis=-1)  # (B, N, 2D)
        change_logits, type_logits = self.route(diff_before, diff_after, grid_hw)
        p_change = jax.nn.softmax(change_logits / self.cls_temperature, axis=-1)
        is_change = jnp.argmax(p_change, axis=-1) == 1
        to_change, to_none = is_change, ~is_change
        if labels is not None:
            to_change, to_none = to_change & (labels != k), to_none & (labels == k)
        weights = jax.lax.stop_gradient(
            jax.nn.softmax(type_logits / self.type_temperature, axis=-1) * p_change[:, 1:])
        outs = [expert(paired) for expert in self.experts]
        mixed = sum(weights[:, i, None, None] * o for i, o in enumerate(outs))
        out_nc = self.no_change_expert(paired)
        nc = jax.lax.stop_gradient(p_change[:, 0])[:, None, None] * out_nc
        routed = lambda change, none: jnp.where(change[:, None, None], mixed,
                                                jnp.where(none[:, None, None], nc, 0.0))
        label_routed = routed(to_change, to_none)  # official; the losses always read these
        features = (routed(is_change, ~is_change) if self.feature_routing == "router"
                    else label_routed)
        losses = {}
        if train and labels is not None:
            reversed_pair = jnp.concatenate([diff_after, diff_before], axis=-1)
            f = paired.dtype
            consistency = sum(
                consistency_term(o, self.experts[i](reversed_pair),
                                 (to_change & (labels == i)).astype(f),
                                 self.type_names[i] in DIRECTIONAL, axis_name)
                for i, o in enumerate(outs))
            consistency += consistency_term(out_nc, self.no_change_expert(reversed_pair),
                                            to_none.astype(f), False, axis_name)
            losses = {
                "change_cls": _cross_entropy(change_logits, (labels != k).astype(jnp.int32),
                                             jnp.ones(labels.shape, f), axis_name),
                "change_type_cls": _cross_entropy(type_logits, labels,
                                                  (to_change & (labels >= 0)).astype(f),
                                                  axis_name),
                "expert_disentangle": disentangle_loss(
                    label_routed, labels, is_change, k,
                    (self.margin_inter, self.margin_intra),
                    (self.lambda_inter, self.lambda_intra), axis_name),
                "expert_consistency": consistency,
            }
        return MEDICOutput(features, change_logits, type_logits, losses)


def enabled(medic: Mapping[str, Any] | None) -> bool:
    """Whether a host's ``medic`` field (``config.model.medic``) switches the plug-in on."""
    return bool(medic) and bool(medic.get("enabled", True))


def type_names(medic: Mapping[str, Any] | None) -> tuple[str, ...]:
    """The change types of a host's ``medic`` field (empty when the plug-in is off): the names
    of the router's type logits, in order."""
    return tuple(medic.get("type_names", TYPE_NAMES)) if enabled(medic) else ()


def from_config(medic: Mapping[str, Any] | None, dim: int) -> MEDIC | None:
    """The plug-in of a host's ``medic`` field (``config.model.medic``), None when absent/off.
    ``dataset_types`` is the host's business (labels); the rest are MEDIC's fields."""
    if not enabled(medic):
        return None
    fields = {k: v for k, v in dict(medic).items() if k not in ("enabled", "dataset_types")}
    if "type_names" in fields:
        fields["type_names"] = tuple(fields["type_names"])
    return MEDIC(dim=dim, name="medic", **fields)
