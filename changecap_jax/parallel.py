"""Devices, meshes and hosts.

The trunk uses one mesh axis, ``data``: the global batch is split over every device of every
process. Batch-wide losses are computed inside ``jax.shard_map`` with explicit collectives
over this axis (see ``models/losses.py``), so N devices give the same loss and gradients as one.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from changecap_jax.errors import UserError

DATA_AXIS = "data"


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    cpu_collectives: str | None = None,
    heartbeat_timeout_s: int | None = None,
) -> None:
    """Calls ``jax.distributed.initialize`` (behind the ``--multihost`` flag of ``main``).

    With no arguments JAX reads the cluster from the environment (TPU pods, SLURM, ...).
    ``cpu_collectives='gloo'`` lets several CPU processes run collectives (used by tests).
    ``heartbeat_timeout_s``: how long a silent process counts as alive (JAX's default if None).
    """
    if cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    kwargs: dict = {}
    if heartbeat_timeout_s is not None:
        kwargs["heartbeat_timeout_seconds"] = heartbeat_timeout_s
    if coordinator_address:
        kwargs.update(coordinator_address=coordinator_address, num_processes=num_processes,
                      process_id=process_id)
    jax.distributed.initialize(**kwargs)
    if cpu_collectives:
        _open_cpu_collectives()
    logging.info(
        "process %d of %d; %d local / %d global devices",
        jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count(),
    )


def _open_cpu_collectives() -> None:
    """One collective over every device, now that all processes are here. gloo sets up its
    connections for a device set at the first collective over it and gives up when a process
    is 30 s late; the first train step comes after each process's own compile, which on a
    busy CPU can differ by more. Set up here, the connections are reused from then on."""
    sharding = batch_sharding(make_mesh())
    ones = jax.make_array_from_process_local_data(
        sharding, np.ones(jax.local_device_count(), np.float32))
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(sharding.mesh, PartitionSpec()))(ones)
    assert int(total) == jax.device_count()


def barrier(name: str, timeout_s: int = 3600) -> None:
    """Waits until every process gets here, through the coordination service (not a device
    collective: gloo's give up when a peer is 30 s late, e.g. still compiling on a busy host)."""
    if jax.process_count() == 1:
        return
    from jax._src import distributed  # the client jax.distributed.initialize started

    distributed.global_state.client.wait_at_barrier(name, timeout_in_ms=timeout_s * 1000)


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
