"""Published TPU chip figures and slice names, for ``python -m changecap_jax aot``.

Each chip's HBM capacity, HBM bandwidth, bf16 peak and inter-chip interconnect (ICI)
bandwidth are the figures of its Google Cloud TPU documentation page (``Chip.source``):
bandwidths in GB/s (10^9 bytes), capacities in GiB (the pages write "GB" for some: the
memories are powers of two, 16 GiB on a v5e). The pages have changed over time; the figures
below are those of the copies read on 2026-11-29, and where a page has shown two figures both
are noted. A program gets a little less: ``hbm_available`` is what libtpu's compiler
(0.0.42.1) says is available per chip when it refuses a program that does not fit ("exceeds
available HBM (15.75G)" on v5e, in GiB), measured by compiling an oversized program for each
chip; the fit checks use it. The pages publish no float32 peak: under JAX's default matmul
precision a float32 matmul on a TPU runs as one bf16 pass, so the bf16 peak bounds both.

ICI: the pages give a chip's bidirectional ICI bandwidth (v5e 400 GB/s, v5p 1200, v6e 800);
a chip sends at half of it while it receives at the other half, so the all-reduce term
(``tools/interconnect.py``) takes half. The v4 page gives no per-chip figure, only the Pod's
all-reduce bandwidth (1.1 PB/s over 4096 chips); that quotient is the one-direction figure
for the others too (v5e: 51.2 TB/s / 256 = 200 GB/s, v6e: 102.4 TB/s / 256 = 400 GB/s), so
v4's is 1.1e15 / 4096 = 268.6 GB/s.

A slice is named as libtpu spells its topology (``v5e:2x2``, ``v4:2x2x1``, ``v5p:2x2x2``,
``v6e:4x4``), or by its Cloud accelerator type (``v5litepod-8``, ``v4-8``, ``v5p-16``,
``v6e-8``): see :func:`resolve_topology`. Nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
import math
import re

from changecap_jax.commands.interconnect import Interconnect
from changecap_jax.errors import UserError

GB, GIB = 10**9, 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU chip generation's published figures (module docstring)."""

    name: str  # as libtpu's topology names spell it: v4, v5e, v5p, v6e
    device_kind: str  # as JAX reports the devices of its topology
    hbm_bytes: int  # published capacity
    hbm_available: int  # what the compiler lets a program use (module docstring)
    hbm_bytes_per_s: float
    bf16_flop_per_s: float
    source: str  # the page the three figures come from
    cores_per_chip: int  # TensorCores; v4 and v5p run both as one JAX device ("megacore")
    # float32 matmuls' peak where it differs (a GPU's TF32); a TPU's is its bf16 peak
    f32_flop_per_s: float | None = None
    # one direction per chip (module docstring): ICI, a GPU's NVLink
    link_bytes_per_s: float = 0.0
    link: str = "ICI"

    def peak_flop_per_s(self, compute_dtype: str) -> float:
        """The matmul peak that bounds a program computing in ``compute_dtype``."""
        if compute_dtype == "float32" and self.f32_flop_per_s:
            return self.f32_flop_per_s
        return self.bf16_flop_per_s


CHIPS: dict[str, Chip] = {c.name: c for c in (
    # "32 GiB, 1200 GBps", "275 teraflops (bf16 or int8)", "All-reduce bandwidth per Pod
    # 1.1 PB/s" of 4096 chips
    Chip("v4", "TPU v4", 32 * GIB, int(30.75 * GIB), 1200 * GB, 275e12,
         "https://cloud.google.com/tpu/docs/v4", 2, link_bytes_per_s=1.1e15 / 4096),
    # "16 GB, 819 GBps" (another version of the page: "800 GiBps", 859 GB/s), "197 TFLOPs"
    # (bf16), "Bidirectional ... ICI bandwidth (per chip) 400 GBps" (older: "1600 Gbps")
    Chip("v5e", "TPU v5 lite", 16 * GIB, int(15.75 * GIB), 819 * GB, 197e12,
         "https://cloud.google.com/tpu/docs/v5e", 1, link_bytes_per_s=200 * GB),
    # "95 GB, 2765 GBps" (another version: "HBM capacity per chip (GiB) 95"), "459 TFLOPs"
    # (bf16), ICI "1200 GBps" bidirectional (older: "4800 Gbps"). The compiler lets a program
    # use 95.74 GiB, more than 95 GiB (or GB), so the page's figure is rounded down: the
    # capacity is taken as 96 GiB, the least whole number of GiB that holds what the
    # compiler offers, not a published figure.
    Chip("v5p", "TPU v5", 96 * GIB, int(95.74 * GIB), 2765 * GB, 459e12,
         "https://cloud.google.com/tpu/docs/v5p", 2, link_bytes_per_s=600 * GB),
    # "32 GB", "1638 GBps" (another version of the page: "1640 GBps"),
    # "918 TFLOPs" (bf16), "Bidirectional ... ICI bandwidth (per chip) 800 GBps", "Chips per
    # host 8"
    Chip("v6e", "TPU v6 lite", 32 * GIB, int(31.25 * GIB), 1638 * GB, 918e12,
         "https://cloud.google.com/tpu/docs/v6e", 1, link_bytes_per_s=400 * GB),
)}

# Slice shapes by chip count. v5e and v6e slices are 2-D; v4 and v5p 3-D (their Cloud names
# count TensorCores, two per chip).
SHAPES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
             256: "16x16"}
SHAPES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
             256: "4x8x8"}
CLOUD_PREFIXES = {"v4": "v4", "v5p": "v5p", "v5e": "v5e", "v5litepod": "v5e", "v6e": "v6e"}
# The Cloud hosts of the 2-D chips' slices of 8 chips and more: 8 chips each (the v5e page's
# table: 2x4 on 1 host, 4x4 on 2, 4x8 on 4; the v6e page: "Chips per host 8"); libtpu's
# default layout gives a 2x4 slice two hosts of 4 chips.
EIGHT_CHIP_HOST = (2, 4, 1)


class TopologyError(UserError, ValueError):
    """A topology name this command does not know."""


@dataclasses.dataclass(frozen=True)
class Topology:
    """A slice to compile for: libtpu's name and the options of ``get_topology_desc``; or a
    group of GPUs (``gpu_specs``)."""

    name: str  # libtpu's topology name, e.g. "v5e:2x4"; GPUs: "h100:8"
    chip: Chip
    chips: int
    options: dict  # chip_config_name, chips_per_host_bounds; a GPU's target_config, topology
    alias: str = ""  # the Cloud accelerator type it was given as, if any
    platform: str = "tpu"  # get_topology_desc's: tpu, cuda
    # GPUs: the hosts and the network between them (per host, one direction); a TPU slice's
    # ICI joins its hosts' chips directly, so its all-reduce never leaves the ICI.
    hosts: int = 1
    network_bytes_per_s: float | None = None
    network: str = ""

    def fabric(self) -> Interconnect:
        """How this slice's (these GPUs') devices all-reduce (``tools/interconnect.py``)."""
        return Interconnect(self.chips // self.hosts, self.hosts, self.chip.link_bytes_per_s,
                            self.chip.link, self.network_bytes_per_s, self.network)

    @property
    def label(self) -> str:
        return f"{self.alias} ({self.name})" if self.alias else self.name


def known_names() -> str:
    """Examples of accepted names, for error messages."""
    return ("libtpu topologies such as v5e:2x2, v5e:4x4, v4:2x2x1, v5p:2x2x2, v6e:2x4, Cloud "
            "accelerator types such as v5litepod-8, v4-8, v5p-16, v6e-8, or GPUs such as "
            "h100:8, h100:2x8 (tools/gpu_specs.py)")


def _chip_count(shape: str) -> int:
    return math.prod(int(d) for d in shape.split("x"))


def resolve_topology(name: str) -> Topology:
    """The slice ``name`` names: a libtpu topology (``v5e:4x4``) or a Cloud accelerator type
    (``v5litepod-16``; ``v5e-16`` is read the same). v4 is compiled as one device per chip
    (libtpu's "megacore" chip config, as Cloud TPU VMs run it); v5p is that by default."""
    name = name.strip()
    libtpu = re.fullmatch(r"(v4|v5e|v5p|v6e):(\d+(?:x\d+){1,2})", name)
    if libtpu:
        chip, shape = CHIPS[libtpu.group(1)], libtpu.group(2)
        want = 3 if chip.cores_per_chip == 2 else 2
        if shape.count("x") + 1 != want:
            raise TopologyError(f"topology {name!r}: {chip.name} slices are {want}-D "
                                f"(e.g. {chip.name}:{'2x2x1' if want == 3 else '2x2'})")
        return Topology(name, chip, _chip_count(shape), _chip_options(chip))
    cloud = re.fullmatch(r"(v4|v5p|v5e|v5litepod|v6e)-(\d+)", name)
    if cloud:
        chip = CHIPS[CLOUD_PREFIXES[cloud.group(1)]]
        chips = int(cloud.group(2)) // chip.cores_per_chip
        shapes = SHAPES_3D if chip.cores_per_chip == 2 else SHAPES_2D
        if chips not in shapes:
            raise TopologyError(f"accelerator type {name!r}: no {chip.name} slice of "
                                f"{chips} chips known here (known: {sorted(shapes)} chips)")
        options = _chip_options(chip)
        if chip.cores_per_chip == 1 and chips >= 8:
            options["chips_per_host_bounds"] = EIGHT_CHIP_HOST
        return Topology(f"{chip.name}:{shapes[chips]}", chip, chips, options, alias=name)
    raise TopologyError(f"unknown topology {name!r}; use {known_names()}")


def _chip_options(chip: Chip) -> dict:
    # One JAX device per chip: libtpu's default for v4 is one per TensorCore.
    return {"chip_config_name": "megacore"} if chip.cores_per_chip == 2 else {}
