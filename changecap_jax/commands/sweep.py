"""One training per value of a config field, then one table and one plot (docs/ablations.md,
"Sweeps"): the head-number and layer-number studies of SCORER Fig. 4 / 5, DIRL's
lambda_d / lambda_c study of Fig. 5.

    python -m changecap_jax sweep --config=configs/MODEL.py[:PRESET] --param=model.num_heads \
        --values=1,2,4,8 [--workdir=DIR] [--metric=CIDEr] [--split=test] \
        [--config.FIELD=VALUE ...]

Each value trains in a subprocess, ``python -m changecap_jax.main --config=... --workdir=
DIR/<param>=<value> --config.<param>=<value>`` plus the ``--config.FIELD=VALUE`` overrides
given here, one after the other; its output goes to ``train.log`` in that workdir, its
arguments and then its final metrics file to ``sweep_run.json``. A value whose run ended is
skipped; an interrupted one is started again with the same command, and the trainer resumes
from its checkpoint (a workdir holding a run with other arguments is an error). Then
``DIR/sweep.md`` and ``DIR/sweep.json`` table each value's main metrics of ``--split`` (the
final metrics file, ``metrics/<split>_<step>.json``, written by
changecap_jax/evaluators/results.py ``write_results``) and ``DIR/sweep.png`` plots ``--metric``
against the values. The values are parsed to the field's type (int, float, bool or str).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ml_collections
from absl import flags
from ml_collections import config_flags
from PIL import Image, ImageDraw

from changecap_jax import cli
from changecap_jax.errors import UserError
from changecap_jax.io.jsonio import atomic_write, read_json, write_json_atomic

FLAGS = flags.FLAGS
RECORD_FILE = "sweep_run.json"  # in a value's workdir: its run's arguments, then its metrics
LOG_FILE = "train.log"
TABLE_FILE, JSON_FILE, PLOT_FILE = "sweep.md", "sweep.json", "sweep.png"
SWEEPABLE = (bool, int, float, str)  # bool first: it is an int too
TRUE, FALSE = ("true", "t", "yes", "y", "1"), ("false", "f", "no", "n", "0")


class SweepError(UserError):
    """A sweep that cannot run as asked (field, values, split) or a value's run that failed."""


@dataclasses.dataclass(frozen=True)
class Variant:
    """One value of the swept field and where its run lives."""

    value: Any
    text: str  # the value as the command line and the workdir name spell it
    workdir: Path


def define_flags() -> None:
    """The command's flags (defined by ``__main__`` only: changecap_jax.main defines
    ``--config`` too, and tests import this module beside it)."""
    config_flags.DEFINE_config_file("config", None, "Model config file.", lock_config=True)
    flags.DEFINE_string("param", None, "The config field to sweep, e.g. model.num_heads.")
    flags.DEFINE_list("values", None, "Its values, comma-separated, e.g. 1,2,4,8.")
    flags.DEFINE_string("workdir", None,
                        "Output folder (default: workdir/sweep_<config name>_<param>).")
    flags.DEFINE_string("metric", "CIDEr", "The metric plotted against the values.")
    flags.DEFINE_string("split", "test", "The split whose final metrics are tabled.")
    flags.mark_flags_as_required(["config", "param", "values"])


# -- values ---------------------------------------------------------------------------------


def field_type(config: ml_collections.ConfigDict, param: str) -> type:
    """The type of the field ``param`` (dotted path) of ``config``; only the types a command
    line value can set are allowed."""
    node: Any = config
    parts = param.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            raise SweepError(f"--param={param}: the config has no field "
                             f"{'.'.join(parts[: i + 1])!r}")
        if i == len(parts) - 1:
            kind = node.get_type(part)
        node = node[part]
    if kind not in SWEEPABLE:
        raise SweepError(f"--param={param}: the field is a {kind.__name__}; a sweep sets "
                         "int, float, bool or str fields")
    return kind


def parse_value(text: str, kind: type, param: str) -> Any:
    """``text`` as a value of ``param``'s type ``kind``."""
    text = text.strip()
    try:
        if kind is bool:
            if text.lower() not in (*TRUE, *FALSE):
                raise ValueError(text)
            return text.lower() in TRUE
        if kind is int:
            return int(text)
        return kind(text)
    except ValueError:
        raise SweepError(f"--values: {text!r} is not a {kind.__name__}, the type of "
                         f"{param}") from None


def value_text(value: Any) -> str:
    """How a value is spelled on the command line and in its workdir's name."""
    return repr(value) if isinstance(value, float) else str(value)


def plan(config: ml_collections.ConfigDict, param: str, texts: Sequence[str],
         workdir: str | os.PathLike) -> list[Variant]:
    """The variants of a sweep, in the order of ``texts``."""
    kind = field_type(config, param)
    variants: list[Variant] = []
    for text in texts:
        value = parse_value(text, kind, param)
        spelled = value_text(value)
        if not spelled or "/" in spelled or spelled.startswith("."):
            raise SweepError(f"--values: {text!r} cannot name a folder ({param}=<value>)")
        if any(v.text == spelled for v in variants):
            raise SweepError(f"--values: {spelled} is given twice")
        variants.append(Variant(value, spelled, Path(workdir) / f"{param}={spelled}"))
    if not variants:
        raise SweepError("--values: no values given")
    return variants


# -- runs -----------------------------------------------------------------------------------


def config_overrides(argv: Sequence[str]) -> list[str]:
    """The ``--config.FIELD=VALUE`` arguments of a command line, in order."""
    return [a for a in argv[1:] if a.startswith("--config.")]


def train_args(config_arg: str, param: str, text: str, overrides: Sequence[str]) -> list[str]:
    """The arguments of a value's training run, less ``--workdir`` (what makes two runs of
    the same value the same run)."""
    return [f"--config={config_arg}", *overrides, f"--config.{param}={text}"]


def final_metrics(workdir: Path, split: str) -> Path | None:
    """The newest ``metrics/<split>_<step>.json`` of a workdir: the final evaluation is the
    last one written (with early stopping its step is the best one's, not the largest)."""
    files = [p for p in (workdir / "metrics").glob(f"{split}_*.json")
             if re.fullmatch(rf"{re.escape(split)}_\d+\.json", p.name)]
    return max(files, key=lambda p: (p.stat().st_mtime, step_of(p)), default=None)


def step_of(metrics_file: Path) -> int:
    return int(metrics_file.stem.rsplit("_", 1)[1])


def finished(variant: Variant, args: Sequence[str]) -> Path | None:
    """The final metrics file of a value whose run ended, or None; a workdir holding a run
    with other arguments is an error (the trainer would resume it, and its results would
    not be this sweep's)."""
    path = variant.workdir / RECORD_FILE
    if not path.exists():
        return None
    record = read_json(path, "sweep record")
    recorded = list(record.get("args") or [])
    if recorded != list(args):
        there = [a for a in recorded if a not in args]
        here = [a for a in args if a not in recorded]
        differ = "; ".join([*([f"it has {shlex.join(there)}"] if there else []),
                            *([f"this sweep {shlex.join(here)}"] if here else [])])
        raise SweepError(f"{variant.workdir} holds a run with other arguments "
                         f"({differ or 'the same ones in another order'}); pass another "
                         "--workdir or remove that folder")
    if not record.get("metrics_file"):
        return None  # started, not ended
    metrics = variant.workdir / record["metrics_file"]
    return metrics if metrics.exists() else None


def _last_error(log: Path) -> str:
    """The line of a failed run's log that says why: its ``error:`` line, else its last."""
    lines = [s.strip() for s in log.read_text(errors="replace").splitlines() if s.strip()]
    errors = [s for s in lines if s.startswith("error:")]
    return (errors or lines or ["(no output)"])[-1]


def run_variant(variant: Variant, args: Sequence[str], split: str) -> Path:
    """Trains (or resumes) one value in a subprocess; returns its final metrics file."""
    write_json_atomic(variant.workdir / RECORD_FILE, {"args": list(args), "metrics_file": None},
                      indent=1)
    command = [sys.executable, "-m", "changecap_jax.main", *args,
               f"--workdir={variant.workdir}"]
    log = variant.workdir / LOG_FILE
    with open(log, "a", encoding="utf-8") as fh:
        fh.write(f"$ {shlex.join(command)}\n")
        fh.flush()
        status = subprocess.run(command, stdout=fh, stderr=subprocess.STDOUT,
                                check=False).returncode
    if status != 0:
        raise SweepError(f"the run of {variant.workdir.name} failed (exit status {status}): "
                         f"{_last_error(log)} (log: {log}); rerun the sweep to resume it")
    metrics = final_metrics(variant.workdir, split)
    if metrics is None:
        raise SweepError(f"the run of {variant.workdir.name} wrote no {split} metrics into "
                         f"{variant.workdir / 'metrics'}")
    write_json_atomic(variant.workdir / RECORD_FILE, {
        "args": list(args), "metrics_file": str(metrics.relative_to(variant.workdir))},
        indent=1)
    return metrics


def metric_value(metrics_file: Path, metric: str) -> float:
    """``metric`` of a metrics file: a top-level key ("CIDEr") or GROUP/KEY of a group
    ("router/change_accuracy", "idc/CIDEr"); a missing one names the metrics it has."""
    metrics = read_json(metrics_file, "metrics file")
    node: Any = metrics
    for part in metric.split("/"):
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, int | float):
        have = sorted(k for k, v in metrics.items() if isinstance(v, int | float))
        groups = sorted(f"{k}/..." for k, v in metrics.items() if isinstance(v, dict))
        raise SweepError(f"--metric={metric}: {metrics_file} has no such metric; it has "
                         f"{', '.join(have + groups)}")
    return float(node)


# -- the table and the plot -----------------------------------------------------------------


def table_rows(variants: Sequence[Variant], files: Sequence[Path], metric: str
               ) -> list[dict[str, Any]]:
    """One row per value: its main metrics (and ``metric``), step and paths."""
    rows = []
    for variant, path in zip(variants, files, strict=True):
        metrics = read_json(path, "metrics file")
        names = [*metrics.get("main_metrics", []), metric]
        rows.append({
            "value": variant.value,
            "metrics": {n: metric_value(path, n) for n in dict.fromkeys(names)},
            "step": step_of(path),
            "workdir": str(variant.workdir),
            "metrics_file": str(path)})
    return rows


def markdown(summary: dict[str, Any]) -> str:
    """``sweep.md``: the values as rows, the metrics as columns."""
    names = list(dict.fromkeys(n for r in summary["rows"] for n in r["metrics"]))
    param = summary["param"]
    lines = [f"# Sweep of {param}", "",
             f"config `{summary['config']}`"
             + (f" with `{' '.join(summary['overrides'])}`" if summary["overrides"] else "")
             + f"; {summary['split']} split, final metrics (scores x100 as in the metrics "
             "files)", "",
             f"| {param} | " + " | ".join(names) + " | step | workdir |",
             "|---|" + "---:|" * len(names) + "---:|---|"]
    for row in summary["rows"]:
        cells = [f"{row['metrics'][n]:.2f}" if n in row["metrics"] else "-" for n in names]
        lines.append(f"| {value_text(row['value'])} | " + " | ".join(cells)
                     + f" | {row['step']} | {row['workdir']} |")
    return "\n".join(lines) + "\n"


PLOT_SIZE, PLOT_BOX = (720, 440), (90, 60, 680, 370)  # image; axes (left, top, right, bottom)
LINE_COLOR, AXIS_COLOR, TEXT_COLOR = (31, 119, 180), (120, 120, 120), (40, 40, 40)


def _y_range(values: Sequence[float]) -> tuple[float, float]:
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    pad = (hi - lo) * 0.1 or abs(hi) * 0.1 or 1.0
    return lo - pad, hi + pad


def plot(path: Path, summary: dict[str, Any]) -> None:
    """``sweep.png``: the metric against the values, one evenly spaced point per value in
    the order given (as the papers' figures place 1, 2, 4, 8 heads). Drawn with Pillow (a
    core dependency; matplotlib is not one)."""
    metric, rows = summary["metric"], summary["rows"]
    points = [r["metrics"].get(metric, math.nan) for r in rows]
    left, top, right, bottom = PLOT_BOX
    lo, hi = _y_range([v for v in points if math.isfinite(v)])
    y = lambda v: bottom - (v - lo) / (hi - lo) * (bottom - top)  # noqa: E731
    x = lambda i: left + (i + 0.5) / len(rows) * (right - left)  # noqa: E731
    image = Image.new("RGB", PLOT_SIZE, (255, 255, 255))
    draw = ImageDraw.Draw(image)
    draw.text((left, 20), f"{metric} on {summary['split']} against {summary['param']} "
              f"({summary['config']})", fill=(0, 0, 0))
    draw.rectangle(PLOT_BOX, outline=AXIS_COLOR)
    for k in range(5):
        value = lo + (hi - lo) * k / 4
        draw.line([(left - 4, y(value)), (left, y(value))], fill=AXIS_COLOR)
        label = f"{value:.4g}"
        draw.text((left - 8 - 6 * len(label), y(value) - 6), label, fill=TEXT_COLOR)
    for i, row in enumerate(rows):
        label = value_text(row["value"])
        draw.text((x(i) - 3 * len(label), bottom + 8), label, fill=TEXT_COLOR)
    xy = [(x(i), y(v)) for i, v in enumerate(points) if math.isfinite(v)]
    if len(xy) > 1:
        draw.line(xy, fill=LINE_COLOR, width=2)
    for px, py in xy:
        draw.ellipse([px - 4, py - 4, px + 4, py + 4], fill=LINE_COLOR)
    draw.text(((left + right) // 2 - 3 * len(summary["param"]), bottom + 32), summary["param"],
              fill=(0, 0, 0))
    draw.text((10, top - 20), metric, fill=(0, 0, 0))
    atomic_write(path, lambda fh: image.save(fh, format="PNG"), binary=True)


def write_outputs(out: Path, summary: dict[str, Any]) -> list[Path]:
    """``sweep.md``, ``sweep.json`` and ``sweep.png``, each written atomically."""
    paths = [out / TABLE_FILE, out / JSON_FILE, out / PLOT_FILE]
    text = markdown(summary)
    atomic_write(paths[0], lambda fh: fh.write(text))
    write_json_atomic(paths[1], summary, indent=1)
    plot(paths[2], summary)
    return paths


# -- the command ----------------------------------------------------------------------------


def sweep(variants: Sequence[Variant], base_args: dict[str, Any], split: str,
          metric: str) -> list[Path]:
    """Runs the values not yet finished, one after the other, printing one line per value;
    returns each value's final metrics file."""
    files = []
    for i, variant in enumerate(variants, 1):
        name = variant.workdir.name
        args = train_args(base_args["config"], base_args["param"], variant.text,
                          base_args["overrides"])
        path = finished(variant, args)
        if path is not None:
            print(f"skipped {name} ({i}/{len(variants)}): finished, {split} {metric} "
                  f"{metric_value(path, metric):.2f}", flush=True)
        else:
            print(f"starting {name} ({i}/{len(variants)}): log {variant.workdir / LOG_FILE}",
                  flush=True)
            path = run_variant(variant, args, split)
            print(f"done {name} ({i}/{len(variants)}): {split} {metric} "
                  f"{metric_value(path, metric):.2f}", flush=True)
        files.append(path)
    return files


def main(argv: list[str]) -> None:
    """Plans, runs and tables the sweep (module docstring)."""
    if len(argv) > 1:
        raise SweepError(f"unexpected arguments: {argv[1:]}")
    config, param = FLAGS.config, FLAGS.param
    config_arg = FLAGS["config"].serialize().partition("=")[2]
    overrides = config_overrides(sys.argv)
    if any(a.partition("=")[0] == f"--config.{param}" for a in overrides):
        raise SweepError(f"--config.{param} is set by --param={param} and --values; drop it")
    if FLAGS.split not in tuple(config.final_eval_splits):
        raise SweepError(f"--split={FLAGS.split}: the runs score only the final_eval_splits "
                         f"{tuple(config.final_eval_splits)}; pick one, or add it with "
                         "--config.final_eval_splits=...")
    name = os.path.splitext(os.path.basename(FLAGS["config"].config_filename.split(":")[0]))[0]
    out = Path(FLAGS.workdir or os.path.join("workdir", f"sweep_{name}_{param}"))
    variants = plan(config, param, FLAGS.values, out)
    files = sweep(variants, {"config": config_arg, "param": param, "overrides": overrides},
                  FLAGS.split, FLAGS.metric)
    summary = {"param": param, "config": config_arg, "overrides": overrides,
               "split": FLAGS.split, "metric": FLAGS.metric,
               "rows": table_rows(variants, files, FLAGS.metric)}
    paths = write_outputs(out, summary)
    print("wrote " + ", ".join(str(p) for p in paths), flush=True)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
