"""What a captioning evaluation computes beside the decoded captions, one small class each,
chosen from the config and the model's capabilities by :func:`choose`.

Every evaluator has one interface: :meth:`Evaluator.start` at the start of a split,
:meth:`Evaluator.add` once per eval batch (on every process: device work such as the
distractor judge runs everywhere, host bookkeeping on process 0 only) and
:meth:`Evaluator.finish` on process 0, which returns the entries it adds to the split's metrics.
``extra`` holds per-pair inputs written beside the captions (``evaluation.write_results``).

- :class:`CaptionMetrics`: the COCO caption metrics (``evaluation.evaluate_pairs``), always.
- :class:`DistractorAccuracy`: the held-out accuracy of a model's distractor classifier
  (reference §5.6 val pass), for models with ``classify_distractor`` evaluated on distractor
  pairs.
- :class:`IdcProtocol`: the IDC code's scoring of the same captions, when
  ``config.eval_protocols`` includes "idc".
- :class:`EntityOutput`: the retrieved entity texts of each pair, for datasets with entities.

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

from changecap_jax import evaluation, precision
from changecap_jax.data import entity_inputs
from changecap_jax.data.streams import DISTRACTOR_LABELS
from changecap_jax.models import contract


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
    of every real row and stream, in the order of the results (process 0; empty elsewhere).
    """

    params: Any
    arrays: dict[str, jax.Array]
    after: dict[str, str]
    real_rows: np.ndarray | None
    pairs: list[tuple[str, dict, evaluation.PairCaption]]


class Evaluator(Protocol):
    extra: dict[str, dict[str, Any]]  # image id -> inputs written beside its caption

    def start(self, split: str) -> None: ...

    def add(self, batch: EvalBatch) -> None: ...

    def finish(self, records: list[evaluation.PairCaption]) -> dict[str, Any]: ...


class CaptionMetrics:
    """BLEU..CIDEr (and SPICE) of the captions, with the dataset's protocol fields."""

    def __init__(self, spice: str, dataset: Any):
        self.spice, self.meta, self.name, self.extra = spice, dataset.meta, dataset.name, {}

    def start(self, split: str) -> None:
        pass

    def add(self, batch: EvalBatch) -> None:
        pass

    def finish(self, records: list[evaluation.PairCaption]) -> dict[str, Any]:
        metrics = evaluation.evaluate_pairs(records, spice=self.spice)
        metrics.update(dataset=self.name, main_metrics=list(self.meta.main_metrics),
                       protocol=self.meta.protocol)
        return metrics


class DistractorAccuracy:
    """The distractor classifier's accuracy and CE on the split's semantic and distractor
    pairs (label 1 = semantic, as the official code)."""

    def __init__(self, model: Any, compute_dtype: Any):
        self.extra: dict[str, dict[str, Any]] = {}
        # The classifier's jitted log-probs (B, 2).
        self.judge = jax.jit(lambda params, before, after: jax.nn.log_softmax(
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

    def finish(self, records: list[evaluation.PairCaption]) -> dict[str, Any]:
        n = self.num_pairs
        return {"distractor": {"accuracy": 100.0 * self.correct / n, "loss": self.loss / n,
                               "num_pairs": n}}


class IdcProtocol:
    """The IDC code's scoring of the same captions, side by side with the COCO one."""

    extra: dict[str, dict[str, Any]] = {}

    def start(self, split: str) -> None:
        pass

    def add(self, batch: EvalBatch) -> None:
        pass

    def finish(self, records: list[evaluation.PairCaption]) -> dict[str, Any]:
        return {"idc": evaluation.evaluate_pairs_idc(records)}


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

    def finish(self, records: list[evaluation.PairCaption]) -> dict[str, Any]:
        return {}


def choose(config: ml_collections.ConfigDict, dataset: Any, model: Any, compute_dtype: Any,
           streams: tuple[str, ...]) -> list[Evaluator]:
    """The evaluators of a run, in the order their metrics are written."""
    chosen: list[Evaluator] = [CaptionMetrics(config.spice, dataset)]
    if "distractor" in streams and contract.has_capability(model, contract.CLASSIFY_DISTRACTOR):
        chosen.append(DistractorAccuracy(model, compute_dtype))
    if "idc" in tuple(config.get("eval_protocols", ("coco",))):
        chosen.append(IdcProtocol())
    if dataset.entities is not None:
        chosen.append(EntityOutput(dataset.entities))
    return chosen
