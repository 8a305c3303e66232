"""The IDC-PCL evaluation protocol (idc_protocol.evaluate_pairs_idc) against pycocoevalcap.

IDC's eval_models.py feeds the strings as stored to the coco-caption scorers (no PTB tokeniser),
so the expected numbers here are pycocoevalcap's scorers called directly on ``{id: [caption]}``
dicts of the raw strings. Java runs a few times (METEOR, the PTB tokenizer of the coco side), so
every result is computed once in a module-scoped fixture.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.meteor.meteor import Meteor
from pycocoevalcap.rouge.rouge import Rouge

from changecap_jax.evaluators import captions, idc_protocol
from changecap_jax.evaluators.captions import PairCaption

# CLEVR-Change-like records. Several captions carry what the PTB tokenizer changes (capitals,
# a full stop glued to "cube.", a comma, a hyphenated word, "'s"), so the protocols disagree.
RECORDS = [
    PairCaption("000001.png", "The small red cube. has changed to blue",
                ["the small red cube has changed to blue", "the tiny red cube became blue"],
                "color"),
    PairCaption("000002.png", "the large sphere changed its color",
                ["The large sphere changed its color.", "the big ball is now green-ish"],
                "color"),
    PairCaption("000003.png", "a blue-green cylinder has been added",
                ["a blue-green cylinder has been added", "someone added a cylinder , blue"],
                "add"),
    PairCaption("000004.png", "the metal cube is missing",
                ["the metal cube is missing", "the cube 's gone"],
                "drop"),
    PairCaption("000005.png", "the cube 's material changed",
                ["The rubber cube became metal.", "the cube 's material changed"],
                "material"),
    PairCaption("000001.png_n", "there is no change",
                ["there is no change", "nothing has changed ."],
                "no_change"),
    PairCaption("000002.png_n", "nothing has changed .",
                ["Nothing has changed.", "the scene is the same"],
                "no_change"),
]


def _direct(records: list[PairCaption], meteor: Meteor) -> dict[str, float]:
    """pycocoevalcap's scorers on the raw strings, x100 -- what IDC's evaluator computes."""
    gts = {r.image_id: list(r.references) for r in records}
    res = {r.image_id: [r.caption] for r in records}
    bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
    out = {k: 100.0 * v for k, v in zip(captions.BLEU_KEYS, bleu, strict=True)}
    out["METEOR"] = 100.0 * meteor.compute_score(gts, res)[0]
    out["ROUGE_L"] = 100.0 * Rouge().compute_score(gts, res)[0]
    out["CIDEr"] = 100.0 * Cider().compute_score(gts, res)[0]
    return out


@pytest.fixture(scope="module")
def meteor() -> Iterator[Meteor]:
    """One METEOR JVM for the whole module (it takes ~10 s to load its paraphrase table here).

    captions.py opens and closes one per call; sharing changes no number, since every set is
    its own EVAL request on the same jar.
    """
    proc = Meteor()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(captions, "Meteor", lambda: proc)
        mp.setattr(captions, "_close_meteor", lambda _m: None)
        yield proc
    captions._close_meteor(proc)


@pytest.fixture(scope="module")
def expected(meteor: Meteor) -> dict[str, dict[str, float]]:
    subsets = {
        "total": RECORDS,
        "semantic": [r for r in RECORDS if r.change_type != "no_change"],
        "no_change": [r for r in RECORDS if r.change_type == "no_change"],
        "color": [r for r in RECORDS if r.change_type == "color"],
    }
    return {name: _direct(recs, meteor) for name, recs in subsets.items()}


@pytest.fixture(scope="module")
def compared(meteor: Meteor) -> dict:
    return idc_protocol.compare_protocols(RECORDS, spice="off")


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


def test_idc_total_equals_pycocoevalcap_on_raw_strings(compared, expected):
    idc = compared["idc"]
    for key in idc_protocol.IDC_METRIC_KEYS:
        assert _close(idc[key], expected["total"][key]), key
    assert idc["num_pairs"] == len(RECORDS)
    assert idc["eval_protocol"] == "idc"
    assert "SPICE" not in idc


def test_idc_subset_rows_are_scored_alone_and_labelled(compared, expected):
    idc = compared["idc"]
    for name in ("semantic", "no_change", "color"):
        for key in idc_protocol.IDC_METRIC_KEYS:
            assert _close(idc[name][key], expected[name][key]), (name, key)
    assert idc["color"]["num_pairs"] == 2
    assert set(captions.CHANGE_TYPES) - {"move"} <= set(idc)
    assert "move" not in idc  # empty subset: omitted, as in evaluate_pairs
    assert idc["subset_rows"] == idc_protocol.IDC_SUBSET_NOTE


def test_ptb_tokenisation_changes_the_numbers(compared, expected):
    coco, idc = compared["coco"], compared["idc"]
    # Capitals, "cube." and " ." count as different words only without the PTB tokenizer.
    for key in ("Bleu_4", "ROUGE_L", "CIDEr"):
        assert not _close(coco[key], idc[key]), key
        assert _close(idc[key], expected["total"][key]), key
    # Every caption here equals one of its references after PTB tokenisation, not before.
    assert _close(coco["ROUGE_L"], 100.0)
    assert coco["no_change"]["Bleu_4"] > idc["no_change"]["Bleu_4"] + 20.0
    assert coco["no_change"]["ROUGE_L"] > idc["no_change"]["ROUGE_L"] + 20.0


def test_compare_protocols_and_its_table(compared):
    assert set(compared) == {"coco", "idc"}
    assert compared["coco"].get("eval_protocol") is None  # evaluate_pairs is unchanged
    text = idc_protocol.format_protocol_comparison(compared)
    lines = text.splitlines()
    assert "coco" in lines[0] and "idc" in lines[0]
    assert lines[1].split() == ["B4", "M", "R", "C", "B4", "M", "R", "C", "N"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:] if line.split()
            and line.split()[0] in captions.ROW_ORDER}
    assert list(rows) == ["total", "semantic", "no_change", "color", "material", "add", "drop"]
    for name, cells in rows.items():
        coco = compared["coco"] if name == "total" else compared["coco"][name]
        idc = compared["idc"] if name == "total" else compared["idc"][name]
        want = [f"{row[k]:.2f}" for row in (coco, idc)
                for k in ("Bleu_4", "METEOR", "ROUGE_L", "CIDEr")]
        assert cells == [*want, str(coco["num_pairs"])], name


def test_without_change_types_only_total_and_whitespace_handling(meteor):
    # Birds-to-Words-like: no change types, pre-tokenised text; a tab and a line break inside a
    # caption must not desynchronise METEOR (IDC collapses whitespace runs in the SCORE line).
    records = [
        PairCaption("1_2", "animal1 has a\tlonger beak", ["animal1 has a longer beak ."]),
        PairCaption("3_4", "animal2 ' s wings\nare darker", ["animal2 ' s wings are darker"]),
    ]
    idc = idc_protocol.evaluate_with_protocol(records, protocol="idc", spice="off")
    assert set(idc) == {*idc_protocol.IDC_METRIC_KEYS, "num_pairs", "eval_protocol"}
    flat = [PairCaption(r.image_id, " ".join(r.caption.split()), r.references) for r in records]
    want = _direct(flat, meteor)
    # BLEU / CIDEr split on any whitespace and METEOR sees collapsed lines: same as flattened.
    for key in (*captions.BLEU_KEYS, "METEOR", "CIDEr"):
        assert _close(idc[key], want[key]), key


def test_protocol_argument_is_checked():
    with pytest.raises(ValueError, match="protocol"):
        idc_protocol.evaluate_with_protocol(RECORDS, protocol="ptb")
    with pytest.raises(ValueError, match="spice"):
        idc_protocol.evaluate_with_protocol(RECORDS, protocol="idc", spice="maybe")
    assert idc_protocol.PROTOCOLS == ("coco", "idc")


def test_idc_meteor_line_matches_idc_wrapper():
    line = idc_protocol._idc_meteor_line("a |||  b\tc\n", ["x  y", " z"])
    assert line == "SCORE ||| x y ||| z ||| a b c "
