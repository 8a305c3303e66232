"""Mean and standard deviation over seeds: one row per system, from seed sweeps
(docs/ablations.md, "The orderings over three seeds").

    python -m tools.seed_table SWEEP_DIR [SWEEP_DIR ...] [--metric=CIDEr] \
        [--columns=total,semantic,no_change,color,material,add,drop,move]

Each SWEEP_DIR is the output of ``python -m changecap_jax sweep --param=seed --values=...``
(its ``sweep.json``); each of its runs' final metrics file gives one value per column: the
metric of all pairs (``total``) or of one group of them (``semantic``, ``no_change`` or a
change type); a column GROUP/KEY names its own metric, KEY of the metrics file's GROUP
(e.g. ``router/change_accuracy``, a change router's accuracy). A cell is ``mean ± std`` over
the seeds (the sample standard deviation, n - 1), scores x100 as in the metrics files. Reads
JSON only (no JAX).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from changecap_jax.errors import UserError
from changecap_jax.io.jsonio import read_json

COLUMNS = ("total", "semantic", "no_change", "color", "material", "add", "drop", "move")


class SeedTableError(UserError):
    """A sweep directory that is not a finished seed sweep, or a metric a run lacks."""


def seed_values(sweep_dir: Path, metric: str, columns: Sequence[str]
                ) -> tuple[str, list[int], dict[str, list[float]]]:
    """(the sweep's config, its seeds, column -> one value per seed) of one seed sweep."""
    summary = read_json(sweep_dir / "sweep.json", "sweep summary")
    if summary.get("param") != "seed":
        raise SeedTableError(f"{sweep_dir / 'sweep.json'} sweeps {summary.get('param')!r}, "
                             "not seed")
    config = " ".join([summary["config"], *summary.get("overrides", [])])
    seeds, values = [], {c: [] for c in columns}
    for row in summary["rows"]:
        path = Path(row["metrics_file"])
        metrics = read_json(path, "metrics file")
        seeds.append(row["value"])
        for column in columns:
            name, key = column.split("/", 1) if "/" in column else (column, metric)
            group = metrics if name == "total" else metrics.get(name)
            if not isinstance(group, dict) or not isinstance(group.get(key), int | float):
                raise SeedTableError(f"{path} has no {key} for {name!r}")
            values[column].append(float(group[key]))
    if not seeds:
        raise SeedTableError(f"{sweep_dir / 'sweep.json'} lists no runs")
    return config, seeds, values


def cell(values: Sequence[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.1f}"
    return f"{statistics.fmean(values):.1f} ± {statistics.stdev(values):.1f}"


def table(sweep_dirs: Sequence[Path], metric: str = "CIDEr",
          columns: Sequence[str] = COLUMNS) -> str:
    """The markdown table: one row per sweep, ``mean ± std`` per column."""
    lines = ["| config | seeds | " + " | ".join(columns) + " |",
             "|---|---|" + "---:|" * len(columns)]
    for sweep_dir in sweep_dirs:
        config, seeds, values = seed_values(sweep_dir, metric, columns)
        lines.append(f"| `{config}` | {', '.join(str(s) for s in seeds)} | "
                     + " | ".join(cell(values[c]) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.seed_table",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep_dirs", nargs="+", type=Path)
    parser.add_argument("--metric", default="CIDEr")
    parser.add_argument("--columns", default=",".join(COLUMNS))
    args = parser.parse_args(argv)
    try:
        print(table(args.sweep_dirs, args.metric, [c for c in args.columns.split(",") if c]),
              end="")
    except (UserError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
