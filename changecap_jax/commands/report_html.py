"""One static, self-contained HTML page that reports an evaluation.

Pure rendering: the caller (``changecap_jax/commands/report.py``) gathers the metrics, the logged
scalar
curves and the per-pair captions; this module turns them into a single HTML file with

* the papers' metric table (rows total / semantic / no_change / per change type, columns B4, M,
  R, C[, S] with one decimal, plus the number of pairs) and the dataset / protocol notes;
* when the metrics hold a ``difficulty`` entry (the difficulty-binned evaluation, see
  docs/evaluation.md), a section right after the table: per stream and viewpoint-IoU bin a
  table row, one inline SVG chart per metric (CIDEr, METEOR, pointing, attention in box)
  against the bins, hardest left, and the overall pointing-game numbers;
* one inline SVG line chart per logged scalar, grouped by prefix ("train/", "val/", ...);
* a histogram of the per-pair CIDEr and a gallery of pairs (images as base64 data URIs, generated
  caption, references, change type, per-pair CIDEr), worst CIDEr first, with a small inline script
  that sorts (CIDEr ascending / descending, image id) and filters by change type.

Nothing is loaded from outside the file (no URLs, fonts, external CSS or JS); a
Content-Security-Policy meta tag makes the browser enforce that.  All text is escaped with
:func:`html.escape`, and the output is a pure function of the input (no timestamps), so the same
evaluation always renders to the same bytes.

The page reads the sort and filter from the URL fragment or query (``report.html#sort=cider_desc``
or ``?sort=image_id&type=color``); values of ``sort``: ``cider_asc`` (default), ``cider_desc``,
``image_id``; ``type``: a change type (``none`` for pairs without one).  Without JavaScript the
page is still complete, in its default (worst-first) order.
"""

from __future__ import annotations

import base64
import html
import importlib.resources
import math
import numbers
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from changecap_jax.evaluators.captions import (
    CHANGE_TYPES,
    METRIC_NAMES,
    NO_CHANGE,
    ROW_ORDER,
    TABLE_COLUMNS,
)
from changecap_jax.io import paths
from changecap_jax.io.jsonio import atomic_write

__all__ = ["SORT_KEYS", "GalleryEntry", "render_report", "write_report"]

#: Sort orders the page offers, in the order of its select box (the first is the default).
SORT_KEYS: tuple[str, ...] = ("cider_asc", "cider_desc", "image_id")
_SORT_LABELS = {
    "cider_asc": "CIDEr ascending (worst first)",
    "cider_desc": "CIDEr descending (best first)",
    "image_id": "image id",
}
# Every score evaluate_pairs can produce, for the "all scores" details table.
_ALL_METRIC_KEYS: tuple[str, ...] = (
    "Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr", "SPICE",
)
# The filter's value for entries whose change_type is "" (an empty option value would be
# indistinguishable from "no filter" in a URL fragment).
_NO_TYPE = "none"
_ALL_TYPES = "all"


@dataclass
class GalleryEntry:
    """One image pair of the gallery.

    Attributes:
        image_id: the pair's id.
        caption: the generated caption.
        references: the ground-truth captions.
        change_type: "" when the dataset has none, "no_change" for distractor pairs.
        cider: per-pair CIDEr, x100.
        images: name -> encoded image (PNG, JPEG, GIF or WebP bytes), in display order, e.g.
            ``{"before": ..., "after": ...}``; empty when the dataset keeps no images.
        extra: optional extra text fields shown under the caption (name -> text).
    """

    image_id: str
    caption: str
    references: list[str]
    change_type: str
    cider: float
    images: dict[str, bytes] = field(default_factory=dict)
    extra: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------


def _esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def _is_number(value: object) -> bool:
    # bool is an Integral; a True/False metric would be a bug, not a score.
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _finite(value: object) -> bool:
    return _is_number(value) and math.isfinite(float(value))  # type: ignore[arg-type]


def _fmt1(value: object) -> str:
    return f"{float(value):.1f}" if _finite(value) else "\u2013"  # type: ignore[arg-type]


def _fmt2(value: object) -> str:
    return f"{float(value):.2f}" if _finite(value) else "\u2013"  # type: ignore[arg-type]


def _count(value: object) -> str:
    return str(int(value)) if _finite(value) else "\u2013"  # type: ignore[arg-type]


def _natural_key(text: str) -> tuple[tuple[int, int, str], ...]:
    # "img_10" after "img_9": runs of digits compare as numbers (tagged so ints never meet strs).
    parts = re.split(r"(\d+)", text)
    return tuple((0, int(p), p) if p.isdigit() else (1, 0, p) for p in parts if p)


def _image_mime(data: bytes) -> str | None:
    """MIME type from the file signature; None for a format browsers may not show."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data.startswith((b"GIF87a", b"GIF89a")):
        return "image/gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None


# ---------------------------------------------------------------------------------------------
# Metric table
# ---------------------------------------------------------------------------------------------


def _metric_rows(metrics: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """(row name, row dict) in the papers' order; unknown sub-tables follow, sorted by name."""
    rows: list[tuple[str, Mapping[str, Any]]] = [("total", metrics)]
    for name in ROW_ORDER[1:]:
        sub = metrics.get(name)
        if isinstance(sub, Mapping):
            rows.append((name, sub))
    known = set(ROW_ORDER)
    for name in sorted(k for k in metrics if k not in known):
        sub = metrics[name]
        # Only sub-dicts that hold scores are rows (not e.g. a config dict someone added).
        if isinstance(sub, Mapping) and any(k in sub for k in _ALL_METRIC_KEYS):
            rows.append((str(name), sub))
    return rows


def _main_metrics(metrics: Mapping[str, Any]) -> list[str]:
    main = metrics.get("main_metrics") or []
    if isinstance(main, str):
        main = [main]
    return [str(m) for m in main]


def _render_metrics(metrics: Mapping[str, Any]) -> str:
    if not metrics:
        return '<p class="empty">No metrics were given.</p>'
    rows = _metric_rows(metrics)
    # S only when SPICE ran (some row has it); the other columns always, as in the papers.
    columns = [
        (label, key) for label, key in TABLE_COLUMNS
        if key != "SPICE" or any("SPICE" in row for _, row in rows)
    ]
    main = set(_main_metrics(metrics))
    out: list[str] = ['<table class="metrics" id="metric-table">', "<thead><tr><th>subset</th>"]
    for label, key in columns:
        cls = ' class="main"' if key in main else ""
        out.append(
            f'<th data-col="{label}" title="{_esc(METRIC_NAMES.get(key, key))}"{cls}>'
            f"{label}</th>"
        )
    out.append('<th data-col="N" title="number of pairs">N</th></tr></thead><tbody>')
    for name, row in rows:
        out.append(f'<tr data-row="{_esc(name)}"><th scope="row">{_esc(name)}</th>')
        for label, key in columns:
            cls = ' class="main"' if key in main else ""
            out.append(f'<td data-col="{label}"{cls}>{_fmt1(row.get(key))}</td>')
        out.append(f'<td data-col="N">{_count(row.get("num_pairs"))}</td></tr>')
    out.append("</tbody></table>")

    facts: list[str] = []
    if metrics.get("dataset"):
        facts.append(f"<dt>dataset</dt><dd>{_esc(metrics['dataset'])}</dd>")
    if main:
        names = ", ".join(_esc(METRIC_NAMES.get(m, m)) for m in _main_metrics(metrics))
        facts.append(f"<dt>main metric(s)</dt><dd>{names}</dd>")
    if metrics.get("protocol"):
        facts.append(f"<dt>protocol</dt><dd>{_esc(metrics['protocol'])}</dd>")
    if facts:
        out.append('<dl class="facts">' + "".join(facts) + "</dl>")
    out.append(
        '<p class="legend">Scores x100. B4 = BLEU-4, M = METEOR 1.5, R = ROUGE-L, '
        "C = CIDEr-D, S = SPICE, N = number of pairs. Each row is scored as its own "
        "COCOEvalCap run (per-subset CIDEr document frequencies).</p>"
    )

    # Every score with two decimals, for readers who need more than the papers' columns.
    present = [k for k in _ALL_METRIC_KEYS if any(k in row for _, row in rows)]
    if present:
        out.append("<details><summary>All scores (2 decimals)</summary>")
        out.append('<table class="metrics all-scores"><thead><tr><th>subset</th>')
        out.extend(f"<th>{_esc(k)}</th>" for k in present)
        out.append("</tr></thead><tbody>")
        for name, row in rows:
            out.append(f"<tr><th scope=\"row\">{_esc(name)}</th>")
            out.extend(f"<td>{_fmt2(row.get(k))}</td>" for k in present)
            out.append("</tr>")
        out.append("</tbody></table></details>")
    return "".join(out)


# ---------------------------------------------------------------------------------------------
# SVG charts
# ---------------------------------------------------------------------------------------------

_W, _H = 360, 240  # chart size in px
_ML, _MR, _MT, _MB = 62, 14, 30, 38  # margins: room for value labels, title, step labels
_MAX_MARKERS = 300  # beyond this many points only the line (and the last point) is drawn


def _nice_step(span: float, target: int) -> float:
    """A 1/2/2.5/5 x 10^k step that cuts ``span`` into about ``target`` intervals."""
    raw = span / max(target, 1)
    mag = 10.0 ** math.floor(math.log10(raw))
    for mult in (1.0, 2.0, 2.5, 5.0, 10.0):
        if mult * mag >= raw:
            return mult * mag
    return 10.0 * mag


def _ticks(lo: float, hi: float, step: float) -> list[float]:
    first = math.ceil(lo / step - 1e-9)
    ticks: list[float] = []
    for i in range(first, first + 60):  # bounded: float rounding can never loop forever
        t = i * step
        if t > hi + step * 1e-9:
            break
        ticks.append(0.0 if abs(t) < step * 1e-9 else t)
    return ticks


def _value_range(values: Sequence[float]) -> tuple[float, float, float]:
    """(lo, hi, tick step) for the y axis: padded when flat, widened to whole ticks."""
    lo, hi = min(values), max(values)
    if hi - lo <= 1e-12 * max(abs(lo), abs(hi), 1e-300):
        # A constant curve still needs a visible axis around it.
        pad = abs(lo) * 0.1 if lo != 0 else 1.0
        lo, hi = lo - pad, hi + pad
    step = _nice_step(hi - lo, 5)
    return math.floor(lo / step + 1e-9) * step, math.ceil(hi / step - 1e-9) * step, step


def _fmt_value_tick(value: float, step: float) -> str:
    if abs(value) >= 1e6 or step < 1e-5:
        return f"{value:.3g}"
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    # A 2.5 x 10^k step needs one more decimal than its power of ten suggests.
    if round(step / 10.0 ** math.floor(math.log10(step) + 1e-9), 6) == 2.5:
        decimals += 1
    return f"{value:.{decimals}f}"


def _fmt_step(step: float) -> str:
    if abs(step) >= 1e6:
        return f"{step / 1e6:g}M"
    if abs(step) >= 1e4:
        return f"{step / 1e3:g}k"
    return f"{step:g}"


def _fmt_value(value: float) -> str:
    return f"{value:.4g}"


def _chart(name: str, points: Sequence[tuple[int, float]]) -> str:
    """One line chart: axes, ticks, title, polyline and point markers."""
    finite = sorted(
        ((float(s), float(v)) for s, v in points if _finite(v) and _finite(s)),
        key=lambda p: p[0],  # stable: equal steps keep their logged order
    )
    skipped = len(points) - len(finite)
    label = _esc(name)
    head = (
        f'<svg class="chart" data-name="{label}" width="{_W}" height="{_H}" '
        f'viewBox="0 0 {_W} {_H}" role="img" aria-label="{label}">'
        f"<title>{label}</title>"
        f'<text class="ctitle" x="{_W / 2:.0f}" y="18" text-anchor="middle">{label}</text>'
    )
    if not finite:
        return (
            head + f'<text class="nodata" x="{_W / 2:.0f}" y="{_H / 2:.0f}" '
            'text-anchor="middle">no finite values</text></svg>'
        )
    steps = [s for s, _ in finite]
    values = [v for _, v in finite]
    x_lo, x_hi = steps[0], steps[-1]
    if x_hi == x_lo:  # a single step: centre it
        x_lo, x_hi = x_lo - 1.0, x_hi + 1.0
    x_step = max(1.0, _nice_step(x_hi - x_lo, 5))  # steps are integers: no fractional ticks
    y_lo, y_hi, y_step = _value_range(values)
    pw, ph = _W - _ML - _MR, _H - _MT - _MB

    def px(s: float) -> float:
        return _ML + (s - x_lo) / (x_hi - x_lo) * pw

    def py(v: float) -> float:
        return _MT + (y_hi - v) / (y_hi - y_lo) * ph

    parts = [head, *_grid_and_axes(px, py, (x_lo, x_hi, x_step), (y_lo, y_hi, y_step))]
    coords = [(px(s), py(v)) for s, v in finite]
    parts.append(
        '<polyline class="line" points="'
        + " ".join(f"{x:.2f},{y:.2f}" for x, y in coords)
        + '"/>'
    )
    # Markers (with hover text) for sparse curves; a dense curve only marks its last point.
    marked = range(len(finite)) if len(finite) <= _MAX_MARKERS else [len(finite) - 1]
    for i in marked:
        (x, y), (s, v) = coords[i], finite[i]
        parts.append(
            f'<circle class="pt" cx="{x:.2f}" cy="{y:.2f}" r="2.5">'
            f"<title>step {s:g}: {_fmt_value(v)}</title></circle>"
        )
    parts.append("</svg>")

    summary = _chart_summary(steps, values, skipped)
    return "".join(parts) + f'<p class="csummary">{_esc(summary)}</p>'


def _grid_and_axes(px: Any, py: Any, x_axis: tuple[float, float, float],
                   y_axis: tuple[float, float, float]) -> list[str]:
    """Horizontal grid lines with value labels, step ticks with labels, the two axes and the
    x label; ``px``/``py`` map a step/value to pixels, each axis is (lo, hi, tick step)."""
    x_lo, x_hi, x_step = x_axis
    parts = _y_grid(py, y_axis, _ML, _W - _MR)
    for t in _ticks(x_lo, x_hi, x_step):
        x = px(t)
        parts.append(
            f'<line class="tick" x1="{x:.2f}" y1="{_H - _MB}" x2="{x:.2f}" y2="{_H - _MB + 5}"/>'
            f'<text class="xtick" x="{x:.2f}" y="{_H - _MB + 18}" text-anchor="middle">'
            f"{_fmt_step(t)}</text>"
        )
    parts.append(_axes((_ML, _MT, _W - _MR, _H - _MB), "step", _H - 4))
    return parts


def _y_grid(py: Any, y_axis: tuple[float, float, float], left: int, right: int) -> list[str]:
    """A grid line with its value label at each y tick; ``y_axis`` is (lo, hi, tick step)."""
    y_lo, y_hi, y_step = y_axis
    parts = []
    for t in _ticks(y_lo, y_hi, y_step):
        y = py(t)
        parts.append(
            f'<line class="grid" x1="{left}" y1="{y:.2f}" x2="{right}" y2="{y:.2f}"/>'
            f'<text class="ytick" x="{left - 6}" y="{y + 4:.2f}" text-anchor="end">'
            f"{_fmt_value_tick(t, y_step)}</text>"
        )
    return parts


def _axes(box: tuple[int, int, int, int], xlabel: str, xlabel_y: int) -> str:
    """The y and x axis of the plot area ``box`` (left, top, right, bottom) and the x label."""
    left, top, right, bottom = box
    return (
        f'<line class="axis" x1="{left}" y1="{top}" x2="{left}" y2="{bottom}"/>'
        f'<line class="axis" x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}"/>'
        f'<text class="xlabel" x="{left + (right - left) / 2:.0f}" y="{xlabel_y}" '
        f'text-anchor="middle">{_esc(xlabel)}</text>'
    )


def _chart_summary(steps: list[float], values: list[float], skipped: int) -> str:
    """The text under a chart: point count, last, min and max with their steps."""
    best_lo = min(range(len(values)), key=lambda i: values[i])
    best_hi = max(range(len(values)), key=lambda i: values[i])
    summary = (
        f"{len(steps)} point{'s' if len(steps) != 1 else ''}; last {_fmt_value(values[-1])} "
        f"@ {steps[-1]:g}; min {_fmt_value(values[best_lo])} @ {steps[best_lo]:g}; "
        f"max {_fmt_value(values[best_hi])} @ {steps[best_hi]:g}"
    )
    if skipped:
        summary += f"; {skipped} non-finite value{'s' if skipped != 1 else ''} skipped"
    return summary


def _render_curves(curves: Mapping[str, Sequence[tuple[int, float]]]) -> str:
    if not curves:
        return '<p class="empty">No logged scalars.</p>'
    # Group by the prefix before the first "/" (train, val, ...) so related charts sit together.
    groups: dict[str, list[str]] = {}
    for name in sorted(curves, key=str):
        prefix = str(name).split("/", 1)[0] if "/" in str(name) else ""
        groups.setdefault(prefix, []).append(name)
    out: list[str] = []
    for prefix in sorted(groups, key=lambda p: (p == "", p)):  # ungrouped names last
        heading = prefix or "other"
        out.append(f'<h3>{_esc(heading)}</h3><div class="charts">')
        for name in groups[prefix]:
            out.append(f'<figure class="chartbox">{_chart(str(name), list(curves[name]))}</figure>')
        out.append("</div>")
    return "".join(out)


def _histogram(ciders: Sequence[float]) -> str:
    """Bar chart of the per-pair CIDEr distribution (all pairs, before truncation)."""
    values = [float(c) for c in ciders if _finite(c)]
    if not values:
        return ""
    lo, hi = min(0.0, min(values)), max(values)  # bins start at 0 (CIDEr is >= 0)
    width = _nice_step(max(hi - lo, 1e-9), 12)  # about a dozen bins up to the best pair
    start = math.floor(lo / width)
    bins = [0] * (math.floor(hi / width) + 1 - start)
    for v in values:
        bins[min(len(bins) - 1, math.floor(v / width) - start)] += 1
    w, h, ml, mb, mt = 420, 170, 40, 34, 24
    pw, ph = w - ml - 10, h - mt - mb
    top = max(bins)
    bw = pw / len(bins)
    parts = [
        f'<svg class="hist" width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img" '
        'aria-label="per-pair CIDEr histogram"><title>per-pair CIDEr histogram</title>'
        f'<text class="ctitle" x="{w / 2:.0f}" y="16" text-anchor="middle">'
        f"per-pair CIDEr ({len(values)} pairs)</text>"
    ]
    for i, count in enumerate(bins):
        bh = count / top * ph
        lo_edge = (start + i) * width
        parts.append(
            f'<rect class="bar" x="{ml + i * bw + 0.5:.2f}" y="{mt + ph - bh:.2f}" '
            f'width="{max(bw - 1, 0.5):.2f}" height="{bh:.2f}">'
            f"<title>[{lo_edge:g}, {lo_edge + width:g}): {count}</title></rect>"
        )
    label_every = max(1, math.ceil(len(bins) / 7))
    for i in range(0, len(bins) + 1, label_every):
        parts.append(
            f'<text class="xtick" x="{ml + i * bw:.2f}" y="{h - mb + 14}" text-anchor="middle">'
            f"{(start + i) * width:g}</text>"
        )
    parts.append(
        f'<text class="ytick" x="{ml - 5}" y="{mt + 4}" text-anchor="end">{top}</text>'
        f'<text class="ytick" x="{ml - 5}" y="{mt + ph + 4}" text-anchor="end">0</text>'
        f'<line class="axis" x1="{ml}" y1="{mt + ph}" x2="{w - 10}" y2="{mt + ph}"/>'
        f'<text class="xlabel" x="{ml + pw / 2:.0f}" y="{h - 4}" text-anchor="middle">'
        "CIDEr x100</text></svg>"
    )
    return "".join(parts)


# ---------------------------------------------------------------------------------------------
# Difficulty-binned evaluation (metrics["difficulty"], see docs/evaluation.md)
# ---------------------------------------------------------------------------------------------

# Streams in display order (any other stream follows, by name) and their colours, set as style
# attributes: the page's CSS stays as it is, so a report without the section keeps its bytes.
_STREAM_ORDER = ("semantic", "distractor")
_STREAM_COLOURS = ("#2763c4", "#d0483e", "#3a9a55", "#8a5cc4", "#e0a030", "#5b6475")
# (bin key, label): the charts, in order; the last two only when some bin carries them.
_BIN_METRICS = (
    ("CIDEr", "CIDEr"), ("METEOR", "METEOR"),
    ("pointing", "pointing"), ("attention_in_box", "attention in box"),
)
_BIN_OPTIONAL = ("pointing", "attention_in_box")
_BIN_PLOT_H = 150  # plot height in px; the chart grows below it with the IoU label lines
_BIN_MT = 44  # top margin: title and legend

_Streams = list[tuple[str, str, list[Mapping[str, Any]]]]  # (name, colour, bins)


def _difficulty_streams(entry: Mapping[str, Any]) -> _Streams:
    """(stream, colour, bins hardest first) in display order; non-bins are dropped."""
    bins = entry.get("bins")
    if not isinstance(bins, Mapping):
        return []
    names = [n for n in _STREAM_ORDER if n in bins]
    names += sorted(str(n) for n in bins if n not in _STREAM_ORDER)
    out: _Streams = []
    for name in names:
        rows = bins[name]
        if isinstance(rows, Sequence) and not isinstance(rows, str):
            kept = [b for b in rows if isinstance(b, Mapping)]
            if kept:
                out.append((name, _STREAM_COLOURS[len(out) % len(_STREAM_COLOURS)], kept))
    return out


def _iou_label(bin_: Mapping[str, Any]) -> str:
    return f"{_fmt2(bin_.get('iou_low'))}-{_fmt2(bin_.get('iou_high'))}"


def _bin_keys(streams: _Streams) -> list[tuple[str, str]]:
    """The (key, label) of the metrics shown: CIDEr, METEOR, then pointing ones if present."""
    return [
        (key, label) for key, label in _BIN_METRICS
        if key not in _BIN_OPTIONAL or any(key in b for _, _, bins in streams for b in bins)
    ]


def _difficulty_table(streams: _Streams, keys: list[tuple[str, str]]) -> str:
    """One row per stream and bin: IoU range, pairs and the shown metrics (one decimal)."""
    out = ['<table class="metrics" id="difficulty-table"><thead><tr>'
           '<th data-col="stream">stream</th><th data-col="bin">bin</th>'
           '<th data-col="IoU" title="viewpoint IoU range of the bin">IoU</th>'
           '<th data-col="pairs">pairs</th>']
    out.extend(f'<th data-col="{_esc(key)}">{_esc(label)}</th>' for key, label in keys)
    out.append("</tr></thead><tbody>")
    for name, _, bins in streams:
        for i, bin_ in enumerate(bins):
            out.append(
                f'<tr data-stream="{_esc(name)}" data-bin="{i}"><th scope="row">{_esc(name)}</th>'
                f'<td data-col="bin">{i + 1}</td><td data-col="IoU">{_iou_label(bin_)}</td>'
                f'<td data-col="pairs">{_count(bin_.get("num_pairs"))}</td>'
            )
            out.extend(f'<td data-col="{_esc(k)}">{_fmt1(bin_.get(k))}</td>' for k, _ in keys)
            out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _bin_labels(streams: _Streams) -> list[list[tuple[str, str]]]:
    """Per x-axis line, (text, colour) per bin: one line when every stream has the same IoU
    ranges, else one line per stream in its colour (each stream is binned on its own IoUs)."""
    n = max(len(bins) for _, _, bins in streams)
    per_stream = [[_iou_label(b) for b in bins] + [""] * (n - len(bins)) for _, _, bins in streams]
    if all(labels == per_stream[0] for labels in per_stream):
        return [[(text, "") for text in per_stream[0]]]
    return [[(text, colour) for text in labels]
            for (_, colour, _), labels in zip(streams, per_stream, strict=True)]


def _legend(streams: _Streams) -> str:
    parts, x = [], float(_ML)
    for name, colour, _ in streams:
        parts.append(
            f'<line x1="{x:.0f}" y1="30" x2="{x + 16:.0f}" y2="30" '
            f'style="stroke:{colour};stroke-width:2"/>'
            f'<text class="lgd" x="{x + 20:.0f}" y="34">{_esc(name)}</text>'
        )
        x += 32 + 6.5 * len(name)
    return "".join(parts)


def _bin_series(px: Any, py: Any, name: str, colour: str, values: list[float | None],
                tips: list[str]) -> list[str]:
    """One stream's line (broken where a bin has no value) and its point markers."""
    parts, run = [], []
    for i, v in enumerate([*values, None]):  # the sentinel closes the last run
        if v is not None:
            run.append(f"{px(i):.2f},{py(v):.2f}")
            continue
        if len(run) > 1:
            parts.append(f'<polyline class="bline" data-stream="{_esc(name)}" '
                         f'style="fill:none;stroke:{colour};stroke-width:1.6" '
                         f'points="{" ".join(run)}"/>')
        run = []
    for i, v in enumerate(values):
        if v is not None:
            parts.append(
                f'<circle class="bpt" data-stream="{_esc(name)}" data-bin="{i}" '
                f'cx="{px(i):.2f}" cy="{py(v):.2f}" r="3" style="fill:{colour}">'
                f"<title>{_esc(tips[i])}: {_fmt_value(v)}</title></circle>"
            )
    return parts


def _bin_chart(key: str, label: str, streams: _Streams) -> str:
    """One metric against the bins (categorical x, hardest left), a line per stream that has
    a value for it (so e.g. the pointing charts show only the streams with boxes)."""
    values = {name: [float(b[key]) if _finite(b.get(key)) else None for b in bins]
              for name, _, bins in streams}
    shown = [s for s in streams if any(v is not None for v in values[s[0]])]
    lines = _bin_labels(shown or streams)
    bottom = _BIN_MT + _BIN_PLOT_H
    height = bottom + 14 * len(lines) + 22
    title = _esc(f"{label} (x100)")
    head = (
        f'<svg class="binchart" data-name="{_esc(key)}" width="{_W}" height="{height}" '
        f'viewBox="0 0 {_W} {height}" role="img" aria-label="{title}"><title>{title}</title>'
        f'<text class="ctitle" x="{_W / 2:.0f}" y="16" text-anchor="middle">{title}</text>'
    )
    if not shown:
        return (head + f'<text class="nodata" x="{_W / 2:.0f}" y="{height / 2:.0f}" '
                'text-anchor="middle">no finite values</text></svg>')
    y_lo, y_hi, y_step = _value_range([v for vals in values.values() for v in vals
                                       if v is not None])
    band = (_W - _ML - _MR) / len(lines[0])

    def px(i: float) -> float:
        return _ML + (i + 0.5) * band

    def py(v: float) -> float:
        return _BIN_MT + (y_hi - v) / (y_hi - y_lo) * _BIN_PLOT_H

    parts = [head, _legend(shown), *_y_grid(py, (y_lo, y_hi, y_step), _ML, _W - _MR)]
    for row, labels in enumerate(lines):
        for i, (text, colour) in enumerate(labels):
            style = f' style="fill:{colour}"' if colour else ""
            parts.append(f'<text class="xtick" x="{px(i):.2f}" y="{bottom + 14 * (row + 1)}" '
                         f'text-anchor="middle"{style}>{_esc(text)}</text>')
    parts.append(_axes((_ML, _BIN_MT, _W - _MR, bottom), "viewpoint IoU bin (hardest left)",
                       height - 5))
    for name, colour, bins in shown:
        tips = [f"{name}, IoU {_iou_label(b)}, {_count(b.get('num_pairs'))} pairs, {label}"
                for b in bins]
        parts += _bin_series(px, py, name, colour, values[name], tips)
    parts.append("</svg>")
    return "".join(parts)


def _difficulty_note(entry: Mapping[str, Any]) -> str:
    """What the bins are, and the overall pointing-game numbers."""
    measure = str(entry.get("measure", ""))
    n = entry.get("num_bins")
    count = f"{int(n)} " if _finite(n) else ""  # type: ignore[arg-type]
    if measure == "viewpoint_iou":
        text = (f"Pairs in {count}quantile bins of their viewpoint IoU (the overlap of the "
                "objects' boxes between the two images; lower = larger viewpoint change = "
                "harder), each stream binned on its own, hardest bin first.")
    else:
        text = f"Pairs in {count}quantile bins of {measure or 'an unnamed measure'}."
    pointing = entry.get("pointing")
    if isinstance(pointing, Mapping):
        text += (
            f" Pointing game over {_count(pointing.get('num_pairs'))} semantic pairs with a "
            f"changed-object box ({_count(pointing.get('num_boxes'))} boxes; "
            f"{_count(pointing.get('pairs_without_change_words'))} pairs without change words "
            f"left out): pointing {_fmt1(pointing.get('pointing'))}, attention in box "
            f"{_fmt1(pointing.get('attention_in_box'))} (x100)."
        )
    else:
        text += " No changed-object boxes: no pointing game."
    return f'<p class="legend" id="difficulty-note">{_esc(text)}</p>'


def _render_difficulty(entry: Mapping[str, Any]) -> str:
    """The section body: note, table and one chart per metric."""
    streams = _difficulty_streams(entry)
    if not streams:
        return _difficulty_note(entry) + '<p class="empty">No bins were given.</p>'
    keys = _bin_keys(streams)
    charts = "".join(f'<figure class="chartbox">{_bin_chart(key, label, streams)}</figure>'
                     for key, label in keys)
    return (_difficulty_note(entry) + _difficulty_table(streams, keys)
            + f'<div class="charts">{charts}</div>')


# ---------------------------------------------------------------------------------------------
# Gallery
# ---------------------------------------------------------------------------------------------


def _cider_key(entry: GalleryEntry) -> tuple[bool, float]:
    # NaN CIDEr (should not happen) sorts after every real score in both directions.
    c = float(entry.cider) if _is_number(entry.cider) else math.nan
    return (math.isnan(c), c)


def _type_value(change_type: str) -> str:
    return change_type if change_type else _NO_TYPE


def _type_label(change_type: str) -> str:
    return change_type if change_type else "(none)"


def _cider_class(cider: float) -> str:
    if not _finite(cider):
        return "c-nan"
    return "c-low" if cider < 50 else "c-mid" if cider < 100 else "c-high"


def _card(entry: GalleryEntry, ranks: Mapping[str, int]) -> str:
    cider = float(entry.cider) if _is_number(entry.cider) else math.nan
    attrs = " ".join(
        [
            'class="card ' + _cider_class(cider) + '"',
            f'data-id="{_esc(entry.image_id)}"',
            f'data-type="{_esc(_type_value(entry.change_type))}"',
            f'data-cider="{cider!r}"',
            *(f'data-rank-{key.replace("_", "-")}="{rank}"' for key, rank in ranks.items()),
        ]
    )
    out = [f"<article {attrs}>"]
    out.append(
        '<header><span class="iid">' + _esc(entry.image_id) + "</span>"
        f'<span class="ctype">{_esc(_type_label(entry.change_type))}</span>'
        f'<span class="cider" title="per-pair CIDEr x100">CIDEr {_fmt1(cider)}</span></header>'
    )
    if entry.images:
        out.append('<div class="imgs">')
        for name, data in entry.images.items():
            mime = _image_mime(bytes(data))
            if mime is None:  # a format browsers may not show: say so rather than break the page
                out.append(
                    f'<figure><div class="noimg">unrecognised image format</div>'
                    f"<figcaption>{_esc(name)}</figcaption></figure>"
                )
                continue
            b64 = base64.b64encode(bytes(data)).decode("ascii")
            out.append(
                f'<figure><img src="data:{mime};base64,{b64}" alt="{_esc(name)}">'
                f"<figcaption>{_esc(name)}</figcaption></figure>"
            )
        out.append("</div>")
    out.append(f'<p class="gen"><b>generated:</b> {_esc(entry.caption)}</p>')
    if entry.extra:
        out.append('<dl class="extra">')
        for key, text in entry.extra.items():
            out.append(f"<dt>{_esc(key)}</dt><dd>{_esc(text)}</dd>")
        out.append("</dl>")
    out.append(
        f'<p class="refhead"><b>references</b> ({len(entry.references)}):</p><ol class="refs">'
    )
    out.extend(f"<li>{_esc(ref)}</li>" for ref in entry.references)
    out.append("</ol></article>")
    return "".join(out)


def _type_order(types: set[str]) -> list[str]:
    known = [t for t in (NO_CHANGE, *CHANGE_TYPES) if t in types]
    others = sorted(t for t in types if t and t not in known)
    return known + others + ([""] if "" in types else [])


def _render_gallery(gallery: Sequence[GalleryEntry], max_gallery: int | None) -> str:
    if not gallery:
        return '<p class="empty">No pairs to show.</p>'
    ordered = sorted(gallery, key=lambda e: (*_cider_key(e), _natural_key(str(e.image_id))))
    shown = ordered if max_gallery is None else ordered[:max_gallery]
    left_out = len(ordered) - len(shown)

    # Python fixes all three orders once, so the script only sorts by an integer per card
    # and cannot disagree with the HTML's own (worst-first) order.
    def desc_key(i: int) -> tuple[bool, float, tuple[tuple[int, int, str], ...]]:
        is_nan, c = _cider_key(shown[i])
        return (is_nan, 0.0 if is_nan else -c, _natural_key(str(shown[i].image_id)))

    by_desc = sorted(range(len(shown)), key=desc_key)
    by_id = sorted(range(len(shown)), key=lambda i: _natural_key(str(shown[i].image_id)))
    rank_desc = {idx: r for r, idx in enumerate(by_desc)}
    rank_id = {idx: r for r, idx in enumerate(by_id)}

    out = [_histogram([e.cider for e in gallery])]
    summary = f"{len(gallery)} pair{'s' if len(gallery) != 1 else ''}"
    if left_out:
        summary += (
            f"; showing the {len(shown)} with the lowest CIDEr, {left_out} "
            f"pair{'s' if left_out != 1 else ''} with higher CIDEr left out "
            f"(max_gallery={max_gallery})"
        )
        out.append(f'<p class="truncated" id="gallery-truncated">{_esc(summary)}.</p>')
    else:
        out.append(f'<p class="gsummary">{_esc(summary)}, worst CIDEr first.</p>')

    types = _type_order({e.change_type for e in shown})
    controls = ['<div id="gallery-controls" class="controls" hidden>',
                '<label>sort <select id="sort-select">']
    controls.extend(f'<option value="{k}">{_esc(_SORT_LABELS[k])}</option>' for k in SORT_KEYS)
    controls.append("</select></label>")
    if len(types) > 1 or (types and types[0] != ""):
        counts = {t: sum(1 for e in shown if e.change_type == t) for t in types}
        controls.append(f'<label>change type <select id="type-select"><option value="{_ALL_TYPES}">'
                        f"all ({len(shown)})</option>")
        controls.extend(
            f'<option value="{_esc(_type_value(t))}">{_esc(_type_label(t))} ({counts[t]})</option>'
            for t in types
        )
        controls.append("</select></label>")
    controls.append('<span id="shown-count"></span></div>')
    out.append("".join(controls))
    out.append(
        "<noscript><p>JavaScript is off: pairs are listed worst CIDEr first, without sorting or "
        "filtering.</p></noscript>"
    )
    out.append('<div id="gallery" class="gallery">')
    for i, entry in enumerate(shown):
        ranks = {"cider_asc": i, "cider_desc": rank_desc[i], "image_id": rank_id[i]}
        out.append(_card(entry, ranks))
    out.append("</div>")
    return "".join(out)


# ---------------------------------------------------------------------------------------------
# Page
# ---------------------------------------------------------------------------------------------

# Only inline style / script and data: images may load: the browser enforces "self-contained".
_CSP = (
    "default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'"
)

# The page's style and its sort/filter script (which applies the sort / filter named in the URL
# fragment or query, keeps the fragment in step with the controls so that a view can be shared,
# and sorts by the ranks Python wrote on each card), inlined into every page.
_ASSETS = importlib.resources.files("changecap_jax.commands") / "report_assets"
_CSS = "\n" + (_ASSETS / "report.css").read_text(encoding="utf-8")
_JS = "\n" + (_ASSETS / "report.js").read_text(encoding="utf-8")


def render_report(
    *,
    title: str,
    metrics: Mapping[str, Any],
    curves: Mapping[str, Sequence[tuple[int, float]]],
    gallery: Sequence[GalleryEntry],
    notes: Sequence[str] | None = None,
    max_gallery: int | None = 500,
) -> str:
    """The whole report page as one HTML string.

    Args:
        title: page title and heading.
        metrics: an :func:`changecap_jax.evaluators.captions.evaluate_pairs` result (scores x100,
        per-row
            sub-dicts, optional ``dataset`` / ``main_metrics`` / ``protocol`` and the
            difficulty-binned ``difficulty`` entry, shown in its own section); may be empty.
        curves: scalar name -> [(step, value), ...]; non-finite values are skipped.
        gallery: per-pair entries, in any order (the page shows them worst CIDEr first).
        notes: free text lines shown under the title (e.g. checkpoint, split, date).
        max_gallery: keep only this many lowest-CIDEr entries (None: all); the page says how
            many were left out.

    Returns:
        The HTML document (no external references; deterministic for the same input).
    """
    if max_gallery is not None and max_gallery < 0:
        raise ValueError(f"max_gallery must be >= 0 or None, got {max_gallery}")
    difficulty = metrics.get("difficulty") if metrics else None
    if not isinstance(difficulty, Mapping):
        difficulty = None
    head = (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_esc(title)}</title><style>{_CSS}</style></head>\n"
    )
    body = [
        f'<body data-sort="{SORT_KEYS[0]}"><header><h1>{_esc(title)}</h1>',
        '<nav><a href="#metrics">Metrics</a>'
        + ('<a href="#difficulty">Difficulty</a>' if difficulty is not None else "")
        + '<a href="#curves">Training curves</a><a href="#pairs">Pairs</a></nav>',
    ]
    if notes:
        body.append('<ul class="notes">' + "".join(f"<li>{_esc(n)}</li>" for n in notes) + "</ul>")
    body.append("</header>\n")
    body.append(f'<section id="metrics"><h2>Metrics</h2>{_render_metrics(metrics)}</section>\n')
    if difficulty is not None:
        body.append('<section id="difficulty"><h2>Difficulty: viewpoint change</h2>'
                    f"{_render_difficulty(difficulty)}</section>\n")
    body.append(
        f'<section id="curves"><h2>Training curves</h2>{_render_curves(curves)}</section>\n'
    )
    body.append(
        f'<section id="pairs"><h2>Pairs</h2>{_render_gallery(gallery, max_gallery)}</section>\n'
    )
    body.append(f"<script>{_JS}</script>\n</body></html>\n")
    return head + "".join(body)


def write_report(
    path: str | os.PathLike[str],
    *,
    title: str,
    metrics: Mapping[str, Any],
    curves: Mapping[str, Sequence[tuple[int, float]]],
    gallery: Sequence[GalleryEntry],
    notes: Sequence[str] | None = None,
    max_gallery: int | None = 500,
) -> paths.AnyPath:
    """Render the report (see :func:`render_report`) and write it atomically to ``path``.

    The page is written to a temp file in the same directory and moved into place with
    ``os.replace``, so a crash never leaves a half-written report. Returns the path.
    """
    page = render_report(
        title=title, metrics=metrics, curves=curves, gallery=gallery, notes=notes,
        max_gallery=max_gallery,
    )
    path = paths.path(path)
    atomic_write(path, lambda fh: fh.write(page))
    return path
