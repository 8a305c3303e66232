"""The gradient all-reduce of a data-parallel step, and a lower bound on its time.

Data parallelism keeps every parameter on every chip (GPU) and all-reduces the gradients once
a step: the float32 gradients, one copy of every parameter's size. A bandwidth-optimal (ring)
all-reduce over ``n`` devices has each device send, and receive, ``2 (n - 1) / n`` times the
payload: a reduce-scatter then an all-gather, each moving ``(n - 1) / n`` of it.

Over a TPU slice every chip sits on the slice's inter-chip interconnect (ICI), hosts
included, so the ring is over all its chips at the chip's ICI bandwidth. GPUs reach each
other over NVLink inside a host and over the network between hosts: the hierarchical form
(what NCCL's tree and ring algorithms come to) reduce-scatters within each host over NVLink,
all-reduces each GPU's ``1 / g`` share across the ``h`` hosts over the network (each host
sends ``2 (h - 1) / h`` of the whole payload through its NICs), and all-gathers within the
host again.

Bandwidths are one direction's (a device sends and receives at once): half of the
bidirectional per-chip figures vendors publish (tpu_specs.py, gpu_specs.py). Each phase at
its link's peak, with the phases overlapped, is the time's lower bound: ``max`` of the
intra-host and the inter-host term, like the roofline's other terms a bound and not an
estimate of the step (docs/accelerators.md). Nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Interconnect:
    """How a group of devices all-reduces: ``hosts`` groups of ``devices_per_host``, one fast
    fabric within a group (a TPU slice's ICI spans its hosts: one group), a network between."""

    devices_per_host: int
    hosts: int
    link_bytes_per_s: float  # per device, one direction: ICI, NVLink
    link: str  # its name, for the report: "ICI", "NVLink"
    network_bytes_per_s: float | None = None  # per host, one direction; None: one group
    network: str = ""  # e.g. "network (8 x 400 Gb/s per host, assumed)"

    @property
    def devices(self) -> int:
        return self.devices_per_host * self.hosts


def ring_bytes(payload: float, n: int) -> float:
    """Bytes each of ``n`` devices sends (and receives) in a ring all-reduce of ``payload``."""
    return 2.0 * (n - 1) / n * payload if n > 1 else 0.0


def allreduce(payload: float, fabric: Interconnect) -> dict[str, float | str | None]:
    """The all-reduce of ``payload`` bytes per device over ``fabric``: bytes each device sends
    within its host, bytes each host sends to the others, the two times and the bound (the
    larger; module docstring)."""
    intra_bytes = ring_bytes(payload, fabric.devices_per_host)
    intra_s = intra_bytes / fabric.link_bytes_per_s
    inter_bytes = ring_bytes(payload, fabric.hosts)
    if inter_bytes and not fabric.network_bytes_per_s:
        raise ValueError(f"{fabric.hosts} hosts but no network bandwidth between them")
    inter_s = inter_bytes / fabric.network_bytes_per_s if inter_bytes else 0.0
    return {"payload_bytes": payload, "intra_bytes": intra_bytes, "intra_s": intra_s,
            "inter_bytes": inter_bytes, "inter_s": inter_s,
            "seconds": max(intra_s, inter_s),
            "bound_by": fabric.network if inter_s > intra_s else fabric.link}
