"""A markdown table of ``python -m changecap_jax aot --json`` results (docs/accelerators.md).

    python -m changecap_jax.commands.aot_table RESULT.json [RESULT.json ...]

One row per program of each file: preset, slice, compute dtype, global batch, per-chip HBM
used and available, per-chip FLOPs, the parameters, the gradient all-reduce's time bound, the
roofline bound (the largest of compute, memory and communication, and which) and its
examples/s, the largest global batch estimated to fit, compile time. Reads JSON only (no JAX);
files written before the communication term show "-" for it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HEADER = ("| preset | slice | program | batch (per chip) | HBM per chip | GFLOP per chip | "
          "parameters | all-reduce per step | roofline per step | roofline examples/s | "
          "largest batch (est.) | compile |")


def _preset(r: dict[str, Any]) -> str:
    return r["preset"].removeprefix("configs/")


def _slice(r: dict[str, Any]) -> str:
    hosts = f", {r['hosts']} hosts" if r["hosts"] > 1 else ""
    name = r["accelerator_type"] or r["topology"]
    unit = "GPUs" if r.get("platform") == "cuda" else "chips"
    return f"{name} ({r['chips']} {unit}{hosts})"


def _all_reduce(p: dict[str, Any]) -> str:
    comm = p.get("all_reduce")
    if "all_reduce" not in p:
        return "-"
    if not comm:
        return "none"
    return f"{comm['payload_bytes'] / 1e6:,.1f} MB, {comm['seconds'] * 1e3:.2f} ms"


def _count(n: int | None) -> str:
    return f"{n:,}" if n else "-"


def _bound(p: dict[str, Any]) -> str:
    unknown = ", no cost analysis" if p.get("warnings") else ""
    return f"{p['roofline_s'] * 1e3:.1f} ms ({p['bound_by']}{unknown})"


def rows(results: dict[str, Any]) -> list[str]:
    out = []
    for p in results["programs"]:
        out.append(
            f"| {_preset(results)} {results['compute_dtype']} | {_slice(results)} | "
            f"{p['program']} | {p['batch']} ({p['per_chip_batch']:g}) | "
            f"{p['hbm_used'] / 2**30:.2f} of {p['hbm_available'] / 2**30:.2f} GiB | "
            f"{p['flops'] / 1e9:,.0f} | {_count(p.get('param_count'))} | {_all_reduce(p)} | "
            f"{_bound(p)} | "
            f"{_count(p['roofline_per_s'] and round(p['roofline_per_s']))} | "
            f"{_count(p['largest_batch_estimate'])} | "
            f"{p['lower_s'] + p['compile_s']:.0f} s |")
    return out


def table(paths: list[str]) -> str:
    lines = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    for path in paths:
        lines += rows(json.loads(Path(path).read_text()))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    print(table(argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
