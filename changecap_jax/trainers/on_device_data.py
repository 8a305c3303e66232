"""The training split held on the devices (``config.dataset.on_device``): the loader's order
(data/pipeline.py) on the mesh, so it sits with the trainers, above ``parallel``.

Every record's training arrays (feature grids, all its caption ids, id, change type, per-pair
side inputs) are put on the devices once, split over the mesh's ``data`` axis: device d holds
records ``d * per .. d * per + per - 1`` (the split padded with zero records to a multiple of
the device count). Each step the host computes, for global batch k, the record of every
position and its draws (caption, swap, no-change caption) with the loader's own sampler and
``TrainPairs.draws``, and passes only those int32 vectors; :func:`gather_batch` builds the
batch inside the jitted step. The batches, hence the losses, are the streaming loader's.

The iterator's checkpointed state is the loader's (``pipeline.TrainIterator``), so a run can
resume with the other path. Bytes per device: ``ceil(records / devices)`` times one record's
arrays (:func:`record_bytes`); :func:`check_fits` refuses a split that does not fit.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from changecap_jax import parallel
from changecap_jax.data import pipeline
from changecap_jax.data.streams import BEFORE, STREAMS
from changecap_jax.errors import UserError

# A bound on the dataset's bytes per device, for devices that report no memory limit (CPU) or
# to keep room below the reported one.
BOUND_ENV = "CHANGECAP_ON_DEVICE_BYTES"
SEMANTIC, DISTRACTOR = STREAMS["semantic"], STREAMS["distractor"]
CHOICES = ("record", "caption", "swap", "no_change")  # per position of a global batch


class DoesNotFitError(UserError, ValueError):
    """The training split needs more device memory than a device has."""


def record_arrays(record: dict[str, Any], pair_fields: tuple[str, ...]) -> dict[str, Any]:
    """The arrays of one record that live on the devices (captions: all of them)."""
    out = {"id": np.int32(record["id"]), "change_type": np.int32(record["change_type"]),
           BEFORE: record[BEFORE], SEMANTIC.after: record[SEMANTIC.after],
           SEMANTIC.record_captions: np.asarray(record[SEMANTIC.record_captions], np.int32)}
    out.update({f"{f}_semantic": record[f"{f}_semantic"] for f in pair_fields})
    if DISTRACTOR.after in record:
        out[DISTRACTOR.after] = record[DISTRACTOR.after]
        out[DISTRACTOR.record_captions] = np.asarray(record[DISTRACTOR.record_captions],
                                                     np.int32)
        for f in pair_fields:
            out[f"{f}_distractor"] = record[f"{f}_distractor"]
            out[f"{f}_distractor_swapped"] = record[f"{f}_distractor_swapped"]
    return {k: np.asarray(v) for k, v in out.items()}


def record_bytes(record: dict[str, Any], pair_fields: tuple[str, ...] = ()) -> int:
    """Bytes one record takes on the devices (captions as stored: its K x L ids)."""
    return sum(v.nbytes for v in record_arrays(record, pair_fields).values())


def bytes_per_device(records: int, per_record: int, devices: int) -> int:
    """``ceil(records / devices) * per_record``: each device holds its share, padded."""
    return math.ceil(records / devices) * per_record


def available_bytes(device: Any) -> int | None:
    """Bytes free on ``device`` for the dataset: ``$CHANGECAP_ON_DEVICE_BYTES`` if set, else
    its ``memory_stats()`` limit less what is in use; None where neither exists (CPU)."""
    bound = os.environ.get(BOUND_ENV)
    if bound:
        return int(float(bound))
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def check_fits(records: int, per_record: int, mesh: Mesh) -> int:
    """The dataset's bytes per device; raises :class:`DoesNotFitError` (one line) when it is
    more than a local device has free. Unchecked where no bound is known."""
    need = bytes_per_device(records, per_record, mesh.devices.size)
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    free = [b for b in (available_bytes(d) for d in local) if b is not None]
    if free and need > min(free):
        raise DoesNotFitError(
            f"config.dataset.on_device: the training split needs {need:,} bytes per device "
            f"({records} records x {per_record:,} bytes / {mesh.devices.size} devices), "
            f"{min(free):,} available; set --config.dataset.on_device=False")
    return need


class ResidentSplit:
    """The training split on the devices, with the host's record counts for the draws."""

    def __init__(self, source: Any, mesh: Mesh, pair_fields: tuple[str, ...] = ()):
        self.mesh, self.pair_fields = mesh, tuple(pair_fields)
        self.records = len(source)
        devices = mesh.devices.size
        self.per_device = math.ceil(self.records / devices)
        sharding = parallel.batch_sharding(mesh)
        first = record_arrays(source[0], self.pair_fields)
        self.has_distractor = DISTRACTOR.after in first
        self.bytes_per_device = check_fits(self.records, _bytes(first), mesh)
        # This process reads only its own devices' records.
        local = self._read_local(source, sharding)
        counts = self._caption_counts(local, sharding)
        self.num_captions, self.num_no_change = counts[:, 0], counts[:, 1]
        widest = {SEMANTIC.record_captions: int(counts[:, 0].max()),
                  DISTRACTOR.record_captions: int(counts[:, 1].max())}
        self.arrays = {k: self._put(local, k, v, widest.get(k), sharding)
                       for k, v in first.items()}

    def _read_local(self, source: Any, sharding: NamedSharding) -> dict[int, dict[str, Any]]:
        shape = (self.per_device * self.mesh.devices.size,)
        starts = {idx[0].start or 0 for idx in
                  sharding.addressable_devices_indices_map(shape).values()}
        out = {}
        for start in sorted(starts):
            for i in range(start, min(start + self.per_device, self.records)):
                out[i] = record_arrays(source[i], self.pair_fields)
        return out

    def _caption_counts(self, local: dict[int, dict[str, Any]],
                        sharding: NamedSharding) -> np.ndarray:
        """(records, 2) caption counts of every record, on every process (the host draws
        need them for any record; each process read only its own)."""
        n = self.per_device * self.mesh.devices.size

        def counts(index: tuple[slice, ...]) -> np.ndarray:
            rows = range(*index[0].indices(n))
            out = np.zeros((len(rows), 2), np.int32)
            for j, i in enumerate(rows):
                if i in local:
                    out[j, 0] = len(local[i][SEMANTIC.record_captions])
                    if self.has_distractor:
                        out[j, 1] = len(local[i][DISTRACTOR.record_captions])
            return out

        array = jax.make_array_from_callback((n, 2), sharding, counts)
        return np.asarray(multihost_utils.process_allgather(array, tiled=True))[:self.records]

    def _put(self, local: dict[int, dict[str, Any]], key: str, like: np.ndarray,
             widest: int | None, sharding: NamedSharding) -> jax.Array:
        row_shape = (widest, *like.shape[1:]) if widest is not None else like.shape
        n = self.per_device * self.mesh.devices.size

        def rows(index: tuple[slice, ...]) -> np.ndarray:
            span = range(*index[0].indices(n))
            out = np.zeros((len(span), *row_shape), like.dtype)  # padding: zero records
            for j, i in enumerate(span):
                if i in local:
                    value = local[i][key]
                    if widest is None:
                        out[j] = value
                    else:  # fewer captions than the widest record: zero rows, never drawn
                        out[j, :len(value)] = value
            return out

        return jax.make_array_from_callback((n, *row_shape), sharding, rows)

    def choices(self, loader: pipeline.TrainLoader, k: int) -> dict[str, np.ndarray]:
        """Global batch ``k``'s records and draws, as the loader makes them (every process
        computes the whole global batch: a few microseconds per example)."""
        batch = loader.batch
        global_batch = batch.local_batch * batch.process_count
        out = {c: np.zeros(global_batch, np.int32) for c in CHOICES}
        for j, i in enumerate(range(k * global_batch, (k + 1) * global_batch)):
            meta = batch.sampler[i]
            r = int(meta.record_key)
            caption, swapped, no_change = batch.pairs.draws(
                int(self.num_captions[r]),
                int(self.num_no_change[r]) if self.has_distractor else None, meta.rng)
            out["record"][j], out["caption"][j] = r, caption
            out["swap"][j], out["no_change"][j] = swapped, no_change
        return out

    def to_global(self, choices: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """The choices as replicated global arrays (every process passes the same)."""
        replicated = parallel.replicated(self.mesh)
        return {k: jax.make_array_from_process_local_data(replicated, v)
                for k, v in choices.items()}


def _bytes(arrays: dict[str, np.ndarray]) -> int:
    return sum(v.nbytes for v in arrays.values())


def gather_batch(arrays: dict[str, jax.Array], choices: dict[str, jax.Array], mesh: Mesh,
                 pair_fields: tuple[str, ...] = ()) -> dict[str, jax.Array]:
    """The global training batch of ``choices`` from the resident ``arrays`` (inside jit).

    Each device gathers the positions whose records it holds (zeros elsewhere) and a
    reduce-scatter over ``data`` sums them into each device's share of the batch: a sum with
    one non-zero term, so every value arrives exactly.
    """
    axis = parallel.DATA_AXIS
    devices = mesh.devices.size

    def per_device(local: dict[str, jax.Array], chosen: dict[str, jax.Array]) -> dict:
        per = next(iter(local.values())).shape[0]
        rows = chosen["record"] - jax.lax.axis_index(axis) * per
        held = (rows >= 0) & (rows < per)
        rows = jnp.clip(rows, 0, per - 1)
        share = chosen["record"].shape[0] // devices
        mine = {k: jax.lax.dynamic_slice_in_dim(v, jax.lax.axis_index(axis) * share, share)
                for k, v in chosen.items()}

        def take(x: jax.Array) -> jax.Array:
            picked = x[rows]
            mask = held.reshape(held.shape + (1,) * (picked.ndim - 1))
            return jax.lax.psum_scatter(jnp.where(mask, picked, jnp.zeros_like(picked)), axis,
                                        scatter_dimension=0, tiled=True)

        got = {k: take(v) for k, v in local.items()}
        at = jnp.arange(share)
        out = {"id": got["id"], "change_type": got["change_type"], BEFORE: got[BEFORE],
               SEMANTIC.after: got[SEMANTIC.after],
               SEMANTIC.caption: got[SEMANTIC.record_captions][at, mine["caption"]]}
        out.update({f"{f}_semantic": got[f"{f}_semantic"] for f in pair_fields})
        if DISTRACTOR.after in got:
            swap = mine["swap"].astype(bool)

            def pick(a: jax.Array, b: jax.Array) -> jax.Array:  # b where swapped
                return jnp.where(swap.reshape(swap.shape + (1,) * (a.ndim - 1)), b, a)

            out[BEFORE] = pick(got[BEFORE], got[DISTRACTOR.after])
            out[DISTRACTOR.after] = pick(got[DISTRACTOR.after], got[BEFORE])
            out[DISTRACTOR.caption] = got[DISTRACTOR.record_captions][at, mine["no_change"]]
            out.update({f"{f}_distractor": pick(got[f"{f}_distractor"],
                                                got[f"{f}_distractor_swapped"])
                        for f in pair_fields})
        return out

    return jax.shard_map(per_device, mesh=mesh, in_specs=(P(axis), P()), out_specs=P(axis),
                         check_vma=False)(arrays, choices)


def make_resident_step(train_step: Any, split: ResidentSplit) -> Any:
    """The jitted (state, resident arrays, choices) -> (state, metrics): the batch gathered,
    then ``train_step`` (inlined into this one program)."""

    def step(state: Any, arrays: dict, choices: dict) -> Any:
        return train_step(state, gather_batch(arrays, choices, split.mesh, split.pair_fields))

    # Shardings pinned as the streaming step's: an inferred output sharding can differ from
    # the first state's and compile the step again at step 2, which on several hosts some
    # reach long after others (gloo gives up on a collective after 30 s).
    repl, data = parallel.replicated(split.mesh), parallel.batch_sharding(split.mesh)
    return jax.jit(step, donate_argnums=0, in_shardings=(repl, data, repl),
                   out_shardings=(repl, repl))


class ResidentIterator(Iterator[dict[str, np.ndarray]]):
    """Global batch k's choices, k = 0, 1, ...; its state is ``pipeline.TrainIterator``'s
    (the same JSON), so a checkpoint resumes in the same order on either path."""

    def __init__(self, loader: pipeline.TrainLoader, split: ResidentSplit):
        self._loader, self._split, self._next = loader, split, 0

    def __iter__(self) -> ResidentIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        choices = self._split.choices(self._loader, self._next)
        self._next += 1
        return choices

    def get_state(self) -> bytes:
        return json.dumps({"format": pipeline.STATE_FORMAT, "next_batch": self._next,
                           **self._loader.description}).encode()

    def set_state(self, state: bytes | str) -> None:
        self._next = self._loader.next_batch_of(json.loads(state))

    def start_prefetch(self) -> None:
        """Nothing reads ahead here (``grain.checkpoint`` calls it after a restore)."""

    def close(self) -> None:
        """Nothing reads ahead here."""
