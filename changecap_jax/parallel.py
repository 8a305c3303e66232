"""Devices, meshes and hosts.

The trunk uses one mesh axis, ``data``: the global batch is split over every device of every
process. Batch-wide losses are computed inside ``jax.shard_map`` with explicit collectives
over this axis (see ``models/losses.py``), so N devices give the same loss and gradients as one.
"""

from __future__ import annotations

import logging

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from changecap_jax.errors import UserError

DATA_AXIS = "data"


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    cpu_collectives: str | None = None,
) -> None:
    """Calls ``jax.distributed.initialize`` (behind the ``--multihost`` flag of ``main``).

    With no arguments JAX reads the cluster from the environment (TPU pods, SLURM, ...).
    ``cpu_collectives='gloo'`` lets several CPU processes run collectives (used by tests).
    """
    if cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    kwargs = {}
    if coordinator_address:
        kwargs = dict(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
        )
    jax.distributed.initialize(**kwargs)
    logging.info(
        "process %d of %d; %d local / %d global devices",
        jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count(),
    )


def make_mesh(num_devices: int | None = None) -> Mesh:
    """A 1-D ``data`` mesh over all devices (or the first ``num_devices``)."""
    devices = jax.devices()
    if num_devices is not None:
        if num_devices > len(devices):
            raise ValueError(f"asked for {num_devices} devices, only {len(devices)} exist")
        devices = devices[:num_devices]
    return Mesh(np.asarray(devices), (DATA_AXIS,))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis split over ``data``."""
    return NamedSharding(mesh, PartitionSpec(DATA_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


class BatchSizeError(UserError, ValueError):
    """A global batch size that is not a positive multiple of the device count."""


def check_global_batch(global_batch_size: int, mesh: Mesh, name: str = "batch_size") -> None:
    """Raises :class:`BatchSizeError` unless ``global_batch_size`` (the config field ``name``)
    is a positive multiple of the mesh's device count."""
    n = mesh.devices.size
    if global_batch_size <= 0 or global_batch_size % n:
        raise BatchSizeError(f"config.{name} is {global_batch_size}: it must be a positive "
                             f"multiple of the number of devices, {n}")
