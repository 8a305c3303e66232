"""grain input pipelines over a dataset split, for one or many hosts.

Training (reference §2.5): an endless, seeded shuffle (a new order every epoch), each process
reading only its own share of the indices. Each example gives both of its pairs: (before,
semantic-after) with one change caption drawn uniformly and, where the dataset has
distractors, (before, distractor-after) with one no-change caption; with probability
``swap_prob`` the before and distractor-after images trade places, as the official loader's
augmentation does. The iterator's state can be saved and restored.

Evaluation: every example exactly once, in split order. The split is cut into global batches;
global batch k holds examples k*G .. k*G+G-1 (G the global batch size), process p reads its
slice of each, and positions past the end are padding with ``mask`` False.

:func:`to_global` turns one process's local batch into global ``jax.Array`` s sharded over
the mesh's data axis (``jax.make_array_from_process_local_data``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import grain
import numpy as np

# Fields that stay on the host (strings, reference lists); everything else goes to devices.
HOST_FIELDS = ("image_id", "change_captions", "no_change_captions")


def _check_batch(global_batch_size: int, process_count: int) -> int:
    if global_batch_size % process_count:
        raise ValueError(
            f"global batch size {global_batch_size} is not divisible by the number of "
            f"processes {process_count}"
        )
    return global_batch_size // process_count


class TrainPairs(grain.transforms.RandomMap):
    """Record -> the training fields of its pairs, with seeded caption choice and swap."""

    def __init__(self, swap_prob: float = 0.5, pair_fields: tuple[str, ...] = ()):
        self.swap_prob = swap_prob
        # Per-pair side inputs (e.g. retrieved entities): ``<f>_semantic`` is passed on, and
        # the distractor pair takes ``<f>_distractor_swapped`` when its images are swapped.
        self.pair_fields = tuple(pair_fields)

    def random_map(self, record: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        captions = record["change_caption_ids"]
        out = {
            "id": np.int32(record["id"]),
            "change_type": np.int32(record["change_type"]),
            "before": record["before"],
            "after_semantic": record["after_semantic"],
            "change_caption": captions[rng.integers(len(captions))],
        }
        out.update({f"{f}_semantic": record[f"{f}_semantic"] for f in self.pair_fields})
        if "after_distractor" in record:
            before, distractor = record["before"], record["after_distractor"]
            swapped = rng.random() < self.swap_prob
            if swapped:
                before, distractor = distractor, before
            no_change = record["no_change_caption_ids"]
            out.update(
                before=before,
                after_distractor=distractor,
                no_change_caption=no_change[rng.integers(len(no_change))],
            )
            orientation = "distractor_swapped" if swapped else "distractor"
            out.update({f"{f}_distractor": record[f"{f}_{orientation}"]
                        for f in self.pair_fields})
        return out


def train_loader(
    source: Any,
    *,
    global_batch_size: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
    swap_prob: float = 0.5,
    worker_count: int = 0,
    pair_fields: tuple[str, ...] = (),
) -> grain.DataLoader:
    """An endless loader of this process's local training batches."""
    local_batch = _check_batch(global_batch_size, process_count)
    if len(source) < global_batch_size:
        raise ValueError(
            f"the split has {len(source)} examples, fewer than the global batch size "
            f"{global_batch_size}"
        )
    sampler = grain.samplers.IndexSampler(
        num_records=len(source),
        shard_options=grain.sharding.ShardOptions(
            shard_index=process_index, shard_count=process_count, drop_remainder=True
        ),
        shuffle=True,
        num_epochs=None,
        seed=seed,
    )
    return grain.DataLoader(
        data_source=source,
        sampler=sampler,
        operations=[
            TrainPairs(swap_prob, pair_fields),
            grain.transforms.Batch(local_batch, drop_remainder=True),
        ],
        worker_count=worker_count,
    )


def eval_batches(
    source: Any,
    *,
    global_batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
) -> Iterator[dict[str, Any]]:
    """This process's local eval batches; every process yields the same number of batches.

    Each batch holds the record fields (host fields as object arrays) plus ``mask`` (bool):
    False marks padding, which repeats a real record so shapes stay fixed.
    """
    local_batch = _check_batch(global_batch_size, process_count)
    n = len(source)
    num_batches = max(1, math.ceil(n / global_batch_size))
    indices = []
    for k in range(num_batches):
        start = k * global_batch_size + process_index * local_batch
        indices.extend(range(start, start + local_batch))
    dataset = grain.MapDataset.range(len(indices)).map(
        lambda i: _masked_record(source, indices[i], n)
    )
    for b in range(num_batches):
        items = [dataset[b * local_batch + j] for j in range(local_batch)]
        yield {key: _stack([it[key] for it in items]) for key in items[0]}


def _masked_record(source: Any, index: int, n: int) -> dict[str, Any]:
    valid = index < n
    record = dict(source[index if valid else index % n])
    record["mask"] = np.bool_(valid)
    return record


def _stack(values: list[Any]) -> np.ndarray:
    arrays = [np.asarray(v) for v in values]
    first = arrays[0]
    if first.dtype != object and all(a.shape == first.shape for a in arrays):
        return np.stack(arrays)
    out = np.empty((len(values),), dtype=object)  # ragged or string fields stay per-example
    for i, v in enumerate(values):
        out[i] = v
    return out


def num_eval_batches(num_examples: int, global_batch_size: int) -> int:
    return max(1, math.ceil(num_examples / global_batch_size))


def device_fields(batch: dict[str, Any]) -> dict[str, np.ndarray]:
    """The fields of a local batch that go to devices (numeric, fixed shape)."""
    return {
        k: v for k, v in batch.items()
        if k not in HOST_FIELDS and isinstance(v, np.ndarray) and v.dtype != object
    }


def to_global(batch: dict[str, np.ndarray], sharding: Any,
              fields: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Local batch -> global jax.Arrays whose leading axis is split by ``sharding``.

    ``sharding`` is a ``jax.sharding.NamedSharding`` over the batch axis (e.g.
    ``NamedSharding(mesh, P('data'))``); every process passes its own local batch. ``fields``
    limits the transfer to those keys (evaluation sends only the images and the mask: other
    numeric fields, such as a record's reference ids, may differ in shape between processes).
    """
    import jax

    arrays = device_fields(batch)
    if fields is not None:
        missing = [f for f in fields if f not in arrays]
        if missing:
            raise KeyError(f"batch has no device field(s) {missing}; it has {sorted(arrays)}")
        arrays = {f: arrays[f] for f in fields}
    return {
        k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
        for k, v in arrays.items()
    }
