"""Tests for the report's "Difficulty: viewpoint change" section
(changecap_jax.commands.report_html),
rendered from a metrics file's ``difficulty`` entry (docs/evaluation.md, docs/inference.md).

The page is parsed with the DOM helper of test_report_html; the charts are checked on their SVG
coordinates (points ordered by bin, drawn higher for larger values).
"""

from __future__ import annotations

import copy

from test_report_html import CURVES, METRICS, Node, make_gallery, parse

from changecap_jax.commands.report_html import render_report

DASH = "\u2013"


def a_bin(low: float, high: float, n: int, cider: float, meteor: float,
          pointing: float | None = None, in_box: float | None = None,
          boxes: bool = True) -> dict:
    out = {"iou_low": low, "iou_high": high, "num_pairs": n, "Bleu_1": 70.0, "Bleu_2": 60.0,
           "Bleu_3": 50.0, "Bleu_4": 40.0, "METEOR": meteor, "ROUGE_L": 65.0, "CIDEr": cider}
    if boxes:
        out.update(pointing=pointing, attention_in_box=in_box, num_boxes=2 * n)
    return out


# Distractor first on purpose: the page puts semantic first. Semantic CIDEr falls then rises
# (not monotone in the bin) so the y check below is not a mere ordering check.
DIFFICULTY = {
    "measure": "viewpoint_iou",
    "num_bins": 3,
    "bins": {
        "distractor": [a_bin(0.05, 0.3, 9, 101.25, 41.04, boxes=False),
                       a_bin(0.3, 0.6, 9, 110.0, 42.0, boxes=False),
                       a_bin(0.6, 0.9, 8, 130.5, 44.44, boxes=False)],
        "semantic": [a_bin(0.123, 0.346, 10, 80.04, 30.14, 40.0, 21.26),
                     a_bin(0.346, 0.6789, 10, 55.55, 33.3, None, 25.0),
                     a_bin(0.6789, 0.95, 11, 97.96, 36.0, 72.73, None)],
    },
    "pointing": {"pointing": 56.26, "attention_in_box": 23.06, "num_boxes": 62,
                 "num_pairs": 31, "pairs_without_change_words": 3},
}


def render(difficulty: dict | None = DIFFICULTY) -> str:
    metrics = dict(METRICS)
    if difficulty is not None:
        metrics["difficulty"] = difficulty
    return render_report(title="CLEVR-Change test", metrics=metrics, curves=CURVES,
                         gallery=make_gallery(3), notes=["checkpoint step 3000"])


def bin_charts(root: Node) -> dict[str, Node]:
    return {svg.attrs["data-name"]: svg for svg in root.iter("svg")
            if "binchart" in svg.classes()}


def table_rows(root: Node) -> list[dict[str, str]]:
    table = root.find("table", id="difficulty-table")
    rows = []
    for tr in table.find("tbody").iter("tr"):
        cells = {"stream": tr.find("th").text, "bin_index": tr.attrs["data-bin"]}
        cells.update({td.attrs["data-col"]: td.text for td in tr.iter("td")})
        rows.append(cells)
    return rows


def test_table_one_row_per_stream_and_bin_with_formatted_values():
    rows = table_rows(parse(render()))
    assert len(rows) == 6
    assert [(r["stream"], r["bin"]) for r in rows] == [
        ("semantic", "1"), ("semantic", "2"), ("semantic", "3"),
        ("distractor", "1"), ("distractor", "2"), ("distractor", "3"),
    ]
    assert [r["IoU"] for r in rows[:3]] == ["0.12-0.35", "0.35-0.68", "0.68-0.95"]
    assert rows[0] == {"stream": "semantic", "bin_index": "0", "bin": "1", "IoU": "0.12-0.35",
                       "pairs": "10", "CIDEr": "80.0", "METEOR": "30.1", "pointing": "40.0",
                       "attention_in_box": "21.3"}
    # None (no boxes / no change words in the bin) and a stream without boxes: dashes.
    assert rows[1]["pointing"] == DASH and rows[1]["attention_in_box"] == "25.0"
    assert rows[2]["pointing"] == "72.7" and rows[2]["attention_in_box"] == DASH
    assert rows[5]["CIDEr"] == "130.5" and rows[5]["METEOR"] == "44.4"
    assert rows[5]["pointing"] == DASH and rows[5]["attention_in_box"] == DASH


def test_one_chart_per_metric_with_iou_labels_and_legend():
    root = parse(render())
    charts = bin_charts(root)
    assert list(charts) == ["CIDEr", "METEOR", "pointing", "attention_in_box"]
    cider = charts["CIDEr"]
    labels = [t.text for t in cider.iter("text") if "xtick" in t.classes()]
    # The streams are binned on their own IoUs: one label line per stream, semantic first.
    assert labels == ["0.12-0.35", "0.35-0.68", "0.68-0.95", "0.05-0.30", "0.30-0.60",
                      "0.60-0.90"]
    assert [t.text for t in cider.iter("text") if "lgd" in t.classes()] == [
        "semantic", "distractor"]
    assert any("ytick" in t.classes() for t in cider.iter("text"))
    # Only the semantic stream has pointing values: the distractor is neither drawn nor listed.
    pointing = charts["pointing"]
    assert {c.attrs["data-stream"] for c in pointing.iter("circle")} == {"semantic"}
    assert [t.text for t in pointing.iter("text") if "lgd" in t.classes()] == ["semantic"]
    assert [t.text for t in pointing.iter("text") if "xtick" in t.classes()] == [
        "0.12-0.35", "0.35-0.68", "0.68-0.95"]


def test_chart_points_ordered_by_bin_and_higher_for_larger_values():
    charts = bin_charts(parse(render()))
    for key in ("CIDEr", "METEOR", "pointing", "attention_in_box"):
        for stream, bins in DIFFICULTY["bins"].items():
            expected = [(i, b[key]) for i, b in enumerate(bins) if b.get(key) is not None]
            circles = [c for c in charts[key].iter("circle") if c.attrs["data-stream"] == stream]
            assert [int(c.attrs["data-bin"]) for c in circles] == [i for i, _ in expected]
            xs = [float(c.attrs["cx"]) for c in circles]
            ys = [float(c.attrs["cy"]) for c in circles]
            assert all(a < b for a, b in zip(xs, xs[1:], strict=False)), (key, stream)
            for (_, v1), (_, v2), y1, y2 in zip(expected, expected[1:], ys, ys[1:],
                                                strict=False):
                assert (v2 > v1) == (y2 < y1), (key, stream)
    # Across streams too: the same scale (distractor CIDEr 130.5 is the highest point).
    cider = charts["CIDEr"]
    top = min(cider.iter("circle"), key=lambda c: float(c.attrs["cy"]))
    assert (top.attrs["data-stream"], top.attrs["data-bin"]) == ("distractor", "2")
    # A missing value breaks the line: semantic pointing has bins 1 and 3 only, no segment.
    assert not [p for p in charts["pointing"].iter("polyline")]
    lines = [p for p in cider.iter("polyline") if p.attrs["data-stream"] == "semantic"]
    assert len(lines) == 1 and len(lines[0].attrs["points"].split()) == 3


def test_metric_without_finite_values_says_so():
    difficulty = copy.deepcopy(DIFFICULTY)
    for b in difficulty["bins"]["semantic"]:
        b["pointing"] = None
    svg = bin_charts(parse(render(difficulty)))["pointing"]
    assert "no finite values" in svg.text
    assert not svg.find_all("circle") and not svg.find_all("polyline")


def test_note_says_what_the_bins_are_and_the_pointing_numbers():
    note = parse(render()).find("p", id="difficulty-note").text
    assert "3 quantile bins" in note and "viewpoint IoU" in note and "lower" in note
    assert "harder" in note
    assert "31 semantic pairs" in note and "62 boxes" in note and "3 pairs without" in note
    assert "pointing 56.3" in note
    assert "attention in box 23.1" in note


def test_without_boxes_no_pointing_columns_or_charts():
    difficulty = copy.deepcopy(DIFFICULTY)
    del difficulty["pointing"]
    for bins in difficulty["bins"].values():
        for b in bins:
            for key in ("pointing", "attention_in_box", "num_boxes"):
                b.pop(key, None)
    root = parse(render(difficulty))
    assert list(bin_charts(root)) == ["CIDEr", "METEOR"]
    assert "pointing" not in table_rows(root)[0]
    assert "no pointing game" in root.find("p", id="difficulty-note").text


def test_no_section_without_the_entry_and_nothing_else_changes():
    with_entry, without = render(), render(None)
    assert 'id="difficulty' not in without and "binchart" not in without
    assert 'href="#difficulty"' not in without
    root = parse(with_entry)
    assert root.find("section", id="difficulty").find("h2").text == (
        "Difficulty: viewpoint change")
    # The section sits right after the metric table's section...
    ids = [s.attrs.get("id") for s in root.iter("section")]
    assert ids == ["metrics", "difficulty", "curves", "pairs"]
    # ...and, with it and its nav link cut out, the page is the page without the entry.
    start = with_entry.index('<section id="difficulty">')
    end = with_entry.index("</section>\n", start) + len("</section>\n")
    cut = with_entry[:start] + with_entry[end:]
    assert cut.replace('<a href="#difficulty">Difficulty</a>', "", 1) == without
    # The entry is no row of the metric table.
    assert 'data-row="difficulty"' not in with_entry


def test_shared_ranges_one_label_line_and_odd_entries():
    shared = [a_bin(0.1, 0.5, 4, 50.0, 20.0, boxes=False), a_bin(0.5, 0.9, 4, 60.0, 25.0,
                                                               boxes=False)]
    difficulty = {"measure": "viewpoint_iou", "num_bins": 2,
                  "bins": {"semantic": shared, "<odd> stream": copy.deepcopy(shared)}}
    page = render(difficulty)
    assert "<odd> stream" not in page and "&lt;odd&gt; stream" in page
    cider = bin_charts(parse(page))["CIDEr"]
    ticks = [t for t in cider.iter("text") if "xtick" in t.classes()]
    assert [t.text for t in ticks] == ["0.10-0.50", "0.50-0.90"]  # one line, both streams
    assert all("style" not in t.attrs for t in ticks)
    # A malformed entry (no bins) still renders the section and the rest of the page.
    root = parse(render({"measure": "viewpoint_iou", "bins": None}))
    assert "No bins were given" in root.find("section", id="difficulty").text
    assert root.find("table", id="metric-table")
