"""Tests for changecap_jax.commands.report_html (the self-contained HTML evaluation report).

Structure is checked on the HTML string with :mod:`html.parser`; the browser tests open a written
report in headless Chromium (skipped when no Chromium binary is installed) to check that the page
renders, that the sort script runs and that a screenshot is a real picture.
"""

from __future__ import annotations

import base64
import io
import math
import os
import random
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest
from PIL import Image, ImageDraw

from changecap_jax.commands.report_html import GalleryEntry, render_report, write_report

# ---------------------------------------------------------------------------------------------
# A small DOM built with html.parser
# ---------------------------------------------------------------------------------------------

_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
         "track", "wbr"}


@dataclass
class Node:
    tag: str
    attrs: dict[str, str]
    children: list[Node] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)

    def iter(self, tag: str | None = None):
        if tag is None or self.tag == tag:
            yield self
        for child in self.children:
            yield from child.iter(tag)

    def find_all(self, tag: str, **attrs: str) -> list[Node]:
        return [
            n for n in self.iter(tag)
            if all(n.attrs.get(k.replace("_", "-")) == v for k, v in attrs.items())
        ]

    def find(self, tag: str, **attrs: str) -> Node:
        found = self.find_all(tag, **attrs)
        assert found, f"no <{tag}> with {attrs}"
        return found[0]

    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    @property
    def text(self) -> str:
        return "".join(self.text_parts) + "".join(c.text for c in self.children)


class _TreeBuilder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("#root", {})
        self.stack = [self.root]

    def handle_starttag(self, tag, attrs):
        node = Node(tag, {k: v if v is not None else "" for k, v in attrs})
        self.stack[-1].children.append(node)
        if tag not in _VOID:
            self.stack.append(node)

    def handle_startendtag(self, tag, attrs):  # <line .../> in SVG
        self.stack[-1].children.append(Node(tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag):
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data):
        # Text goes into a child node so the order of text and elements is kept.
        self.stack[-1].children.append(Node("#text", {}, text_parts=[data]))


def parse(page: str) -> Node:
    builder = _TreeBuilder()
    builder.feed(page)
    builder.close()
    return builder.root


def metric_table(root: Node) -> tuple[list[str], dict[str, dict[str, str]]]:
    """(row names in order, row -> column label -> cell text) of the papers' table."""
    table = root.find("table", id="metric-table")
    cols = [th.attrs["data-col"] for th in table.find("thead").iter("th") if "data-col" in th.attrs]
    order: list[str] = []
    cells: dict[str, dict[str, str]] = {}
    for tr in table.find("tbody").iter("tr"):
        name = tr.attrs["data-row"]
        order.append(name)
        cells[name] = {td.attrs["data-col"]: td.text.strip() for td in tr.iter("td")}
        assert list(cells[name]) == cols
    return order, cells


def polyline_points(svg: Node) -> list[tuple[float, float]]:
    points = svg.find("polyline").attrs["points"].split()
    return [(float(x), float(y)) for x, y in (p.split(",") for p in points)]


def cards(root: Node) -> list[Node]:
    return [n for n in root.iter("article") if "card" in n.classes()]


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def make_png(seed: int, size: tuple[int, int] = (64, 48)) -> bytes:
    """A small real PNG with a few coloured shapes (different for each seed)."""
    rng = random.Random(seed)
    img = Image.new("RGB", size, (235, 236, 240))
    draw = ImageDraw.Draw(img)
    for _ in range(3):
        x, y = rng.randrange(0, size[0] - 16), rng.randrange(0, size[1] - 16)
        colour = (rng.randrange(256), rng.randrange(256), rng.randrange(256))
        if rng.random() < 0.5:
            draw.rectangle([x, y, x + 14, y + 14], fill=colour)
        else:
            draw.ellipse([x, y, x + 15, y + 15], fill=colour)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def row(cider: float, n: int, spice: bool = True) -> dict:
    out = {"Bleu_1": 81.0, "Bleu_2": 70.25, "Bleu_3": 61.5, "Bleu_4": 54.349, "METEOR": 40.05,
           "ROUGE_L": 72.96, "CIDEr": cider, "num_pairs": n}
    if spice:
        out["SPICE"] = 33.333
    return out


METRICS = {
    **row(85.604, 30),
    "semantic": row(70.04, 25),
    "no_change": row(121.96, 5),
    "color": row(60.0, 5),
    "add": row(88.88, 10),
    "move": row(40.0, 10),
    "dataset": "clevr_change",
    "main_metrics": ["CIDEr"],
    "protocol": "official test pairs & <all> references",
}

TYPES = ("color", "add", "move", "no_change", "color", "add")


def make_gallery(n: int = 12, images: bool = True) -> list[GalleryEntry]:
    entries = []
    for i in range(n):
        entries.append(
            GalleryEntry(
                image_id=f"{i:06d}.png",
                caption=f"the red cube moved {i}",
                references=[f"the red cube moved {i}", "a cube changed its place"],
                change_type=TYPES[i % len(TYPES)],
                cider=float((i * 53) % 97) + 0.5,  # distinct, not in id order
                images={"before": make_png(2 * i), "after": make_png(2 * i + 1)} if images else {},
                extra={"retrieved entities": "cube, sphere"} if i % 4 == 0 else {},
            )
        )
    random.Random(0).shuffle(entries)  # input order must not matter
    return entries


CURVES = {
    "train/loss": [(s, 4.0 * math.exp(-s / 800) + 0.2) for s in range(0, 3000, 100)],
    "train/cap": [(s, math.nan if s % 500 == 0 else 3.0 - s / 2000) for s in range(0, 3000, 100)],
    "val/CIDEr": [(1000, 50.0)],
    "val/BLEU4": [(1000, 30.0), (2000, 30.0), (3000, 30.0)],
    "lr": [(2000, 1e-4), (0, 3e-4), (1000, 2e-4)],  # out of step order on purpose
}


def render(**overrides) -> str:
    kwargs = {"title": "CLEVR-Change test", "metrics": METRICS, "curves": CURVES,
              "gallery": make_gallery(), "notes": ["checkpoint step 3000"]}
    kwargs.update(overrides)
    return render_report(**kwargs)


# ---------------------------------------------------------------------------------------------
# Structure
# ---------------------------------------------------------------------------------------------


def test_metric_table_rows_and_values():
    root = parse(render())
    order, cells = metric_table(root)
    assert order == ["total", "semantic", "no_change", "color", "add", "move"]
    total = cells["total"]
    assert list(total) == ["B4", "M", "R", "C", "S", "N"]
    assert total == {"B4": "54.3", "M": "40.0", "R": "73.0", "C": "85.6", "S": "33.3", "N": "30"}
    assert cells["no_change"]["C"] == "122.0"
    assert cells["add"]["C"] == "88.9" and cells["add"]["N"] == "10"
    facts = root.find("dl").text
    assert "clevr_change" in facts and "CIDEr-D" in facts
    assert "official test pairs & <all> references" in facts  # unescaped by the parser


def test_metric_table_without_spice_or_types():
    metrics = row(12.345, 7, spice=False)
    _, cells = metric_table(parse(render(metrics=metrics)))
    assert cells == {"total": {"B4": "54.3", "M": "40.0", "R": "73.0", "C": "12.3", "N": "7"}}
    assert "No metrics were given" in render(metrics={})


def test_curves_one_point_per_finite_value_monotone_in_step():
    root = parse(render())
    charts = {svg.attrs["data-name"]: svg for svg in root.find_all("svg") if "chart" in
              svg.classes()}
    assert sorted(charts) == sorted(CURVES)
    for name, points in CURVES.items():
        finite = sorted((s, v) for s, v in points if math.isfinite(v))
        coords = polyline_points(charts[name])
        assert len(coords) == len(finite), name
        xs = [x for x, _ in coords]
        assert all(a < b for a, b in zip(xs, xs[1:], strict=False)), name
        # Larger values are drawn higher (smaller y) on a non-constant curve.
        ys = [y for _, y in coords]
        for (_, v1), (_, v2), y1, y2 in zip(finite, finite[1:], ys, ys[1:], strict=False):
            if v1 != v2:
                assert (v2 > v1) == (y2 < y1), name
        assert charts[name].find("title").text == name
        tick_labels = [t for t in charts[name].iter("text") if t.classes() & {"xtick", "ytick"}]
        assert {"xtick", "ytick"} <= set().union(*(t.classes() for t in tick_labels))
    # The constant curve is a flat line, the single point is still drawn, NaNs are reported.
    assert len({y for _, y in polyline_points(charts["val/BLEU4"])}) == 1
    assert len(charts["val/CIDEr"].find_all("circle")) == 1
    assert "6 non-finite values skipped" in root.text


def test_curves_empty_and_all_nan():
    assert "No logged scalars" in render(curves={})
    root = parse(render(curves={"train/loss": [(1, math.nan), (2, math.inf)]}))
    svg = root.find("svg", data_name="train/loss")
    assert not svg.find_all("polyline") and "no finite values" in svg.text


def test_gallery_worst_first_with_consistent_ranks():
    gallery = make_gallery()
    root = parse(render(gallery=gallery))
    found = cards(root)
    assert len(found) == len(gallery)
    ciders = [float(c.attrs["data-cider"]) for c in found]
    assert ciders == sorted(e.cider for e in gallery)
    assert [int(c.attrs["data-rank-cider-asc"]) for c in found] == list(range(len(found)))
    by_desc = sorted(found, key=lambda c: int(c.attrs["data-rank-cider-desc"]))
    assert [float(c.attrs["data-cider"]) for c in by_desc] == sorted(ciders, reverse=True)
    by_id = sorted(found, key=lambda c: int(c.attrs["data-rank-image-id"]))
    assert [c.attrs["data-id"] for c in by_id] == sorted(e.image_id for e in gallery)
    # Each card: id, change type, per-pair CIDEr with one decimal, both images, caption, refs.
    worst = min(gallery, key=lambda e: e.cider)
    card = found[0]
    assert card.attrs["data-id"] == worst.image_id
    assert card.attrs["data-type"] == worst.change_type
    assert f"CIDEr {worst.cider:.1f}" in card.text and worst.change_type in card.text
    assert [li.text for li in card.find("ol").iter("li")] == worst.references
    assert worst.caption in card.find("p", **{"class": "gen"}).text
    imgs = card.find_all("img")
    assert [i.attrs["alt"] for i in imgs] == ["before", "after"]
    assert base64.b64decode(imgs[0].attrs["src"].split(",", 1)[1]) == worst.images["before"]
    # Controls: hidden until the script shows them; the filter lists the types that occur.
    controls = root.find("div", id="gallery-controls")
    assert "hidden" in controls.attrs
    options = [o.attrs["value"] for o in root.find("select", id="type-select").iter("option")]
    assert options == ["all", "no_change", "color", "add", "move"]


def test_gallery_extra_fields_empty_images_and_no_types():
    gallery = [
        GalleryEntry("a", "one", ["ref"], "", 3.0, {}, {"retrieved entities": "cube; sphere"}),
        GalleryEntry("b", "two", ["ref"], "", 1.0, {"x": b"not an image"}),
    ]
    root = parse(render(gallery=gallery))
    found = cards(root)
    assert [c.attrs["data-id"] for c in found] == ["b", "a"]
    assert not root.find_all("img")
    assert "unrecognised image format" in found[0].text
    extra = found[1].find("dl")
    assert [n.text for n in extra.iter("dt")] == ["retrieved entities"]
    assert [n.text for n in extra.iter("dd")] == ["cube; sphere"]
    assert not root.find_all("select", id="type-select")  # nothing to filter by
    assert "No pairs to show" in render(gallery=[])


def test_text_is_escaped():
    nasty = "<script>alert('x')</script> & \"quoted\" <evil>"
    gallery = [GalleryEntry('id"<1>', nasty, [nasty, "a < b"], "color", 5.0, {},
                            {"<k>": "v & w"})]
    page = render(title="T <&> \"x\"", gallery=gallery, notes=[nasty],
                  curves={"val/<c>": [(1, 2.0)]})
    assert "<script>alert" not in page and "<evil>" not in page and "<k>" not in page
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; &quot;quoted&quot;" in page
    assert page.count("<script>") == 1  # only the page's own sort script
    root = parse(page)
    card = cards(root)[0]
    assert card.attrs["data-id"] == 'id"<1>'
    assert card.find("p", **{"class": "gen"}).text == "generated: " + nasty
    assert root.find("title").text == 'T <&> "x"'
    assert root.find("svg", data_name="val/<c>")


def test_self_contained():
    page = render()
    assert "http://" not in page and "https://" not in page
    assert "<link" not in page and "@import" not in page and "url(" not in page
    sources = re.findall(r"""\b(?:src|href)\s*=\s*["']([^"']*)""", page)
    assert sources  # images and the page's own anchors
    for src in sources:
        assert src.startswith(("data:image/png;base64,", "#")), src
    root = parse(page)
    assert len(root.find_all("img")) == 2 * len(make_gallery())
    assert all(i.attrs["src"].startswith("data:image/png;base64,") for i in root.iter("img"))


def test_deterministic_and_independent_of_input_order():
    first = render()
    assert render() == first
    gallery = make_gallery()
    assert render(gallery=list(reversed(gallery))) == first
    # A tie on CIDEr is broken by (natural) image id, whatever the input order.
    ties = [GalleryEntry(f"img_{i}", "c", ["r"], "", 7.0, {}) for i in (10, 9, 1)]
    ids = [c.attrs["data-id"] for c in cards(parse(render(gallery=ties)))]
    assert ids == ["img_1", "img_9", "img_10"]


def test_max_gallery_keeps_the_worst_and_says_so():
    gallery = make_gallery(10, images=False)
    root = parse(render(gallery=gallery, max_gallery=4))
    found = cards(root)
    assert [float(c.attrs["data-cider"]) for c in found] == sorted(e.cider for e in gallery)[:4]
    note = root.find("p", id="gallery-truncated").text
    assert "10 pairs" in note and "6 pairs with higher CIDEr left out" in note
    assert len(cards(parse(render(gallery=gallery, max_gallery=None)))) == 10
    assert len(cards(parse(render(gallery=gallery, max_gallery=10)))) == 10
    assert "gallery-truncated" not in render(gallery=gallery, max_gallery=10)
    with pytest.raises(ValueError, match="max_gallery"):
        render(max_gallery=-1)


def test_write_report_is_atomic_and_matches_render(tmp_path):
    kwargs = {"title": "t", "metrics": METRICS, "curves": CURVES, "gallery": make_gallery(3)}
    out = write_report(tmp_path / "sub" / "report.html", **kwargs)
    assert out == tmp_path / "sub" / "report.html"
    assert out.read_text(encoding="utf-8") == render_report(**kwargs)
    assert os.listdir(out.parent) == ["report.html"]  # no temp file left behind


# ---------------------------------------------------------------------------------------------
# Headless browser
# ---------------------------------------------------------------------------------------------

BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")


def _browser() -> str:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    pytest.skip(f"no headless browser on PATH (looked for {', '.join(BROWSERS)})")


def _chromium(browser: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / f"profile{len(list(tmp_path.glob('profile*')))}"
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
           *args]
    proc = subprocess.run(cmd, capture_output=True, timeout=30, check=False)
    # stderr is full of harmless dbus / GPU warnings; only the exit status matters.
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-2000:]
    return proc


@pytest.fixture(scope="module")
def report_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("report") / "report.html"
    return write_report(path, title="CLEVR-Change test", metrics=METRICS, curves=CURVES,
                        gallery=make_gallery(), notes=["checkpoint step 3000"])


def test_browser_dom_and_sort_script(report_file, tmp_path):
    browser = _browser()
    default = parse(_chromium(browser, tmp_path, "--dump-dom", report_file.as_uri()).stdout
                    .decode("utf-8"))
    _, cells = metric_table(default)
    assert cells["total"]["C"] == "85.6"
    plots = [s for s in default.iter("svg") if "chart" in s.classes() and s.find_all("polyline")]
    assert plots
    found = cards(default)
    assert found and found[0].find_all("img")
    ciders = [float(c.attrs["data-cider"]) for c in found]
    assert ciders == sorted(ciders)
    # The script ran: it showed the controls and counted the cards.
    assert "hidden" not in default.find("div", id="gallery-controls").attrs
    assert default.find("span", id="shown-count").text == f"showing {len(found)} of {len(found)}"

    desc = parse(_chromium(browser, tmp_path, "--dump-dom",
                           report_file.as_uri() + "#sort=cider_desc").stdout.decode("utf-8"))
    assert [float(c.attrs["data-cider"]) for c in cards(desc)] == sorted(ciders, reverse=True)
    assert desc.find("body").attrs["data-sort"] == "cider_desc"

    moved = parse(_chromium(browser, tmp_path, "--dump-dom",
                            report_file.as_uri() + "?sort=image_id&type=move").stdout
                  .decode("utf-8"))
    visible = [c for c in cards(moved) if "hidden" not in c.attrs]
    assert {c.attrs["data-type"] for c in visible} == {"move"}
    assert [c.attrs["data-id"] for c in visible] == sorted(c.attrs["data-id"] for c in visible)
    assert len(cards(moved)) == len(found)  # filtered cards are hidden, not removed


def test_browser_screenshot(report_file, tmp_path):
    browser = _browser()
    shot = tmp_path / "shot.png"
    _chromium(browser, tmp_path, f"--screenshot={shot}", "--window-size=1200,1600",
              report_file.as_uri())
    with Image.open(shot) as img:
        assert img.format == "PNG" and img.size == (1200, 1600)
        colours = img.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50  # text, table, charts: not a blank page
