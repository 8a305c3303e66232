"""IDC-PCL's caption-scoring protocol, beside the COCO one of ``captions.py``.

:data:`PROTOCOLS`, :func:`evaluate_pairs_idc`, :func:`evaluate_with_protocol`,
:func:`score_captions_idc`, :func:`compare_protocols`, :func:`format_protocol_comparison`.

Two protocols
-------------
"coco" (SCORER, DIRL; :func:`evaluate_pairs`) is the protocol above.  "idc" reproduces IDC-PCL's
``eval/eval_models.py`` + ``eval/eval.py`` (yaolinli/IDC), which differs in:

* tokeniser: none.  The strings are scored as given (IDC's data files store captions already
  tokenised, space-separated); nothing is lowercased and no punctuation is removed, so "Cube."
  and "cube" are different words.  BLEU and CIDEr split on whitespace, ROUGE-L on single spaces;
  METEOR gets each SCORE line with every whitespace run collapsed (IDC's wrapper does that).
* scorers: the coco-caption BLEU-1..4 ("closest" reference length), METEOR 1.5 (same jar and
  ``-l en -norm``), ROUGE-L (beta 1.2) and CIDEr (sigma 6, clipped, i.e. CIDEr-D; IDC's separate
  "CIDErD" scorer gives the same numbers) -- the scorer code is pycocoevalcap's, so only the inputs
  differ.  SPICE is commented out in IDC's evaluator and never computed.
* references: all of a pair's references, matched by exact id (IDC: "<img1>_<img2>").
* subsets: IDC scores every pair in one run (CLEVR-Change: semantic and distractor together, the
  number the paper reports); it has no subset scoring.  :func:`evaluate_pairs_idc` still returns
  the semantic / no-change / per-type rows, each scored alone (as running IDC's script on a
  filtered result file), and labels them (``"subset_rows"``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from pycocoevalcap.meteor.meteor import Meteor

from changecap_jax.evaluators.captions import (
    BLEU_KEYS,
    ROW_ORDER,
    TABLE_COLUMNS,
    PairCaption,
    _check_records,
    _resolve_spice,
    _score_subsets,
    _subsets,
    _table,
    evaluate_pairs,
)
from changecap_jax.evaluators.tokenize import _require_java, _validate

logger = logging.getLogger(__name__)

PROTOCOLS: tuple[str, ...] = ("coco", "idc")
#: Metric keys of an IDC-protocol result (IDC's evaluator has SPICE commented out).
IDC_METRIC_KEYS: tuple[str, ...] = (*BLEU_KEYS, "METEOR", "ROUGE_L", "CIDEr")
#: The label :func:`evaluate_pairs_idc` puts on its per-subset rows.
IDC_SUBSET_NOTE = (
    "IDC's evaluator reports only the total; each other row is that subset scored alone with "
    "the same scorers (as IDC's eval_models.py run on a filtered result file)"
)
_WHITESPACE_RUN = re.compile(r"\s+")


def _idc_meteor_line(hypothesis: str, references: Sequence[str]) -> str:
    """The ``SCORE`` line IDC's METEOR wrapper sends for one pair.

    IDC removes ``|||`` from the hypothesis only, joins, then collapses every whitespace run of the
    whole line into one space (pycocoevalcap only replaces double spaces in the hypothesis), so
    line breaks inside a caption cannot desynchronise the Java process.
    """
    line = " ||| ".join(("SCORE", " ||| ".join(references), hypothesis.replace("|||", "")))
    return _WHITESPACE_RUN.sub(" ", line)


def _idc_meteor(
    meteor: Meteor, gts: Mapping[str, list[str]], res: Mapping[str, list[str]]
) -> float:
    """Corpus METEOR of one set, sent to an open pycocoevalcap ``Meteor`` process the IDC way.

    Same jar, arguments (``-stdio -l en -norm``) and SCORE/EVAL exchange as
    ``Meteor.compute_score``; only the SCORE lines differ (:func:`_idc_meteor_line`). IDC also
    starts Java with ``LC_ALL=C``, which can only matter for non-ASCII text.
    """
    proc = meteor.meteor_p
    if proc.stdin is None or proc.stdout is None:
        raise RuntimeError("the METEOR process has no pipes")
    ids = list(gts)
    with meteor.lock:
        stats = []
        for image_id in ids:
            line = _idc_meteor_line(res[image_id][0], gts[image_id])
            proc.stdin.write((line + "\n").encode("utf-8"))
            proc.stdin.flush()
            stats.append(proc.stdout.readline().decode("utf-8").strip())
        proc.stdin.write(("EVAL ||| " + " ||| ".join(stats) + "\n").encode("utf-8"))
        proc.stdin.flush()
        # METEOR answers one line per segment, then the corpus score.
        for _ in ids:
            proc.stdout.readline()
        return float(proc.stdout.readline().decode("utf-8").strip())


def _idc_score_sets(
    predictions: Mapping[str, str],
    references: Mapping[str, Sequence[str]],
    plan: Mapping[str, Sequence[str]],
) -> dict[str, dict[str, float]]:
    """Raw IDC scores of each subset of ``plan``: the strings as given, no tokeniser."""
    _require_java()
    # IDC builds both dicts from the same "img1_img2" keys, in result-file order. It also
    # prints "CIDErD" (eval/ciderD, df="corpus"): the same numbers as CIDEr.
    return _score_subsets(plan, references, predictions, _idc_meteor)


def score_captions_idc(
    predictions: Mapping[str, str], references: Mapping[str, Sequence[str]]
) -> dict[str, float]:
    """Score one set of captions like IDC-PCL's ``eval_models.py`` (raw floats, no SPICE).

    No PTB tokenisation, lowercasing or punctuation removal: BLEU and CIDEr split the strings on
    whitespace, ROUGE-L on single spaces, METEOR gets them whitespace-collapsed.
    """
    _validate(predictions, references)
    return _idc_score_sets(predictions, references, {"all": list(predictions)})["all"]


def evaluate_pairs_idc(records: list[PairCaption]) -> dict[str, Any]:
    """The table of :func:`evaluate_pairs`, scored with IDC-PCL's protocol (x100, no SPICE).

    The total row is IDC's reported number: every pair (CLEVR-Change: semantic and distractor
    together) in one run, so CIDEr's idf comes from all pairs. IDC's code has no subset scoring;
    the semantic / no_change / per-type rows score each subset alone, like :func:`evaluate_pairs`
    does, and the result says so (``"subset_rows"``).

    Returns:
        ``evaluate_pairs``' shape without "SPICE", plus ``"eval_protocol": "idc"`` and, when there
        are subset rows, ``"subset_rows"``: :data:`IDC_SUBSET_NOTE`.
    """
    _check_records(records)
    predictions = {r.image_id: r.caption for r in records}
    references = {r.image_id: list(r.references) for r in records}
    _validate(predictions, references)
    subsets = _subsets(records)
    raw = _idc_score_sets(predictions, references, subsets)

    metrics = _table(raw, subsets)
    metrics["eval_protocol"] = "idc"
    if len(raw) > 1:
        metrics["subset_rows"] = IDC_SUBSET_NOTE
    return metrics


def evaluate_with_protocol(
    records: list[PairCaption], *, protocol: str = "coco", spice: str = "auto"
) -> dict[str, Any]:
    """:func:`evaluate_pairs` ("coco") or :func:`evaluate_pairs_idc` ("idc").

    ``spice`` applies to "coco" only; "idc" never computes SPICE.
    """
    if protocol == "coco":
        return evaluate_pairs(records, spice=spice)
    if protocol == "idc":
        _resolve_spice(spice)  # still reject a misspelt mode
        return evaluate_pairs_idc(records)
    raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")


def compare_protocols(records: list[PairCaption], spice: str = "off") -> dict[str, Any]:
    """Score the same records with both protocols: ``{"coco": ..., "idc": ...}``."""
    return {
        "coco": evaluate_with_protocol(records, protocol="coco", spice=spice),
        "idc": evaluate_with_protocol(records, protocol="idc", spice="off"),
    }


_COMPARE_COLUMNS = TABLE_COLUMNS[:4]  # B4 M R C: the metrics both protocols compute


def format_protocol_comparison(result: Mapping[str, Mapping[str, Any]]) -> str:
    """Side-by-side text table of a :func:`compare_protocols` result.

    Rows total, semantic, no_change, per type (those present in either protocol); columns B4 M R C
    of "coco", then of "idc", then N; two decimals, "-" where a row lacks a value.
    """
    names = [p for p in PROTOCOLS if p in result]
    rows = ["total"] + [
        n for n in ROW_ORDER[1:] if any(isinstance(result[p].get(n), Mapping) for p in names)
    ]

    def row_of(protocol: str, name: str) -> Mapping[str, Any]:
        data = result[protocol]
        if name == "total":
            return data
        sub = data.get(name)
        return sub if isinstance(sub, Mapping) else {}

    name_w = max(len(n) for n in rows)
    group_w = 8 * len(_COMPARE_COLUMNS)
    top = f"{'':<{name_w}}" + "".join(f" {p:-^{group_w - 1}}" for p in names)
    header = f"{'':<{name_w}}" + "".join(
        "".join(f" {label:>7}" for label, _ in _COMPARE_COLUMNS) for _ in names
    ) + f" {'N':>7}"
    lines = [top, header]
    for name in rows:
        cells = []
        n_pairs: Any = None
        for p in names:
            data = row_of(p, name)
            for _, key in _COMPARE_COLUMNS:
                value = data.get(key)
                cells.append(f" {value:>7.2f}" if isinstance(value, int | float) else f" {'-':>7}")
            n_pairs = data.get("num_pairs", n_pairs)
        cells.append(f" {n_pairs:>7d}" if isinstance(n_pairs, int) else f" {'-':>7}")
        lines.append(f"{name:<{name_w}}" + "".join(cells))
    lines.append("scores x100; B4 = BLEU-4, M = METEOR, R = ROUGE-L, C = CIDEr-D")
    lines.append("coco: PTB-tokenised (lowercased, punctuation removed), every row its own run")
    lines.append("idc: strings as given (whitespace split), no SPICE; total = all pairs in one "
                 "run,")
    lines.append("     other rows scored alone (IDC's code reports only the total)")
    return "\n".join(lines)
