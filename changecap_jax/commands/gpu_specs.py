"""Published NVIDIA GPU figures and GPU host names, for ``python -m changecap_jax aot``.

JAX's CUDA plugin (``jax-cuda13-plugin``) compiles for a described GPU with none present: its
PJRT topology takes a ``target_config`` (XLA's ``GpuTargetConfigProto``, text format: the
card's compute capability, SM count, shared memory, L2, clock, memory) and a ``topology``
("partitions x hosts x GPUs per host"), and makes compile-only devices of it.
:func:`target_config` writes that description from the figures below.

Each card's memory, memory bandwidth and dense (no sparsity) bf16 and TF32 tensor-core peaks
are the figures of its NVIDIA data-center page (``Card.source``; where a page gives only the
peak with sparsity, half of it; memory in "GB" that CUDA reports as about that many GiB).
float32 uses the TF32 peak: under JAX's default matmul precision a float32 matmul runs on TF32
tensor cores on these cards. The architecture figures (SMs, FP32 lanes, shared memory, L2) are
those of NVIDIA's A100 and H100 architecture whitepapers, the clock the SMs' maximum; the
per-block and per-thread limits those of compute capability 8.0 and 9.0 in the CUDA C++
programming guide.

NVLink: each card page's "NVIDIA NVLink" figure (A100 600 GB/s, H100 and H200 900 GB/s) is
the GPU's total over its links, both directions together; a GPU sends at half of it while it
receives at the other half, so the all-reduce term (``tools/interconnect.py``) takes half.
Between hosts NVIDIA publishes nothing per card: the network is the cluster's. The default,
:data:`DEFAULT_HOST_NETWORK_GBPS`, is an assumption: 8 x 400 Gb/s InfiniBand NDR per host, one
ConnectX-7 port per GPU, as NVIDIA's DGX H100 has it and H100 cloud nodes typically do;
``aot --host_network_gbps`` overrides it with the cluster's own figure.

A program gets the pool JAX's GPU client allocates: ``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the
card's memory, 0.75 by default (:func:`memory_fraction`). Nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
import os
import re

from changecap_jax.commands.tpu_specs import GB, GIB, Chip, Topology, TopologyError

DEFAULT_MEMORY_FRACTION = 0.75  # JAX's GPU client's pool without XLA_PYTHON_CLIENT_MEM_FRACTION
MAX_GPUS_PER_HOST = 16
# Per host, one direction, in Gb/s: 8 x 400 Gb/s InfiniBand (an assumption: module docstring).
DEFAULT_HOST_NETWORK_GBPS = 8 * 400.0


@dataclasses.dataclass(frozen=True)
class Architecture:
    """What the compiler needs of a GPU generation besides its memory (module docstring)."""

    compute_capability: tuple[int, int]
    accelerated: bool  # sm_90a (Hopper's wgmma), which XLA targets on a live H100
    fp32_lanes_per_sm: int
    shared_memory_per_sm: int
    shared_memory_per_block_optin: int
    l2_bytes: int


AMPERE = Architecture((8, 0), False, 64, 164 * 1024, 163 * 1024, 40 * 2**20)
HOPPER = Architecture((9, 0), True, 128, 228 * 1024, 227 * 1024, 50 * 2**20)


@dataclasses.dataclass(frozen=True)
class Card:
    """One card: its published figures (module docstring) and its architecture."""

    chip: Chip  # name, device_kind, memory, bandwidth, bf16 and TF32 peaks, source
    architecture: Architecture
    sms: int
    boost_clock_ghz: float


def _card(name: str, device_kind: str, memory_gib: int, bandwidth_gb_s: int, bf16_tflops: float,
          tf32_tflops: float, nvlink_gb_s: int, source: str, architecture: Architecture,
          sms: int, clock_ghz: float) -> Card:
    memory = memory_gib * GIB
    chip = Chip(name, device_kind, memory, int(DEFAULT_MEMORY_FRACTION * memory),
                bandwidth_gb_s * GB, bf16_tflops * 1e12, source, cores_per_chip=1,
                f32_flop_per_s=tf32_tflops * 1e12,
                # the published NVLink figure counts both directions (module docstring)
                link_bytes_per_s=nvlink_gb_s * GB / 2, link="NVLink")
    return Card(chip, architecture, sms, clock_ghz)


CARDS: dict[str, Card] = {c.chip.name: c for c in (
    # A100 80GB SXM: "80GB HBM2e", "2,039GB/s", BF16 "312 TFLOPS | 624 TFLOPS*", TF32 "156 | 312*",
    # NVLink "600GB/s"
    _card("a100", "NVIDIA A100-SXM4-80GB", 80, 2039, 312, 156, 600,
          "https://www.nvidia.com/en-us/data-center/a100/", AMPERE, 108, 1.41),
    # H100 SXM: "80GB", "3.35TB/s", BF16 "1,979 teraFLOPS*", TF32 "989 teraFLOPS*" (* sparse),
    # NVLink "900GB/s"
    _card("h100", "NVIDIA H100 80GB HBM3", 80, 3350, 989, 494.5, 900,
          "https://www.nvidia.com/en-us/data-center/h100/", HOPPER, 132, 1.98),
    # H200 SXM: "141GB", "4.8TB/s", BF16 "1,979 TFLOPS*", TF32 "989 TFLOPS*" (* sparse),
    # NVLink "900GB/s"
    _card("h200", "NVIDIA H200", 141, 4800, 989, 494.5, 900,
          "https://www.nvidia.com/en-us/data-center/h200/", HOPPER, 132, 1.98),
)}

# "h100:8" (8 GPUs on one host), "h100:2x8" (2 hosts of 8).
GPU_NAME = re.compile(r"([a-z]\d+):(?:(\d+)x)?(\d+)")


def known_names() -> str:
    return (f"GPUs as CARD:GPUS or CARD:HOSTSxGPUS, e.g. h100:8, h100:2x8; cards: "
            f"{', '.join(CARDS)}")


def memory_fraction() -> float:
    """The share of a card's memory JAX's GPU client pools for programs, as the run will have
    it: the environment's ``XLA_PYTHON_CLIENT_MEM_FRACTION``, else JAX's 0.75."""
    value = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "")
    try:
        fraction = float(value) if value else DEFAULT_MEMORY_FRACTION
    except ValueError:
        raise TopologyError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={value!r} is not a number") from None
    if not 0 < fraction <= 1:
        raise TopologyError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={value!r}: not in (0, 1]")
    return fraction


def resolve_topology(name: str, host_network_gbps: float | None = None) -> Topology | None:
    """The GPUs ``name`` names (``h100:8``, ``h100:2x8``), or None where ``name`` does not
    start with a card of :data:`CARDS` (a TPU slice's name). ``host_network_gbps``: each
    host's network in Gb/s, one direction (default :data:`DEFAULT_HOST_NETWORK_GBPS`)."""
    name = name.strip()
    card = CARDS.get(name.partition(":")[0])
    if card is None:
        return None
    match = GPU_NAME.fullmatch(name)
    hosts, per_host = (int(match.group(2) or 1), int(match.group(3))) if match else (0, 0)
    if not hosts or not 1 <= per_host <= MAX_GPUS_PER_HOST:
        raise TopologyError(f"GPU topology {name!r}: use {known_names()} (1 to "
                            f"{MAX_GPUS_PER_HOST} GPUs per host)")
    pool = int(memory_fraction() * card.chip.hbm_bytes)
    chip = dataclasses.replace(card.chip, hbm_available=pool)
    options = {"target_config": target_config(card), "topology": f"1x{hosts}x{per_host}"}
    gbps = DEFAULT_HOST_NETWORK_GBPS if host_network_gbps is None else host_network_gbps
    if gbps <= 0:
        raise TopologyError(f"--host_network_gbps={gbps:g}: must be positive")
    assumed = ", assumed" if host_network_gbps is None else ""
    return Topology(name, chip, hosts * per_host, options, platform="cuda", hosts=hosts,
                    network_bytes_per_s=gbps * 1e9 / 8,
                    network=f"network ({gbps:g} Gb/s per host{assumed})")


# CUDA's limits per block and thread, the same for compute capability 8.0 and 9.0.
_LIMITS = """\
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  threads_per_core_limit: 2048
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
"""


def target_config(card: Card) -> str:
    """The card as the CUDA plugin's ``target_config`` option: a ``GpuTargetConfigProto`` in
    protobuf text format, with the figures of ``card`` (module docstring)."""
    arch = card.architecture
    major, minor = arch.compute_capability
    extension = "\n    feature_extension: ACCELERATED_FEATURES" if arch.accelerated else ""
    return (
        "gpu_device_info {\n" + _LIMITS
        + f"  core_count: {card.sms}\n"
        f"  fpus_per_core: {arch.fp32_lanes_per_sm}\n"
        f"  shared_memory_per_core: {arch.shared_memory_per_sm}\n"
        f"  shared_memory_per_block_optin: {arch.shared_memory_per_block_optin}\n"
        f"  l2_cache_size: {arch.l2_bytes}\n"
        f"  clock_rate_ghz: {card.boost_clock_ghz}\n"
        f"  memory_bandwidth: {int(card.chip.hbm_bytes_per_s)}\n"
        f"  device_memory_size: {card.chip.hbm_bytes}\n"
        f"  cuda_compute_capability {{\n    major: {major}\n    minor: {minor}{extension}\n  }}\n"
        "}\n"
        'platform_name: "CUDA"\n'
        f'device_description_str: "{card.chip.device_kind}"\n')
