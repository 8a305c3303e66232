"""The per-step table (printed, ``steps.csv``, ``steps.json``) and ``losses.png``.

The plot is drawn with Pillow (a core dependency; matplotlib is not one): the total loss of
both sides per step (official as a line, ours as markers on it), and below it each loss
term's relative difference per step on a log scale with the ``rtol`` line.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from changecap_jax.io.jsonio import atomic_write, write_json_atomic

CSV_FILE, JSON_FILE, PLOT_FILE = "steps.csv", "steps.json", "losses.png"
OFFICIAL_COLOR, OURS_COLOR, LIMIT_COLOR = (31, 119, 180), (255, 127, 14), (214, 39, 40)
TERM_COLORS = [(31, 119, 180), (44, 160, 44), (148, 103, 189), (140, 86, 75), (0, 0, 0)]
SIZE = (960, 680)


def loss_terms(row: dict[str, Any]) -> list[str]:
    """The loss terms of a row (caption, the auxiliary losses, total), in column order."""
    return [k[: -len("_official")] for k in row
            if k.endswith("_official") and k not in ("lr_official", "grad_norm_official")]


def max_loss_rel_diff(row: dict[str, Any]) -> tuple[float, str]:
    """The largest relative loss difference of a row, and its term."""
    return max((row[f"{t}_rel_diff"], t) for t in loss_terms(row))


def header(terms: Sequence[str]) -> str:
    """The printed table's column titles."""
    return (f"{'step':>5} {'lr official':>11} {'lr ours':>9} {'total official':>14} "
            f"{'total ours':>12} {'max loss rel diff':>24} {'grad norm rel':>13} "
            f"{'param max abs diff':>18} {'param rel L2':>13}   (terms: {', '.join(terms)})")


def format_row(row: dict[str, Any]) -> str:
    """One printed line per step."""
    worst, term = max_loss_rel_diff(row)
    return (f"{row['step']:>5} {row['lr_official']:>11.3e} {row['lr_ours']:>9.3e} "
            f"{row['total_official']:>14.7f} {row['total_ours']:>12.7f} "
            f"{worst:>15.2e} ({term:>7}) {row['grad_norm_rel_diff']:>13.2e} "
            f"{row['param_max_abs_diff']:>18.3e} {row['param_rel_l2_diff']:>13.2e}")


def format_official_row(row: dict[str, Any]) -> str:
    """One printed line per step of ``--sides=official``."""
    terms = ", ".join(f"{t} {row[f'{t}_official']:.4f}" for t in loss_terms(row))
    return (f"{row['step']:>5} lr {row['lr_official']:.3e} {terms} "
            f"grad norm {row['grad_norm_official']:.4f}")


def format_summary(summary: dict[str, Any]) -> str:
    """The printed summary of :func:`run.summarize`'s dict."""
    lines = ["over all steps, official vs ours:"]
    for term, value in summary["max_rel_diff"].items():
        absolute = summary["max_abs_diff"].get(term)
        lines.append(f"  {term:>10}: max relative difference {value:.3e} (step "
                     f"{summary['max_rel_diff_step'][term]})"
                     + (f", max absolute {absolute:.3e}" if absolute is not None else ""))
    for key, what in (
            ("param_max_abs_diff", "parameters, max |official - ours| after the update"),
            ("noise_param_max_abs_diff", "the same over the float-noise-gradient parameters"),
            ("param_rel_l2_diff", "||official - ours|| / ||official - initial||")):
        diffs = ", ".join(f"step {s}: {v:.3e}" for s, v in summary[key].items())
        lines.append(f"{what}: {diffs}")
    lines.append(f"learning rates equal at every step: {summary['lr_equal']}")
    verdict = ("every loss term agrees at every step" if summary["losses_within_tolerance"]
               else f"loss terms differ from step {summary['first_step_outside_tolerance']}")
    lines.append(f"{verdict} (rtol {summary['rtol']:g}, atol {summary['atol']:g}, "
                 f"{summary.get('precision', 'float32')})")
    return "\n".join(lines)


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    """The rows as CSV, one column per key."""
    def write(fh: Any) -> None:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)

    atomic_write(path, write)


def write_outputs(out_dir: str | Path, result: Any) -> dict[str, Path]:
    """``steps.csv``, ``steps.json`` (rows, summary, notes, settings, and with --evaluate
    both sides' scores) and ``losses.png``."""
    out = Path(out_dir)
    paths = {"csv": out / CSV_FILE, "json": out / JSON_FILE, "plot": out / PLOT_FILE}
    write_csv(paths["csv"], result.rows)
    written = {"summary": result.summary, "notes": result.notes, "settings": result.settings,
               "rows": result.rows}
    if result.evaluation:
        written["evaluation"] = result.evaluation
    write_json_atomic(paths["json"], written, indent=1)
    if "rtol" not in result.summary:  # --sides=official: nothing to plot against
        del paths["plot"]
        return paths
    plot(paths["plot"], result.rows, result.summary["rtol"], result.settings)
    return paths


# ---------------------------------------------------------------------------------------------
# The plot
# ---------------------------------------------------------------------------------------------


def _scale(lo: float, hi: float, a: float, b: float) -> Any:
    span = (hi - lo) or 1.0
    return lambda v: b - (v - lo) / span * (b - a)


def _panel(draw: Any, box: tuple[int, int, int, int], steps: list[int],
           series: list[tuple[list[float], tuple[int, int, int], str]], title: str,
           y_labels: Any) -> None:
    """Axes, title, y tick labels (``y_labels(lo, hi)`` -> [(value, text)]) and the series,
    each a line ("line") or markers ("dots")."""
    left, top, right, bottom = box
    values = [v for s in series for v in s[0] if math.isfinite(v)]
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    pad = (hi - lo) * 0.05 or abs(hi) * 0.05 or 1.0
    lo, hi = lo - pad, hi + pad
    y = _scale(lo, hi, top, bottom)
    first, span = steps[0], max(steps[-1] - steps[0], 1)
    x = lambda s: left + (s - first) / span * (right - left)  # noqa: E731
    draw.rectangle(box, outline=(120, 120, 120))
    draw.text((left, top - 16), title, fill=(0, 0, 0))
    for value, text in y_labels(lo, hi):
        draw.line([(left - 4, y(value)), (left, y(value))], fill=(120, 120, 120))
        draw.text((left - 8 - 6 * len(text), y(value) - 6), text, fill=(60, 60, 60))
    for s in sorted({steps[0], steps[-1], *steps[:: max(1, len(steps) // 5)]}):
        draw.text((x(s) - 6, bottom + 6), str(s), fill=(60, 60, 60))
    for points, color, style in series:
        xy = [(x(s), y(v)) for s, v in zip(steps, points, strict=True)
              if math.isfinite(v)]
        if style == "line" and len(xy) > 1:
            draw.line(xy, fill=color, width=2)
        for px, py in xy if style == "dots" else ():
            draw.ellipse([px - 3, py - 3, px + 3, py + 3], outline=color, width=2)


def _linear_labels(lo: float, hi: float) -> list[tuple[float, str]]:
    return [(v, f"{v:.4g}") for v in (lo + (hi - lo) * k / 4 for k in range(5))]


def _log_labels(lo: float, hi: float) -> list[tuple[float, str]]:
    return [(float(e), f"1e{e}") for e in range(math.ceil(lo), math.floor(hi) + 1)]


def _legend(draw: Any, origin: tuple[int, int], entries: list[tuple[str, tuple]]) -> None:
    x, y = origin
    for label, color in entries:
        draw.line([(x, y + 6), (x + 18, y + 6)], fill=color, width=3)
        draw.text((x + 22, y), label, fill=(0, 0, 0))
        x += 34 + 6 * len(label)


def plot(path: Path, rows: list[dict[str, Any]], rtol: float, settings: dict[str, Any]) -> None:
    """Writes ``losses.png`` (module docstring)."""
    image = Image.new("RGB", SIZE, (255, 255, 255))
    draw = ImageDraw.Draw(image)
    steps = [r["step"] for r in rows]
    draw.text((90, 12), f"{settings['model']}: {settings['repository']} {settings['script']} "
              f"(official, line) vs changecap_jax (ours, circles); {settings['inputs']}",
              fill=(0, 0, 0))
    _panel(draw, (90, 60, 930, 380), steps,
           [([r["total_official"] for r in rows], OFFICIAL_COLOR, "line"),
            ([r["total_ours"] for r in rows], OURS_COLOR, "dots")],
           "total loss per step", _linear_labels)
    terms = loss_terms(rows[0])
    colors = dict(zip(terms, TERM_COLORS, strict=False))
    series = [([math.log10(max(r[f"{t}_rel_diff"], 1e-12)) for r in rows], colors[t], "line")
              for t in terms]
    series.append(([math.log10(rtol)] * len(rows), LIMIT_COLOR, "line"))
    _panel(draw, (90, 440, 930, 640), steps, series,
           "relative difference of each loss term per step (log10; 0 drawn at 1e-12)",
           _log_labels)
    _legend(draw, (520, 408), [*((t, colors[t]) for t in terms), (f"rtol {rtol:g}",
                                                                   LIMIT_COLOR)])
    draw.text((480, 658), "step", fill=(0, 0, 0))
    atomic_write(path, lambda fh: image.save(fh, format="PNG"), binary=True)
