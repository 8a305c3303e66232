"""grain input pipelines over a dataset split, for one or many hosts.

Training (reference §2.5): an endless, seeded shuffle (a new order every epoch), each process
reading only its own share of the indices. Each example gives both of its pairs: (before,
semantic-after) with one change caption drawn uniformly and, where the dataset has
distractors, (before, distractor-after) with one no-change caption; with probability
``swap_prob`` the before and distractor-after images trade places, as the official loader's
augmentation does.

Evaluation: every example exactly once, in split order. The split is cut into global batches;
global batch k holds examples k*G .. k*G+G-1 (G the global batch size), process p reads its
slice of each, and positions past the end are padding with ``mask`` False.

Both are a grain ``MapDataset`` over batch numbers: element k is the whole local batch k,
read and stacked by one worker. Worker processes (:class:`ReadAhead`) therefore take whole
batches in turn and grain hands them back in order, so the batches are the same for any
number of workers, and the training iterator's checkpointed state is just the number of the
next batch (it can be restored with another worker count). The training order is the one of
the earlier ``grain.DataLoader`` with ``worker_count=0`` (an ``IndexSampler`` per process and
its per-record seeds), so its checkpoints resume exactly too.

:func:`to_global` turns one process's local batch into global ``jax.Array`` s sharded over
the mesh's data axis (``jax.make_array_from_process_local_data``). Feature grids keep their
stored dtype (float16 / bfloat16 datasets move half the bytes); the train step and the
decoding cast them to ``config.compute_dtype`` on the device (changecap_jax/models/precision.py).

Section numbers (§) and quirk ids (S-Q, D-Q, I-Q) refer to docs/official/ (see its README.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import grain
import jax
import numpy as np
from absl import flags

from changecap_jax.data.streams import BEFORE, STREAMS

# Fields that stay on the host (strings, reference lists); everything else goes to devices.
HOST_FIELDS = ("image_id", *(s.references for s in STREAMS.values()))
# The training iterator's checkpointed state. Version 2: one global order, each process reading
# its slice of every global batch, so a run resumes on any number of processes. Version 1 (one
# order per process) resumes where it had one process: the two orders then agree.
STATE_FORMAT = "changecap_jax.train_batches/2"
FORMAT_V1 = "changecap_jax.train_batches/1"
# Keys of the loader description a checkpointed state must match to be resumed.
ORDER_KEYS = ("records", "global_batch", "seed")


@dataclasses.dataclass(frozen=True)
class ReadAhead:
    """How a loader reads ahead of the consumer (``config.data``).

    ``workers``: grain worker processes, each assembling whole batches (0: in this process).
    ``threads``: reading threads in each process (0: read on demand, nothing ahead).
    ``prefetch``: batches buffered ahead, by the reading threads of each process and again
    in each worker's output queue. Host memory holds up to about ``2 * prefetch + threads``
    local batches per worker (``prefetch + threads`` without workers).
    """

    workers: int = 0
    # Two: reading is mostly array_record's decompression, which releases the GIL, so a
    # second thread gives a process 1.6-2x the rate (docs/input_pipeline.md).
    threads: int = 2
    prefetch: int = 2

    def __post_init__(self) -> None:
        for key in ("workers", "threads", "prefetch"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"config.data.{key} must be an integer >= 0, got {value!r}")


# device_prefetch: read by the trainer (trainers/device_prefetch.py), not by the loaders.
DATA_KEYS = ("workers", "eval_workers", "threads", "prefetch", "device_prefetch")


def read_ahead(data: Mapping[str, Any] | None, *, training: bool) -> ReadAhead:
    """The :class:`ReadAhead` of ``config.data`` (``workers`` for training, ``eval_workers``
    for evaluation); a missing block (configs saved before it existed) reads in-process."""
    data = dict(data or {})
    unknown = sorted(set(data) - set(DATA_KEYS))
    if unknown:
        raise ValueError(f"config.data has unknown key(s) {unknown}; known: {list(DATA_KEYS)}")
    return ReadAhead(workers=data.get("workers" if training else "eval_workers", 0),
                     threads=data.get("threads", ReadAhead.threads),
                     prefetch=data.get("prefetch", ReadAhead.prefetch))


def _stream(batches: grain.MapDataset, read: ReadAhead) -> grain.DatasetIterator:
    """Iterates a MapDataset of batches with read-ahead threads and worker processes."""
    ds = batches.to_iter_dataset(grain.ReadOptions(num_threads=read.threads,
                                                   prefetch_buffer_size=read.prefetch))
    if read.workers:
        if not flags.FLAGS.is_parsed():
            # grain's workers read its absl flags; outside an absl app (tests, notebooks,
            # scripts) they keep their defaults.
            flags.FLAGS.mark_as_parsed()
        # Worker i reads elements i, i + W, ...; grain interleaves them back in order.
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(
            num_workers=read.workers, per_worker_buffer_size=max(1, read.prefetch)))
    return iter(ds)


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

    def draws(self, num_captions: int, num_no_change: int | None,
              rng: np.random.Generator) -> tuple[int, bool, int]:
        """(semantic caption, swapped, no-change caption) of one record; ``num_no_change``
        None: the record has no distractor (no swap, no second caption drawn). The on-device
        dataset (trainers/on_device_data.py) draws with this too, so both paths pick the same."""
        # The rng draws stay in this order (semantic caption, swap, distractor caption): a
        # seed gives the batches it always gave.
        caption = int(rng.integers(num_captions))
        if num_no_change is None:
            return caption, False, 0
        swapped = bool(rng.random() < self.swap_prob)
        return caption, swapped, int(rng.integers(num_no_change))

    def random_map(self, record: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        semantic, distractor = STREAMS["semantic"], STREAMS["distractor"]
        captions = record[semantic.record_captions]
        has_distractor = distractor.after in record
        no_change = record[distractor.record_captions] if has_distractor else None
        caption, swapped, no_change_caption = self.draws(
            len(captions), len(no_change) if no_change is not None else None, rng)
        out = {
            "id": np.int32(record["id"]),
            "change_type": np.int32(record["change_type"]),
            BEFORE: record[BEFORE],
            semantic.after: record[semantic.after],
            semantic.caption: captions[caption],
        }
        out.update({f"{f}_semantic": record[f"{f}_semantic"] for f in self.pair_fields})
        if no_change is not None:
            before, after = record[BEFORE], record[distractor.after]
            if swapped:
                before, after = after, before
            out.update({BEFORE: before, distractor.after: after,
                        distractor.caption: no_change[no_change_caption]})
            orientation = "distractor_swapped" if swapped else "distractor"
            out.update({f"{f}_distractor": record[f"{f}_{orientation}"]
                        for f in self.pair_fields})
        return out


def _stack_records(records: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    # Every training field has one shape across records (np.stack, as grain's Batch).
    return {key: np.stack([r[key] for r in records]) for key in records[0]}


class _TrainBatch(grain.transforms.Map):
    """Batch number k -> this process's local training batch k: its slice of global batch k.

    Global batch k holds the sampler's indices ``k * global_batch ...`` (one permutation of the
    records per epoch, the same for any number of processes); process p reads the p-th
    ``local_batch`` of them, each with that index's record and generator. One process reads
    what ``grain.DataLoader`` (no workers) read.
    """

    def __init__(self, source: Any, sampler: grain.samplers.IndexSampler, local_batch: int,
                 process_index: int, process_count: int, pairs: TrainPairs):
        self.source, self.sampler, self.local_batch = source, sampler, local_batch
        self.process_index, self.process_count, self.pairs = process_index, process_count, pairs

    def map(self, k: int) -> dict[str, np.ndarray]:
        global_batch = self.local_batch * self.process_count
        first = int(k) * global_batch + self.process_index * self.local_batch
        records = []
        for i in range(first, first + self.local_batch):
            meta = self.sampler[i]
            records.append(self.pairs.random_map(self.source[meta.record_key], meta.rng))
        return _stack_records(records)


class TrainLoader:
    """An endless loader of one process's local training batches; ``iter`` gives a
    :class:`TrainIterator` from the first batch."""

    def __init__(self, batch: _TrainBatch, read: ReadAhead, description: dict[str, Any]):
        self.batch, self.read, self.description = batch, read, description

    def __iter__(self) -> TrainIterator:
        return TrainIterator(self)

    def batches_from(self, start: int) -> grain.DatasetIterator:
        return _stream(grain.MapDataset.range(start, sys.maxsize).map(self.batch), self.read)

    def next_batch_of(self, state: dict[str, Any]) -> int:
        """The batch a checkpointed state resumes at; errors when it is another run's."""
        if "last_seen_indices" in state:  # written by grain.DataLoader before this loader
            return self._next_batch_of_dataloader(state)
        if state.get("format") == FORMAT_V1 and state.get("process_count") == 1:
            state = {**state, "format": STATE_FORMAT, "global_batch": state.get("local_batch")}
        elif state.get("format") == FORMAT_V1:
            raise ValueError(
                "the checkpoint's data iterator read one data order per process (an older "
                f"version, {state.get('process_count')} processes), which this version does not "
                "reproduce; resume with that version, or train in a fresh workdir")
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"data iterator state has format {state.get('format')!r}, "
                             f"expected {STATE_FORMAT!r}")
        differs = {k: (state.get(k), self.description[k]) for k in ORDER_KEYS
                   if state.get(k) != self.description[k]}
        if differs:
            raise ValueError(
                "the checkpoint's data iterator belongs to another data order: "
                + ", ".join(f"{k} was {a!r}, is {b!r}" for k, (a, b) in differs.items())
                + "; resume with the same dataset, global batch size and seed, or "
                "train in a fresh workdir")
        return int(state["next_batch"])

    def _next_batch_of_dataloader(self, state: dict[str, Any]) -> int:
        if state.get("sampler") != repr(self.batch.sampler):
            raise ValueError(f"the checkpoint's data iterator (grain.DataLoader) used "
                             f"{state.get('sampler')}, this run {self.batch.sampler!r}")
        if state.get("worker_count") != 0:
            raise ValueError(
                f"the checkpoint's data iterator was a grain.DataLoader with "
                f"worker_count={state.get('worker_count')}, whose batches this loader does not "
                "reproduce; only worker_count=0 states can be resumed")
        if self.batch.process_count != 1:
            raise ValueError("the checkpoint's data iterator is a grain.DataLoader's, whose "
                             "order this loader reproduces on one process only")
        records = int(state["last_seen_indices"]["0"]) + 1
        if records % self.batch.local_batch:
            raise ValueError(f"the checkpoint's data iterator stopped after {records} records, "
                             f"not a multiple of the local batch {self.batch.local_batch}")
        return records // self.batch.local_batch


class TrainIterator(Iterator[dict[str, np.ndarray]]):
    """The training iterator; ``grain.checkpoint.CheckpointSave`` / ``CheckpointRestore`` save
    and restore it (``get_state`` -> JSON bytes, ``set_state``, ``start_prefetch``)."""

    def __init__(self, loader: TrainLoader):
        self._loader, self._next = loader, 0
        self._batches: grain.DatasetIterator | None = None

    def __iter__(self) -> TrainIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        self.start_prefetch()
        batch = next(self._batches)
        self._next += 1
        return batch

    def start_prefetch(self) -> None:
        """Starts the readers (and workers) at the next batch; the first ``next`` does too."""
        if self._batches is None:
            self._batches = self._loader.batches_from(self._next)

    def get_state(self) -> bytes:
        return json.dumps({"format": STATE_FORMAT, "next_batch": self._next,
                           **self._loader.description}).encode()

    def set_state(self, state: bytes | str) -> None:
        self._next = self._loader.next_batch_of(json.loads(state))
        self.close()  # batches read ahead from the old position are dropped

    def close(self) -> None:
        """Stops the reading threads and worker processes (``next`` restarts them)."""
        if self._batches is not None:
            self._batches.close()
            self._batches = None

    def __del__(self) -> None:
        self.close()


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
    read: ReadAhead | None = None,
) -> TrainLoader:
    """An endless loader of this process's local training batches. ``read`` sets workers,
    threads and prefetch (default: ``ReadAhead`` with ``worker_count`` workers)."""
    local_batch = _check_batch(global_batch_size, process_count)
    if len(source) < global_batch_size:
        raise ValueError(
            f"the split has {len(source)} examples, fewer than the global batch size "
            f"{global_batch_size}"
        )
    sampler = grain.samplers.IndexSampler(
        num_records=len(source),
        # One global order for any number of processes: _TrainBatch slices its batches.
        shard_options=grain.sharding.ShardOptions(shard_index=0, shard_count=1,
                                                  drop_remainder=True),
        shuffle=True,
        num_epochs=None,
        seed=seed,
    )
    batch = _TrainBatch(source, sampler, local_batch, process_index, process_count,
                        TrainPairs(swap_prob, pair_fields))
    description = {"records": len(source), "global_batch": global_batch_size,
                   "local_batch": local_batch, "seed": seed, "process_index": process_index,
                   "process_count": process_count}
    return TrainLoader(batch, read or ReadAhead(workers=worker_count), description)


class _EvalBatch(grain.transforms.Map):
    """Batch number k -> this process's slice of global eval batch k, padded and masked."""

    def __init__(self, source: Any, global_batch: int, local_batch: int, process_index: int):
        self.source, self.global_batch = source, global_batch
        self.local_batch, self.process_index = local_batch, process_index

    def map(self, k: int) -> dict[str, np.ndarray]:
        start = int(k) * self.global_batch + self.process_index * self.local_batch
        n = len(self.source)
        items = [_masked_record(self.source, i, n) for i in range(start, start + self.local_batch)]
        return {key: _stack([it[key] for it in items]) for key in items[0]}


def eval_batches(
    source: Any,
    *,
    global_batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
    read: ReadAhead | None = None,
) -> Iterator[dict[str, Any]]:
    """This process's local eval batches; every process yields the same number of batches.

    Each batch holds the record fields (host fields as object arrays) plus ``mask`` (bool):
    False marks padding, which repeats a real record so shapes stay fixed. ``read``: workers,
    threads and prefetch (default: ``ReadAhead()``, reading threads in this process).
    """
    local_batch = _check_batch(global_batch_size, process_count)
    num_batches = num_eval_batches(len(source), global_batch_size)
    batches = grain.MapDataset.range(num_batches).map(
        _EvalBatch(source, global_batch_size, local_batch, process_index))
    stream = _stream(batches, read or ReadAhead())
    try:
        yield from stream
    finally:  # also when the caller stops early: the readers and workers end here
        stream.close()


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
