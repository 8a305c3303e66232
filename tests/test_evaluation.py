"""Tests for changecap_jax.evaluators.captions (COCOEvalCap-style caption scoring, per-subset rows,
files).

Each METEOR process costs several seconds of Java start-up, so the expensive scores are computed
once in module-scoped fixtures and shared: the evaluators' table, an independent pycocoevalcap
computation of the same captions, and a stand-alone score of the colour pairs.
"""

from __future__ import annotations

import json
import logging
import os
import zipfile
from pathlib import Path

import pytest
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.meteor.meteor import Meteor
from pycocoevalcap.rouge.rouge import Rouge
from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

from changecap_jax.evaluators import captions as ev
from changecap_jax.evaluators import results, tokenize
from changecap_jax.evaluators.captions import PairCaption
from changecap_jax.io import jsonio

SCORED_KEYS = ("Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr")

# CLEVR-Change style pairs. "move" is deliberately absent (its row must be omitted), the "add"
# captions equal their single reference exactly, and the "drop" captions are wrong.
RECORDS = [
    PairCaption(
        "000001.png",
        "the small red metal cube changed to blue",
        ["the small red metal cube changed to blue", "the tiny red cube turned blue"],
        "color",
    ),
    PairCaption(
        "000002.png",
        "the large yellow cylinder became green",
        ["the big yellow rubber cylinder changed its color", "the yellow cylinder turned green"],
        "color",
    ),
    PairCaption(
        "000003.png",
        "the tiny gray sphere turned purple",
        ["the small gray metal sphere turned brown", "the gray ball became brown"],
        "color",
    ),
    PairCaption(
        "008001.png",
        "the blue rubber cube became metallic",
        ["the blue matte cube changed to metal", "the large blue cube became shiny"],
        "material",
    ),
    PairCaption(
        "008002.png",
        "the red shiny sphere changed to rubber",
        ["the red metal ball turned rubber", "the small red sphere became matte"],
        "material",
    ),
    PairCaption(
        "016001.png",
        "the large purple metal cylinder has been added",
        ["the large purple metal cylinder has been added"],
        "add",
    ),
    PairCaption(
        "016002.png",
        "a small cyan rubber cube appeared",
        ["a small cyan rubber cube appeared"],
        "add",
    ),
    PairCaption(
        "024001.png",
        "there is no change",
        ["the large gray rubber sphere is missing", "the big gray ball has disappeared"],
        "drop",
    ),
    PairCaption(
        "024002.png",
        "nothing has changed",
        ["the small brown cube is gone", "the tiny brown metal block was removed"],
        "drop",
    ),
    PairCaption(
        "000001.png_n",
        "there is no change",
        ["there is no change", "nothing has changed", "the scene remains the same"],
        "no_change",
    ),
    PairCaption(
        "000002.png_n",
        "the two scenes seem identical",
        ["no change was made", "the two scenes seem identical"],
        "no_change",
    ),
    PairCaption(
        "008001.png_n",
        "the large gray rubber sphere is missing",
        ["there is no difference", "nothing was modified"],
        "no_change",
    ),
]

FAKE_MISSING = [Path("/nonexistent/spice/lib/stanford-corenlp-3.6.0-models.jar")]


def _dicts(records: list[PairCaption]) -> tuple[dict[str, str], dict[str, list[str]]]:
    return (
        {r.image_id: r.caption for r in records},
        {r.image_id: list(r.references) for r in records},
    )


def _ids(change_type: str) -> list[str]:
    return [r.image_id for r in RECORDS if r.change_type == change_type]


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def table_and_log() -> tuple[dict, list[str]]:
    """evaluate_pairs(RECORDS, spice="auto") with the SPICE jars reported missing."""
    handler = _ListHandler()
    ev.logger.addHandler(handler)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ev, "spice_missing_files", lambda: list(FAKE_MISSING))
            table = ev.evaluate_pairs(RECORDS, spice="auto")
    finally:
        ev.logger.removeHandler(handler)
    return table, handler.messages


@pytest.fixture(scope="module")
def table(table_and_log: tuple[dict, list[str]]) -> dict:
    return table_and_log[0]


def _direct_scores(gts_raw: dict, res_raw: dict, meteor: Meteor) -> tuple[dict, dict]:
    """What COCOEvalCap.evaluate does (minus SPICE), written out with pycocoevalcap directly."""
    tokenizer = PTBTokenizer()
    gts = tokenizer.tokenize({k: [{"caption": c} for c in v] for k, v in gts_raw.items()})
    res = tokenizer.tokenize({k: [{"caption": c}] for k, c in res_raw.items()})
    scores: dict[str, float] = {}
    bleu, _ = Bleu(4).compute_score(gts, res)
    scores.update(dict(zip(("Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4"), bleu, strict=True)))
    scores["METEOR"] = meteor.compute_score(gts, res)[0]
    scores["ROUGE_L"] = Rouge().compute_score(gts, res)[0]
    cider, cider_per_image = Cider().compute_score(gts, res)
    scores["CIDEr"] = cider
    return scores, dict(zip(gts.keys(), cider_per_image, strict=True))


@pytest.fixture(scope="module")
def direct() -> dict[str, tuple[dict, dict]]:
    """Independent pycocoevalcap scores of the total set and of the colour pairs alone."""
    preds, refs = _dicts(RECORDS)
    color = set(_ids("color"))
    meteor = Meteor()
    try:
        total = _direct_scores(refs, preds, meteor)
        color_only = _direct_scores(
            {k: v for k, v in refs.items() if k in color},
            {k: v for k, v in preds.items() if k in color},
            meteor,
        )
    finally:
        del meteor
    return {"total": total, "color": color_only}


@pytest.fixture(scope="module")
def color_alone() -> dict[str, float]:
    """score_captions on only the colour pairs (a separate tokenisation and METEOR process)."""
    preds, refs = _dicts([r for r in RECORDS if r.change_type == "color"])
    return ev.score_captions(preds, refs, spice="off")


# ---------------------------------------------------------------------------------------------
# Metric values
# ---------------------------------------------------------------------------------------------


def test_score_captions_matches_pycocoevalcap(color_alone, direct):
    expected, _ = direct["color"]
    assert set(color_alone) == set(SCORED_KEYS)
    for key in SCORED_KEYS:
        assert color_alone[key] == expected[key], key
        assert isinstance(color_alone[key], float)


def test_total_row_matches_pycocoevalcap(table, direct):
    expected, _ = direct["total"]
    for key in SCORED_KEYS:
        assert table[key] == expected[key] * 100.0, key
    assert table["num_pairs"] == len(RECORDS)


def test_subset_row_is_scored_alone(table, color_alone, direct):
    row = table["color"]
    assert row["num_pairs"] == 3
    for key in SCORED_KEYS:
        assert row[key] == color_alone[key] * 100.0, key
    # The check above can tell the protocols apart: CIDEr with document frequencies taken from the
    # whole test set, averaged over the colour pairs, is a different number (by far more than
    # float rounding).
    _, cider_per_image = direct["total"]
    pooled = sum(cider_per_image[i] for i in _ids("color")) / 3 * 100.0
    assert abs(pooled - row["CIDEr"]) > 1e-3


def test_table_rows_and_pair_counts(table):
    sub_rows = {k for k, v in table.items() if isinstance(v, dict)}
    assert sub_rows == {"semantic", "no_change", "color", "material", "add", "drop"}
    assert "move" not in table
    n_sem, n_nc = table["semantic"]["num_pairs"], table["no_change"]["num_pairs"]
    assert (n_sem, n_nc) == (9, 3)
    assert n_sem + n_nc == table["num_pairs"] == len(RECORDS)
    per_type = sum(table[t]["num_pairs"] for t in ("color", "material", "add", "drop"))
    assert per_type == n_sem
    for name in sub_rows:
        assert set(table[name]) == {*SCORED_KEYS, "num_pairs"}
    # Separate runs give different numbers per row (no row is a copy of another).
    assert len({table[k]["CIDEr"] for k in sub_rows} | {table["CIDEr"]}) == len(sub_rows) + 1


def test_perfect_captions_beat_wrong_ones(table):
    perfect, wrong = table["add"], table["drop"]
    # One exact single-reference match per pair: BLEU-4 is 1 up to pycocoevalcap's smoothing
    # constants (tiny=1e-15 over small=1e-9), i.e. 100 after scaling.
    assert perfect["Bleu_4"] == pytest.approx(100.0, abs=1e-6)
    assert perfect["ROUGE_L"] == pytest.approx(100.0, abs=1e-9)
    assert perfect["CIDEr"] > 500.0
    assert wrong["CIDEr"] < 50.0
    assert perfect["CIDEr"] > 10 * wrong["CIDEr"]
    assert wrong["Bleu_4"] < 1.0


def test_untyped_records_only_have_total_row():
    records = [
        PairCaption("12", "the car is gone", ["the car has left", "a car is missing"], ""),
        PairCaption("15", "a person appeared", ["a man walked in"], ""),
    ]
    # Patch the scorer out: only the row layout is under test here (no Java needed).
    calls: list[dict] = []

    def fake_score_plan(tokenized, plan, **kwargs):
        calls.append(plan)
        return {name: {key: 0.5 for key in SCORED_KEYS} for name in plan}

    def fake_tokenize(predictions, references):
        return tokenize.TokenizedCaptions(dict(predictions),
                                          {k: list(v) for k, v in references.items()})

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ev, "_score_plan", fake_score_plan)
        mp.setattr(ev, "tokenize_captions", fake_tokenize)
        out = ev.evaluate_pairs(records, spice="off")
    assert calls == [{"total": ["12", "15"]}]
    assert out == {**{key: 50.0 for key in SCORED_KEYS}, "num_pairs": 2}


# ---------------------------------------------------------------------------------------------
# Tokenisation
# ---------------------------------------------------------------------------------------------


def test_ptb_tokenize_matches_pycocoevalcap_and_keeps_alignment():
    captions = {
        "a": ["The small RED cube's color changed, to blue.", "there is no change!"],
        "b": ["line\rbreak inside", ""],
        "c": ["last one", ""],
    }
    out = tokenize.ptb_tokenize(captions)
    assert out == {
        "a": ["the small red cube 's color changed to blue", "there is no change"],
        "b": ["line break inside", ""],
        "c": ["last one", ""],
    }
    # Same tokens as pycocoevalcap's own tokenizer on captions without line breaks.
    simple = {k: [{"caption": c} for c in v] for k, v in captions.items() if k != "b"}
    expected = PTBTokenizer().tokenize(simple)
    assert {k: out[k] for k in expected} == expected


def test_ptb_tokenize_memo_gives_the_fresh_tokens_and_skips_java(monkeypatch):
    """A second tokenisation of known lines starts no Java; a call mixing known and new lines
    tokenises only the new ones and returns what a fresh call returns."""
    captions = {"a": ["The RED cube moved.", 'a "quoted" word, here'],
                "b": ["Nothing changed!", "The RED cube moved."]}
    monkeypatch.setattr(tokenize, "_TOKENIZED", {})
    fresh = tokenize.ptb_tokenize(captions)
    runs: list[list[str]] = []
    real = tokenize._run_ptb_tokenizer
    monkeypatch.setattr(tokenize, "_run_ptb_tokenizer",
                        lambda lines: runs.append(lines) or real(lines))
    assert tokenize.ptb_tokenize(dict(reversed(captions.items()))) == fresh and runs == []
    mixed = {"c": ["A new caption, surely."], **captions}
    got = tokenize.ptb_tokenize(mixed)
    assert runs == [["A new caption, surely."]]
    monkeypatch.setattr(tokenize, "_TOKENIZED", {})
    assert got == tokenize.ptb_tokenize(mixed) == {"c": ["a new caption surely"], **fresh}


# ---------------------------------------------------------------------------------------------
# SPICE
# ---------------------------------------------------------------------------------------------


def test_spice_auto_skips_with_one_message(table_and_log):
    table, messages = table_and_log
    assert "SPICE" not in table
    assert all("SPICE" not in v for v in table.values() if isinstance(v, dict))
    spice_messages = [m for m in messages if "SPICE" in m]
    assert len(spice_messages) == 1
    assert str(FAKE_MISSING[0]) in spice_messages[0]
    assert "stanford-corenlp-full-2015-12-09.zip" in spice_messages[0]


def test_spice_on_raises_when_unavailable(monkeypatch):
    monkeypatch.setattr(ev, "spice_missing_files", lambda: list(FAKE_MISSING))
    preds, refs = _dicts(RECORDS[:2])
    with pytest.raises(ev.SpiceUnavailableError, match="stanford-corenlp-3.6.0-models.jar"):
        ev.score_captions(preds, refs, spice="on")
    with pytest.raises(ev.SpiceUnavailableError):
        ev.evaluate_pairs(RECORDS[:2], spice="on")


def test_spice_mode_is_validated():
    preds, refs = _dicts(RECORDS[:1])
    with pytest.raises(ValueError, match="spice"):
        ev.score_captions(preds, refs, spice="yes")


def _write_spice_jar(path: Path, class_path: list[str]) -> None:
    # A manifest line longer than 72 bytes is folded, as jar tools do.
    line = "Class-Path: " + " ".join(class_path)
    folded = line[:70] + "\r\n " + line[70:]
    manifest = f"Manifest-Version: 1.0\r\n{folded}\r\nMain-Class: x.Y\r\n"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("META-INF/MANIFEST.MF", manifest)


def test_spice_detection(tmp_path, monkeypatch):
    spice_dir = tmp_path / "spice"
    (spice_dir / "lib").mkdir(parents=True)
    monkeypatch.setattr(ev, "_SPICE_DIR", spice_dir)
    core = ["lib/stanford-corenlp-3.6.0.jar", "lib/stanford-corenlp-3.6.0-models.jar"]
    # Nothing there: the SPICE jar and both CoreNLP jars are reported.
    assert set(ev.spice_missing_files()) == {
        spice_dir / "spice-1.0.jar",
        spice_dir / core[0],
        spice_dir / core[1],
    }
    _write_spice_jar(spice_dir / "spice-1.0.jar", [core[0], "lib/ejml-0.23.jar", core[1]])
    (spice_dir / "lib" / "ejml-0.23.jar").write_bytes(b"")
    assert ev.spice_missing_files() == [spice_dir / core[0], spice_dir / core[1]]
    (spice_dir / core[0]).write_bytes(b"")
    assert ev.spice_missing_files() == [spice_dir / core[1]]
    (spice_dir / core[1]).write_bytes(b"")
    assert ev.spice_missing_files() == []
    (spice_dir / "lib" / "ejml-0.23.jar").unlink()
    assert ev.spice_missing_files() == [spice_dir / "lib" / "ejml-0.23.jar"]


def test_spice_is_never_downloaded(monkeypatch):
    from pycocoevalcap.spice import get_stanford_models

    def boom(*args, **kwargs):
        raise AssertionError("download attempted")

    monkeypatch.setattr(get_stanford_models, "urlretrieve", boom)
    monkeypatch.setattr(ev, "spice_missing_files", lambda: list(FAKE_MISSING))
    assert ev._resolve_spice("auto") is False
    assert ev._resolve_spice("off") is False


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def test_missing_references_names_the_id():
    with pytest.raises(ValueError, match="000042.png_n"):
        ev.score_captions(
            {"000041.png": "a", "000042.png_n": "b"}, {"000041.png": ["a"]}, spice="off"
        )
    with pytest.raises(ValueError, match="000041.png"):
        ev.score_captions({"000041.png": "a"}, {"000041.png": []}, spice="off")
    with pytest.raises(ValueError, match="000007.png"):
        ev.evaluate_pairs([PairCaption("000007.png", "a cube", [], "color")], spice="off")


def test_record_validation():
    with pytest.raises(ValueError, match="duplicate"):
        ev.evaluate_pairs([RECORDS[0], RECORDS[0]], spice="off")
    bad = PairCaption("000001.png", "x", ["y"], "colour")
    with pytest.raises(ValueError, match="colour"):
        ev.evaluate_pairs([bad], spice="off")


# ---------------------------------------------------------------------------------------------
# Table and files
# ---------------------------------------------------------------------------------------------


def test_format_table(table):
    text = ev.format_table(table)
    lines = [line for line in text.splitlines() if not line.startswith("scores x100")]
    assert lines[0].split() == ["B4", "M", "R", "C", "N"]
    names = [line.split()[0] for line in lines[1:]]
    assert names == ["total", "semantic", "no_change", "color", "material", "add", "drop"]
    color = lines[1 + names.index("color")].split()
    assert float(color[1]) == pytest.approx(table["color"]["Bleu_4"], abs=0.006)
    assert float(color[4]) == pytest.approx(table["color"]["CIDEr"], abs=0.006)
    assert int(color[5]) == 3
    assert len({len(line) for line in lines}) == 1  # fixed width
    with_spice = {**table, "SPICE": 21.5}
    assert ev.format_table(with_spice).splitlines()[0].split() == ["B4", "M", "R", "C", "S", "N"]


def test_format_table_states_the_main_metric_and_protocol(table):
    birds = {**table, "dataset": "birds_to_words", "main_metrics": ["CIDEr", "ROUGE_L"],
             "protocol": "every test pair; references: all its descriptions"}
    notes = ev.format_table(birds).splitlines()[-4:]
    assert notes[0] == "dataset: birds_to_words"
    assert notes[1] == ("main metric(s): CIDEr-D (pycocoevalcap's CIDEr: sigma 6, clipped), "
                        "ROUGE-L")
    assert notes[2] == "protocol: every test pair; references: all its descriptions"
    assert "main metric" not in ev.format_table(table)


def test_write_results(tmp_path, table):
    extra = {"000001.png": {"predicted_type": "color"}, "000002.png_n": {"predicted_type": "add"}}
    cap_path, met_path = results.write_results(tmp_path / "run", "test", 1200, RECORDS, table,
                                               extra)
    assert cap_path == tmp_path / "run" / "captions" / "test_1200.json"
    assert met_path == tmp_path / "run" / "metrics" / "test_1200.json"
    captions = json.loads(cap_path.read_text())
    assert [c["image_id"] for c in captions] == [r.image_id for r in RECORDS]
    by_id = {c["image_id"]: c for c in captions}
    first = by_id["000001.png"]
    assert first == {
        "image_id": "000001.png",
        "caption": RECORDS[0].caption,
        "references": RECORDS[0].references,
        "change_type": "color",
        "predicted_type": "color",
    }
    assert by_id["000002.png_n"]["predicted_type"] == "add"
    assert "predicted_type" not in by_id["000002.png"]
    metrics = json.loads(met_path.read_text())
    assert metrics == table  # full floats survive the round trip
    assert metrics["color"]["CIDEr"] == table["color"]["CIDEr"]
    assert sorted(os.listdir(cap_path.parent)) == ["test_1200.json"]


def test_write_results_rejects_unknown_extra(tmp_path):
    with pytest.raises(ValueError, match="999999.png"):
        results.write_results(tmp_path, "val", 1, RECORDS, {}, {"999999.png": {"x": 1}})
    with pytest.raises(ValueError, match="caption"):
        results.write_results(tmp_path, "val", 1, RECORDS, {}, {"000001.png": {"caption": "x"}})


def test_write_results_failure_leaves_no_partial_file(tmp_path, monkeypatch):
    real_dump = json.dump

    def partial_dump(obj, fh, **kwargs):
        fh.write('[{"image_id": "000001.png", "cap')  # half a document, then a crash
        raise OSError("disk full")

    monkeypatch.setattr(jsonio.json, "dump", partial_dump)
    with pytest.raises(OSError, match="disk full"):
        results.write_results(tmp_path, "test", 5, RECORDS, {"CIDEr": 1.0})
    assert not (tmp_path / "captions" / "test_5.json").exists()
    assert os.listdir(tmp_path / "captions") == []  # the temp file is cleaned up too
    assert not (tmp_path / "metrics" / "test_5.json").exists()

    # A failing rename keeps an earlier complete file intact.
    monkeypatch.setattr(jsonio.json, "dump", real_dump)
    cap_path, _ = results.write_results(tmp_path, "test", 5, RECORDS[:1], {"CIDEr": 1.0})
    before = cap_path.read_text()

    def failing_replace(src, dst):
        raise OSError("rename failed")

    monkeypatch.setattr(jsonio.os, "replace", failing_replace)
    with pytest.raises(OSError, match="rename failed"):
        results.write_results(tmp_path, "test", 5, RECORDS, {"CIDEr": 2.0})
    assert cap_path.read_text() == before
    assert os.listdir(cap_path.parent) == ["test_5.json"]


# ---------------------------------------------------------------------------------------------
# COCO-style reference files
# ---------------------------------------------------------------------------------------------


def test_coco_reference_file_round_trip():
    gt = results.coco_reference_file(RECORDS)
    assert gt["type"] == "captions"
    assert gt["images"][0] == {"filename": "000001.png", "id": "000001.png"}
    assert gt["images"][-1] == {"filename": "008001.png_n", "id": "008001.png_n"}
    n_refs = sum(len(r.references) for r in RECORDS)
    assert [a["id"] for a in gt["annotations"]] == list(range(n_refs))
    assert gt["annotations"][0] == {
        "caption": RECORDS[0].references[0],
        "id": 0,
        "image_id": "000001.png",
    }
    back = results.references_from_coco(json.loads(json.dumps(gt)))
    assert back == {r.image_id: r.references for r in RECORDS}
    assert list(back) == [r.image_id for r in RECORDS]


def test_references_from_coco_errors():
    with pytest.raises(ValueError, match="annotations"):
        results.references_from_coco({"images": []})
    with pytest.raises(ValueError, match="caption"):
        results.references_from_coco({"annotations": [{"image_id": "1", "id": 0}]})
    with pytest.raises(ValueError, match="image_id"):
        results.references_from_coco({"annotations": [{"caption": "x", "id": 0}]})
    with pytest.raises(ValueError, match="'id'"):
        results.references_from_coco({"images": [{"file": "a"}], "annotations": []})


def test_references_from_coco_duplicate_images():
    # Spot-the-Diff's official GT lists an image once per annotation and ids are bare strings.
    gt = {
        "annotations": [
            {"image_id": "256", "caption": "person with umbrella is gone", "id": "256"},
            {"image_id": "256", "caption": "person with red coat is moved", "id": "256"},
            {"image_id": 31, "caption": "the car is gone", "id": "31"},
        ],
        "images": [{"id": "256"}, {"id": "256"}, {"id": 31}],
        "type": "captions",
    }
    assert results.references_from_coco(gt) == {
        "256": ["person with umbrella is gone", "person with red coat is moved"],
        "31": ["the car is gone"],
    }


SPOT_GT = Path("/work/shared/data/spot_the_diff/ddla_rerun_gtfile.json")


@pytest.mark.skipif(not SPOT_GT.is_file(), reason="Spot-the-Diff official GT file not available")
def test_references_from_spot_the_diff_official_file():
    refs = results.references_from_coco(json.loads(SPOT_GT.read_text()))
    assert len(refs) == 1270
    assert sum(len(v) for v in refs.values()) == 2107


def test_meteor_jvm_is_shared_and_replaced_when_it_exits():
    """One METEOR JVM serves every scoring of a process (same scores); one that has exited is
    replaced by a fresh one, again with the same scores."""
    predictions = {"a": "the red cube moved", "b": "a blue ball is gone"}
    references = {"a": ["the red cube moved away", "the red block moved"],
                  "b": ["the blue sphere is gone"]}
    first = ev.score_captions(predictions, references, spice="off")
    process = ev._shared_meteor().meteor_p
    assert ev.score_captions(predictions, references, spice="off") == first
    assert ev._shared_meteor().meteor_p is process
    process.kill()
    process.wait()
    assert ev.score_captions(predictions, references, spice="off") == first
    assert ev._shared_meteor().meteor_p is not process
