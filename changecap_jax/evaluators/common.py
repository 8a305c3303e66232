"""What a captioning evaluation computes beside the decoded captions, one small class each,
chosen from the config and the model's capabilities by :func:`choose`.

Every evaluator has one interface: :meth:`Evaluator.start` at the start of a split,
:meth:`Evaluator.add` once per eval batch (on every process: device work such as the
distractor judge runs everywhere, host bookkeeping on process 0 only) and
:meth:`Evaluator.finish` on process 0, which returns the entries it adds to the split's metrics.
``extra`` holds per-pair inputs written beside the captions (``results.write_results``).

- :class:`CaptionMetrics`: the COCO caption metrics (``captions.evaluate_pairs``), always.
- :class:`DistractorAccuracy`: the held-out accuracy of a model's distractor classifier
  (reference §5.6 val pass), for models with ``classify_distractor`` evaluated on distractor
  pairs.
- :class:`ChangeRouterAccuracy`: a change router's held-out change accuracy (every pair: is
  there a change) and type accuracy (the changed pairs with a known type), for models whose
  ``classify_change`` capability is on (e.g. a MEDIC plug-in, docs/models.md).
- :class:`IdcProtocol`: the IDC code's scoring of the same captions, when
  ``config.eval_protocols`` includes "idc".
- :class:`EntityOutput`: the retrieved entity texts of each pair, for datasets with entities.
- :class:`DifficultyBins`: caption metrics per viewpoint-change bin and the pointing game at
  the change words (``difficulty.py``), for datasets whose records carry viewpoint IoUs, when
  ``config.difficulty_bins`` > 0.

Section numbers (§) refer to docs/official/ (see its README.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from changecap_jax.data import entity_inputs
from changecap_jax.data.boxes import is_box
from changecap_jax.data.streams import DISTRACTOR_LABELS
from changecap_jax.decoding import attention_maps
from changecap_jax.decoding.jit import inference_jit
from changecap_jax.evaluators import captions, difficulty, idc_protocol, tokenize
from changecap_jax.models import contract, precision


def to_host(x: jax.Array) -> np.ndarray:
    """A global array on every process -> this process's full numpy copy."""
    if jax.process_count() > 1:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


@dataclasses.dataclass
class EvalBatch:
    """One eval batch as the evaluators see it.

    ``params``: the state's parameters (uncast); ``arrays``: the global device inputs by field
    name; ``after``: stream -> its after-image field; ``real_rows``: the batch rows that are
    real pairs (process 0; None elsewhere); ``pairs``: (stream, host record, decoded caption)
    of every real row and stream, in the order of the results (process 0; empty elsewhere);
    ``decoded``: stream -> the decoded ids (B, L) of every row, on every process.
    """

    params: Any
    arrays: dict[str, jax.Array]
    after: dict[str, str]
    real_rows: np.ndarray | None
    pairs: list[tuple[str, dict, captions.PairCaption]]
    decoded: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


class Evaluator(Protocol):
    extra: dict[str, dict[str, Any]]  # image id -> inputs written beside its caption

    def start(self, split: str) -> None: ...

    def add(self, batch: EvalBatch) -> None: ...

    def finish(self, records: list[captions.PairCaption]) -> dict[str, Any]: ...


class CaptionMetrics:
    """BLEU..CIDEr (and SPICE) of the captions, with the dataset's protocol fields."""

    def __init__(self, spice: str, dataset: Any):
        self.spice, self.meta, self.name, self.extra = spice, dataset.meta, dataset.name, {}

    def start(self, split: str) -> None:
        pass

    def add(self, batch: EvalBatch) -> None:
        pass

    def finish(self, records: list[captions.PairCaption]) -> dict[str, Any]:
        metrics = captions.evaluate_pairs(records, spice=self.spice)
        metrics.update(dataset=self.name, main_metrics=list(self.meta.main_metrics),
                       protocol=self.meta.protocol)
        return metrics


class DistractorAccuracy:
    """The distractor classifier's accuracy and CE on the split's semantic and distractor
    pairs (label 1 = semantic, as the official code)."""

    def __init__(self, model: Any, compute_dtype: Any):
        self.extra: dict[str, dict[str, Any]] = {}
        # The classifier's jitted log-probs (B, 2).
        self.judge = inference_jit(lambda params, before, after: jax.nn.log_softmax(
            model.apply(*precision.cast_floating(({"params": params}, before, after),
                                                 compute_dtype),
                        method=contract.distractor_classifier(model)).astype(jnp.float32)))

    def start(self, split: str) -> None:
        self.correct, self.loss, self.num_pairs = 0, 0.0, 0

    def add(self, batch: EvalBatch) -> None:
        arrays = batch.arrays
        log_probs = {s: to_host(self.judge(batch.params, arrays["before"], arrays[after]))
                     for s, after in batch.after.items()}
        if batch.real_rows is None:
            return
        for s, stream_log_probs in log_probs.items():
            real, label = stream_log_probs[batch.real_rows], DISTRACTOR_LABELS[s]
            self.correct += int(np.sum(np.argmax(real, -1) == label))
            self.loss -= float(np.sum(real[:, label], dtype=np.float64))
            self.num_pairs += len(real)

    def finish(self, records: list[captions.PairCaption]) -> dict[str, Any]:
        n = self.num_pairs
        return {"distractor": {"accuracy": 100.0 * self.correct / n, "loss": self.loss / n,
                               "num_pairs": n}}


class ChangeRouterAccuracy:
    """A change router's accuracy on the split: change accuracy over every real pair of every
    stream (the pair's label: 1 = change on the semantic stream, 0 on the distractor one, as
    ``DISTRACTOR_LABELS``), type accuracy (argmax of the type logits) over the semantic pairs
    whose change type (``DatasetMeta.change_types``, by name) is one of the router's types.
    Accuracies x100; ``type_accuracy`` is None when no pair has a known type."""

    def __init__(self, model: Any, compute_dtype: Any, dataset_types: tuple[str, ...]):
        self.extra: dict[str, dict[str, Any]] = {}
        method, names = contract.change_router(model)
        # dataset change-type index -> router type index (-1: none), by name
        self.type_of = [names.index(t) if t in names else -1 for t in dataset_types]

        def route(params: Any, before: jax.Array, after: jax.Array) -> jax.Array:
            change, types = model.apply(*precision.cast_floating(
                ({"params": params}, before, after), compute_dtype), method=method)
            return jnp.argmax(change, -1), jnp.argmax(types, -1)

        self.route = inference_jit(route)

    def start(self, split: str) -> None:
        self.change_correct = self.num_pairs = self.type_correct = self.num_typed = 0

    def add(self, batch: EvalBatch) -> None:
        predicted = {s: tuple(to_host(x) for x in self.route(
            batch.params, batch.arrays["before"], batch.arrays[after]))
            for s, after in batch.after.items()}
        if batch.real_rows is None:
            return
        for s, (change, _) in predicted.items():
            self.change_correct += int(np.sum(change[batch.real_rows] == DISTRACTOR_LABELS[s]))
            self.num_pairs += len(batch.real_rows)
        if "semantic" not in predicted:
            return
        semantic = [record for s, record, _ in batch.pairs if s == "semantic"]
        for j, record in zip(batch.real_rows, semantic, strict=True):
            ct = int(record["change_type"])
            label = self.type_of[ct] if 0 <= ct < len(self.type_of) else -1
            if label >= 0:
                self.type_correct += int(predicted["semantic"][1][j] == label)
                self.num_typed += 1

    def finish(self, records: list[captions.PairCaption]) -> dict[str, Any]:
        n, typed = self.num_pairs, self.num_typed
        return {"router": {
            "change_accuracy": 100.0 * self.change_correct / n if n else None,
            "type_accuracy": 100.0 * self.type_correct / typed if typed else None,
            "num_pairs": n, "num_typed_pairs": typed}}


class IdcProtocol:
    """The IDC code's scoring of the same captions, side by side with the COCO one."""

    extra: dict[str, dict[str, Any]] = {}

    def start(self, split: str) -> None:
        pass

    def add(self, batch: EvalBatch) -> None:
        pass

    def finish(self, records: list[captions.PairCaption]) -> dict[str, Any]:
        return {"idc": idc_protocol.evaluate_pairs_idc(records)}


class EntityOutput:
    """Each pair's retrieved entity texts (the inputs beside the images) in the results."""

    def __init__(self, entities: Any):
        self.entities = entities

    def start(self, split: str) -> None:
        self.extra: dict[str, dict[str, Any]] = {}

    def add(self, batch: EvalBatch) -> None:
        for stream, record, caption in batch.pairs:
            self.extra[caption.image_id] = {"entities": entity_inputs.entity_texts(
                self.entities, record[f"entity_ids_{stream}"])}

    def finish(self, records: list[captions.PairCaption]) -> dict[str, Any]:
        return {}


class DifficultyBins:
    """Caption metrics per viewpoint-change bin of each stream, and the pointing game of the
    decoder's attention at the change words on the semantic pairs' changed-object boxes
    (``difficulty.py``; SCORER Fig. 6, DIRL Fig. 4)."""

    def __init__(self, model: Any, compute_dtype: Any, dataset: Any, num_bins: int,
                 conditioning: tuple[str, ...] = ()):
        self.extra: dict[str, dict[str, Any]] = {}
        self.num_bins, self.conditioning = num_bins, conditioning
        self.id_to_word = dataset.vocab.id_to_word
        self.image_size = dataset.meta.image_size
        self.layout = attention_maps.memory_layout(model)

        def attention(params: Any, before: jax.Array, after: jax.Array, ids: jax.Array,
                      conditioning: dict) -> jax.Array:
            variables, before, after, conditioning = precision.cast_floating(
                ({"params": params}, before, after, conditioning), compute_dtype)
            return attention_maps.query_attention(model, variables, before, after, ids,
                                                  conditioning)

        self.attention = inference_jit(attention)  # (B, L, M) per query

    def start(self, split: str) -> None:
        self.extra = {}
        self.iou: dict[str, float] = {}  # image id -> viewpoint IoU
        self.stream_of: dict[str, str] = {}
        self.pointing: dict[str, tuple[float, float, int]] = {}  # image id -> score_pair
        self.without_change_words = 0

    def add(self, batch: EvalBatch) -> None:
        for stream, record, caption in batch.pairs:
            value = record.get(f"{difficulty.MEASURE}_{stream}")
            self.iou[caption.image_id] = float(value) if value is not None else float("nan")
            self.stream_of[caption.image_id] = stream
        if self.image_size is None or "semantic" not in batch.decoded:
            return
        ids = batch.decoded["semantic"]
        attention = to_host(self.attention(
            batch.params, batch.arrays["before"], batch.arrays[batch.after["semantic"]],
            jnp.asarray(ids, jnp.int32),
            {c: batch.arrays[f"{c}_semantic"] for c in self.conditioning}))
        if batch.real_rows is None:
            return
        semantic = [(r, c) for s, r, c in batch.pairs if s == "semantic"]
        grid = tuple(batch.arrays["before"].shape[1:3])
        for j, (record, caption) in zip(batch.real_rows, semantic, strict=True):
            self._point(ids[j], attention[j], record, caption.image_id, grid)

    def _point(self, ids: np.ndarray, attention: np.ndarray, record: dict, image_id: str,
               grid: tuple[int, int]) -> None:
        boxes = (record.get("bbox_before"), record.get("bbox_after"))
        if not any(is_box(b) for b in boxes):
            return
        queries = difficulty.change_word_queries(ids, self.id_to_word)
        if len(queries) == 0:
            self.without_change_words += 1
            return
        maps = attention_maps.grid_maps(self.layout, attention[queries].mean(axis=0)[None], grid)
        self.pointing[image_id] = difficulty.score_pair((maps.before[0], maps.after[0]), boxes,
                                                        self.image_size)

    def finish(self, records: list[captions.PairCaption]) -> dict[str, Any]:
        by_id = {r.image_id: r for r in records}
        bins: dict[str, list[list[str]]] = {}
        for stream in dict.fromkeys(self.stream_of.values()):
            ids = [i for i, s in self.stream_of.items() if s == stream]
            groups = difficulty.quantile_bins([self.iou[i] for i in ids], self.num_bins)
            if groups:
                bins[stream] = [[ids[k] for k in group] for group in groups]
        if not bins:
            return {}
        tokenized = tokenize.tokenize_captions(
            {i: by_id[i].caption for i in self.iou}, {i: by_id[i].references for i in self.iou})
        scores = captions.score_tokenized(
            tokenized, {f"{s}/{k}": ids for s, groups in bins.items()
                        for k, ids in enumerate(groups)}, spice="off")
        entry: dict[str, Any] = {"measure": difficulty.MEASURE, "num_bins": self.num_bins,
                                 "bins": {s: [self._bin(ids, scores[f"{s}/{k}"], s)
                                              for k, ids in enumerate(groups)]
                                          for s, groups in bins.items()}}
        self._per_pair_extra()
        if self.pointing or self.without_change_words:
            entry["pointing"] = dict(self._pointing(list(self.pointing)),
                                     num_pairs=len(self.pointing),
                                     pairs_without_change_words=self.without_change_words)
        return {"difficulty": entry}

    def _per_pair_extra(self) -> None:
        """Each pair's IoU (and pointing x100) beside its caption."""
        self.extra = {i: {difficulty.MEASURE: v} for i, v in self.iou.items() if np.isfinite(v)}
        for i, (hits, _, boxes) in self.pointing.items():
            self.extra.setdefault(i, {})["pointing"] = 100.0 * hits / boxes

    def _bin(self, ids: list[str], scores: dict[str, float], stream: str) -> dict[str, Any]:
        values = [self.iou[i] for i in ids]
        row: dict[str, Any] = {"iou_low": min(values), "iou_high": max(values),
                               "num_pairs": len(ids)}
        row.update({k: 100.0 * v for k, v in scores.items()})
        if stream == "semantic" and (self.pointing or self.without_change_words):
            row.update(self._pointing([i for i in ids if i in self.pointing]))
        return row

    def _pointing(self, ids: list[str]) -> dict[str, Any]:
        """Pointing and attention in the boxes x100 over ``ids``' boxes (None without any)."""
        hits, mass, boxes = (sum(self.pointing[i][k] for i in ids) for k in range(3))
        return {"pointing": 100.0 * hits / boxes if boxes else None,
                "attention_in_box": 100.0 * mass / boxes if boxes else None,
                "num_boxes": int(boxes)}


def has_viewpoint_iou(dataset: Any) -> bool:
    """Whether the dataset's records carry a viewpoint IoU (``data/schema.py``)."""
    return any(key.startswith(difficulty.MEASURE + "_")
               for key in dataset.builder.info.features.keys())


def choose(config: ml_collections.ConfigDict, dataset: Any, model: Any, compute_dtype: Any,
           streams: tuple[str, ...], conditioning: tuple[str, ...] = ()) -> list[Evaluator]:
    """The evaluators of a run, in the order their metrics are written."""
    chosen: list[Evaluator] = [CaptionMetrics(config.spice, dataset)]
    if "distractor" in streams and contract.has_capability(model, contract.CLASSIFY_DISTRACTOR):
        chosen.append(DistractorAccuracy(model, compute_dtype))
    if contract.change_router(model) is not None:
        chosen.append(ChangeRouterAccuracy(model, compute_dtype,
                                           tuple(dataset.meta.change_types)))
    if "idc" in tuple(config.get("eval_protocols", ("coco",))):
        chosen.append(IdcProtocol())
    if dataset.entities is not None:
        chosen.append(EntityOutput(dataset.entities))
    if config.get("difficulty_bins", 0) > 0 and has_viewpoint_iou(dataset):
        chosen.append(DifficultyBins(model, compute_dtype, dataset, config.difficulty_bins,
                                     conditioning))
    return chosen
