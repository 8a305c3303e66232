"""Caption evaluation that reproduces the official change-captioning protocol.

The SCORER / DIRL ``evaluate.py`` scores generated captions with ``pycocoevalcap``'s
``COCOEvalCap``: PTB tokenisation (Stanford CoreNLP 3.4.1, Java) of both the predictions and the
references, then BLEU-1..4, METEOR 1.5, ROUGE-L, CIDEr and SPICE.  It scores every subset of the
test set (all semantic pairs, each change type, the distractor / no-change pairs and the total) as a
*separate* ``COCOEvalCap`` run, so CIDEr's document frequencies (and BLEU's corpus statistics) are
recomputed per subset.  This module does the same, with two cost savings that do not change any
number:

* the PTB tokeniser runs once for every caption of every subset (it tokenises line by line, so one
  Java call gives the same tokens as the two calls per subset that ``COCOEvalCap`` makes);
* one METEOR process serves every subset (each subset is still its own ``EVAL`` request, exactly as
  ``Meteor.compute_score`` does it), and SPICE, whose per-caption scores do not depend on the other
  captions, runs once over the union of the subsets and is averaged per subset in the order the
  official wrapper averages it.

SPICE needs the Stanford CoreNLP 3.6.0 jars in ``pycocoevalcap/spice/lib``.  ``pycocoevalcap``
downloads them on first use; this module never does: when they are missing SPICE is skipped with one
log message per process (``spice="auto"``) or a :class:`SpiceUnavailableError` is raised
(``spice="on"``).

* :func:`score_captions` -- raw scores (in [0, 1], as pycocoevalcap returns them) of one set;
* :func:`score_tokenized` -- several subsets of captions tokenised once (``tokenize.py``);
* :class:`PairCaption`, :func:`evaluate_pairs` -- the papers' table (x100) with per-type rows;
* :func:`format_table` -- the console table.

The other parts of caption evaluation: ``tokenize.py`` (the PTB tokeniser), ``results.py``
(result files, COCO-style reference files), ``idc_protocol.py`` (IDC-PCL's protocol, and a
side-by-side comparison with this one).
"""

from __future__ import annotations

import atexit
import logging
import os
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.meteor.meteor import Meteor
from pycocoevalcap.rouge.rouge import Rouge
from pycocoevalcap.spice import get_stanford_models as _spice_models
from pycocoevalcap.spice import spice as _spice_module

from changecap_jax.errors import UserError
from changecap_jax.evaluators.tokenize import (
    PYCOCOEVALCAP_DIR,
    TokenizedCaptions,
    _require_java,
    _validate,
    tokenize_captions,
)

logger = logging.getLogger(__name__)

BLEU_KEYS: tuple[str, ...] = ("Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4")
#: Metric keys in ``COCOEvalCap`` order; "SPICE" is present only when SPICE ran.
METRIC_KEYS: tuple[str, ...] = (*BLEU_KEYS, "METEOR", "ROUGE_L", "CIDEr", "SPICE")
#: Semantic change types of CLEVR-Change, in the order of the models' type labels.
CHANGE_TYPES: tuple[str, ...] = ("color", "material", "add", "drop", "move")
#: change_type of a distractor (viewpoint / illumination only) pair.
NO_CHANGE = "no_change"
#: Row order of :func:`evaluate_pairs` / :func:`format_table`.
ROW_ORDER: tuple[str, ...] = ("total", "semantic", NO_CHANGE, *CHANGE_TYPES)

_SPICE_MODES = ("auto", "on", "off")
_SPICE_DIR = PYCOCOEVALCAP_DIR / "spice"


class SpiceUnavailableError(UserError, RuntimeError):
    """Raised when ``spice="on"`` is requested but SPICE cannot run here."""


# ---------------------------------------------------------------------------------------------
# SPICE availability
# ---------------------------------------------------------------------------------------------


def _spice_jar() -> Path:
    return _SPICE_DIR / _spice_module.SPICE_JAR


def _corenlp_jars() -> list[Path]:
    """The two jars ``get_stanford_models`` would download (CoreNLP 3.6.0 and its models)."""
    lib = _SPICE_DIR / _spice_models.SPICELIB
    return [lib / f"{_spice_models.JAR}.jar", lib / f"{_spice_models.JAR}-models.jar"]


def _manifest_class_path(jar: Path) -> list[Path]:
    """Entries of the ``Class-Path`` attribute of ``jar``'s manifest, resolved next to the jar."""
    try:
        with zipfile.ZipFile(jar) as zf:
            text = zf.read("META-INF/MANIFEST.MF").decode("utf-8", errors="replace")
    except (OSError, KeyError, zipfile.BadZipFile):
        return []
    # Manifest lines are wrapped at 72 bytes; a continuation line starts with one space.
    unfolded = text.replace("\r\n", "\n").replace("\n ", "")
    for line in unfolded.split("\n"):
        if line.lower().startswith("class-path:"):
            return [jar.parent / entry for entry in line.split(":", 1)[1].split()]
    return []


def spice_missing_files() -> list[Path]:
    """Files SPICE needs that are absent from ``pycocoevalcap/spice`` (empty list: SPICE can run).

    Checks ``spice-1.0.jar``, the two Stanford CoreNLP 3.6.0 jars that pycocoevalcap's
    ``get_stanford_models`` would download into ``spice/lib``, and every other jar listed in the
    ``Class-Path`` of ``spice-1.0.jar``'s manifest.
    """
    spice_jar = _spice_jar()
    needed: list[Path] = [spice_jar, *_corenlp_jars()]
    if spice_jar.is_file():
        needed += _manifest_class_path(spice_jar)
    missing: list[Path] = []
    for path in needed:
        if not path.is_file() and path not in missing:
            missing.append(path)
    return missing


def spice_setup_message(missing: Sequence[Path] | None = None) -> str:
    """A human-readable explanation of why SPICE cannot run and how to enable it."""
    if missing is None:
        missing = spice_missing_files()
    if not missing:
        return "SPICE: all required jars are present."
    lib = _SPICE_DIR / _spice_models.SPICELIB
    url = f"http://nlp.stanford.edu/software/{_spice_models.CORENLP}.zip"
    names = ", ".join(str(p) for p in missing)
    return (
        f"SPICE skipped: missing {names}. SPICE needs Stanford CoreNLP 3.6.0, which cannot be "
        f"downloaded here (this module never downloads). To enable it, fetch {url} elsewhere and "
        f"copy {_spice_models.JAR}.jar and {_spice_models.JAR}-models.jar from its "
        f"{_spice_models.CORENLP}/ folder into {lib}/ (spice-1.0.jar belongs in {_SPICE_DIR}/)."
    )


# The SPICE-skipped notes already logged by this process: a training run evaluates many times
# and the note (a paragraph) would otherwise be repeated at each.
_SPICE_NOTES_LOGGED: set[str] = set()


def _resolve_spice(spice: str) -> bool:
    """Whether SPICE should run for ``spice`` in {"auto", "on", "off"}; logs (once per
    process) / raises as needed."""
    if spice not in _SPICE_MODES:
        raise ValueError(f"spice must be one of {_SPICE_MODES}, got {spice!r}")
    if spice == "off":
        return False
    missing = spice_missing_files()
    if not missing:
        return True
    message = spice_setup_message(missing)
    if spice == "on":
        raise SpiceUnavailableError(message)
    if message not in _SPICE_NOTES_LOGGED:
        _SPICE_NOTES_LOGGED.add(message)
        logger.warning("%s", message)
    return False


# ---------------------------------------------------------------------------------------------
# Scoring
# ---------------------------------------------------------------------------------------------


def _close_meteor(meteor: Meteor) -> None:
    """Stop the METEOR Java process (what ``Meteor.__del__`` does, but deterministically)."""
    proc = meteor.meteor_p
    with meteor.lock:
        if proc.stdin is not None and not proc.stdin.closed:
            proc.stdin.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


_meteor_process: tuple[int, Meteor] | None = None  # (pid of its owner, the process)


def _shared_meteor() -> Meteor:
    """This process's METEOR JVM: started on first use, then reused by every scoring, since
    loading its paraphrase table takes about 10 s and each set is its own EVAL request (sharing
    changes no score). One that has exited, or belongs to a parent process, is replaced; it is
    stopped at exit."""
    global _meteor_process
    if (_meteor_process is None or _meteor_process[0] != os.getpid()
            or _meteor_process[1].meteor_p.poll() is not None):
        meteor = Meteor()
        atexit.register(_close_meteor, meteor)
        _meteor_process = (os.getpid(), meteor)
    return _meteor_process[1]


def _discard_meteor() -> None:
    """Stops the shared METEOR JVM (after a failed request its pipes may be out of step)."""
    global _meteor_process
    if _meteor_process is not None and _meteor_process[0] == os.getpid():
        _close_meteor(_meteor_process[1])
    _meteor_process = None


def _spice_per_image(gts: dict[str, list[str]], res: dict[str, list[str]]) -> dict[str, float]:
    """Per-image SPICE F-scores ("All"/"f"), computed by pycocoevalcap's ``Spice`` scorer."""
    # Spice.__init__ only calls get_stanford_models(), which downloads when a jar is missing;
    # availability has been checked already, and skipping __init__ guarantees no download.
    spice_metric = object.__new__(_spice_module.Spice)
    _, per_image = spice_metric.compute_score(gts, res)
    ids = sorted(gts.keys())
    return {i: float(s["All"]["f"]) for i, s in zip(ids, per_image, strict=True)}


def _plan(
    tokenized: TokenizedCaptions, subsets: Mapping[str, Sequence[str]] | None
) -> dict[str, list[str]]:
    if subsets is None:
        subsets = {"all": list(tokenized.predictions)}
    plan: dict[str, list[str]] = {}
    for name, ids in subsets.items():
        ids = list(ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"subset {name!r} lists an image id more than once")
        for image_id in ids:
            if image_id not in tokenized.predictions:
                raise ValueError(f"subset {name!r}: image id {image_id!r} has no prediction")
        if ids:
            plan[name] = ids
    return plan


def score_tokenized(
    tokenized: TokenizedCaptions,
    subsets: Mapping[str, Sequence[str]] | None = None,
    *,
    spice: str = "auto",
) -> dict[str, dict[str, float]]:
    """Score several subsets of already-tokenised captions, each as its own COCOEvalCap run.

    Each subset gets fresh BLEU / ROUGE-L / CIDEr scorers and its own METEOR ``EVAL`` request, so
    CIDEr's document frequencies come from that subset only: a subset's scores equal scoring that
    subset alone.

    Args:
        tokenized: output of :func:`tokenize_captions`.
        subsets: subset name -> image ids (default: ``{"all": every id}``). Empty subsets are
            skipped (absent from the result).
        spice: "auto" (run SPICE if its jars are present, else log why and skip), "on" (raise
            :class:`SpiceUnavailableError` if it cannot run) or "off".

    Returns:
        subset name -> {"Bleu_1".."Bleu_4", "METEOR", "ROUGE_L", "CIDEr"[, "SPICE"]: raw float}.
    """
    plan = _plan(tokenized, subsets)
    use_spice = _resolve_spice(spice)
    return _score_plan(tokenized, plan, use_spice=use_spice, strict_spice=spice == "on")


def _score_subsets(
    plan: Mapping[str, Sequence[str]],
    references: Mapping[str, Sequence[str]],
    predictions: Mapping[str, str],
    meteor_score: Callable[[Meteor, dict, dict], float],
) -> dict[str, dict[str, float]]:
    """BLEU-1..4, METEOR (``meteor_score`` on the process's shared METEOR JVM), ROUGE-L and
    CIDEr of each subset of ``plan``, scored alone; subsets with the same ids are scored once."""
    results: dict[str, dict[str, float]] = {}
    cache: dict[tuple[str, ...], dict[str, float]] = {}
    meteor = _shared_meteor()
    try:
        for name, ids in plan.items():
            key = tuple(ids)
            if key not in cache:
                gts = {i: list(references[i]) for i in ids}
                res = {i: [predictions[i]] for i in ids}
                scores: dict[str, float] = {}
                bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
                scores.update({k: float(v) for k, v in zip(BLEU_KEYS, bleu, strict=True)})
                scores["METEOR"] = meteor_score(meteor, gts, res)
                scores["ROUGE_L"] = float(Rouge().compute_score(gts, res)[0])
                scores["CIDEr"] = float(Cider().compute_score(gts, res)[0])
                cache[key] = scores
            results[name] = dict(cache[key])
    except BaseException:
        _discard_meteor()
        raise
    return results


def _score_plan(
    tokenized: TokenizedCaptions,
    plan: dict[str, list[str]],
    *,
    use_spice: bool,
    strict_spice: bool,
) -> dict[str, dict[str, float]]:
    if not plan:
        return {}
    _require_java()
    spice_scores: dict[str, float] | None = None
    if use_spice:
        union = list(dict.fromkeys(i for ids in plan.values() for i in ids))
        try:
            spice_scores = _spice_per_image(
                {i: tokenized.references[i] for i in union},
                {i: [tokenized.predictions[i]] for i in union},
            )
        except Exception as exc:
            if strict_spice:
                raise SpiceUnavailableError(f"SPICE failed to run: {exc}") from exc
            logger.warning("SPICE skipped: the SPICE scorer failed (%s)", exc)

    results = _score_subsets(plan, tokenized.references, tokenized.predictions,
                             lambda meteor, gts, res: float(meteor.compute_score(gts, res)[0]))
    if spice_scores is not None:
        for name, ids in plan.items():
            # Spice.compute_score takes np.mean over its sorted image ids.
            values = np.array([spice_scores[i] for i in sorted(ids)])
            results[name]["SPICE"] = float(np.mean(values))
    return results


def score_captions(
    predictions: dict[str, str], references: dict[str, list[str]], *, spice: str = "auto"
) -> dict[str, float]:
    """Score predicted captions exactly like the official ``COCOEvalCap`` run.

    Args:
        predictions: image id -> predicted caption; these ids form the scored set.
        references: image id -> reference captions (extra ids are ignored).
        spice: "auto" | "on" | "off" (see :func:`score_tokenized`).

    Returns:
        {"Bleu_1".."Bleu_4", "METEOR", "ROUGE_L", "CIDEr"[, "SPICE"]: raw score in [0, 1] (CIDEr
        can exceed 1)}, the floats pycocoevalcap returns, unrounded.

    Raises:
        ValueError: naming the id, when a prediction has no references or an empty list.
        SpiceUnavailableError: ``spice="on"`` and SPICE cannot run.
    """
    _validate(predictions, references)
    use_spice = _resolve_spice(spice)  # before any Java work, so "on" fails fast
    tokenized = tokenize_captions(predictions, references)
    plan = _plan(tokenized, {"all": list(predictions)})
    return _score_plan(tokenized, plan, use_spice=use_spice, strict_spice=spice == "on")["all"]


# ---------------------------------------------------------------------------------------------
# Per-pair records and the papers' table
# ---------------------------------------------------------------------------------------------


@dataclass
class PairCaption:
    """One image pair's generated caption and its references.

    Attributes:
        image_id: opaque id, by the official convention "000123.png" for a semantic pair and
            "000123.png_n" for its distractor pair.
        caption: the generated caption.
        references: the ground-truth captions (non-empty).
        change_type: one of :data:`CHANGE_TYPES` for a semantic pair, "no_change" for a
            distractor pair, or "" when the dataset has no change types (e.g. Spot-the-Diff).
    """

    image_id: str
    caption: str
    references: list[str] = field(default_factory=list)
    change_type: str = ""


def _check_records(records: Sequence[PairCaption]) -> None:
    if not records:
        raise ValueError("no records to evaluate")
    seen: set[str] = set()
    allowed = {"", NO_CHANGE, *CHANGE_TYPES}
    for rec in records:
        if rec.image_id in seen:
            raise ValueError(f"duplicate image id {rec.image_id!r}")
        seen.add(rec.image_id)
        if rec.change_type not in allowed:
            raise ValueError(
                f"image id {rec.image_id!r}: unknown change_type {rec.change_type!r} "
                f"(expected one of {sorted(allowed)})"
            )


def _subsets(records: Sequence[PairCaption]) -> dict[str, list[str]]:
    subsets: dict[str, list[str]] = {"total": [r.image_id for r in records]}
    if all(r.change_type == "" for r in records):
        return subsets
    subsets["semantic"] = [r.image_id for r in records if r.change_type != NO_CHANGE]
    subsets[NO_CHANGE] = [r.image_id for r in records if r.change_type == NO_CHANGE]
    for ctype in CHANGE_TYPES:
        subsets[ctype] = [r.image_id for r in records if r.change_type == ctype]
    return {name: ids for name, ids in subsets.items() if ids}


def _table(raw: Mapping[str, Mapping[str, float]],
           subsets: Mapping[str, list[str]]) -> dict[str, Any]:
    """Raw per-subset scores -> the papers' table x100: the total row at the top level, the
    other rows (in ROW_ORDER) as sub-objects, each with its pair count."""

    def row(name: str) -> dict[str, Any]:
        scaled: dict[str, Any] = {k: v * 100.0 for k, v in raw[name].items()}
        scaled["num_pairs"] = len(subsets[name])
        return scaled

    metrics = row("total")
    for name in ROW_ORDER[1:]:
        if name in raw:
            metrics[name] = row(name)
    return metrics


def evaluate_pairs(records: list[PairCaption], *, spice: str = "auto") -> dict[str, Any]:
    """The papers' table: total, semantic, no-change and per-type scores, scaled x100.

    Every row is scored as a separate COCOEvalCap run (per-subset CIDEr idf), with a single PTB
    tokenisation for all records.

    Returns:
        ``{<metric>: total score x100, ..., "num_pairs": N, "semantic": {...}, "no_change": {...},
        "color": {...}, ...}``; each sub-object is ``{<metric>: x100, "num_pairs": n}``. A
        sub-object whose subset is empty is omitted; when every record has change_type "" only
        the total row exists. Metric keys as in :func:`score_captions`; values are unrounded.
    """
    _check_records(records)
    predictions = {r.image_id: r.caption for r in records}
    references = {r.image_id: list(r.references) for r in records}
    _validate(predictions, references)
    use_spice = _resolve_spice(spice)  # before any Java work, so "on" fails fast
    tokenized = tokenize_captions(predictions, references)
    subsets = _subsets(records)
    raw = _score_plan(
        tokenized, _plan(tokenized, subsets), use_spice=use_spice, strict_spice=spice == "on"
    )

    metrics = _table(raw, subsets)
    return metrics


def per_pair_cider(records: Sequence[PairCaption]) -> dict[str, float]:
    """Each pair's CIDEr-D x100 within the whole set (its idf), as the "total" row scores it:
    the mean of these values is the total CIDEr."""
    _check_records(records)
    tokenized = tokenize_captions({r.image_id: r.caption for r in records},
                                  {r.image_id: list(r.references) for r in records})
    ids = [r.image_id for r in records]
    _, scores = Cider().compute_score({i: tokenized.references[i] for i in ids},
                                      {i: [tokenized.predictions[i]] for i in ids})
    return {i: float(v) * 100.0 for i, v in zip(ids, scores, strict=True)}


# (column label, metric key) of the papers' table.
TABLE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("B4", "Bleu_4"),
    ("M", "METEOR"),
    ("R", "ROUGE_L"),
    ("C", "CIDEr"),
    ("S", "SPICE"),
)


METRIC_NAMES = {  # how the table names the metric each column holds
    "Bleu_4": "BLEU-4",
    "METEOR": "METEOR 1.5",
    "ROUGE_L": "ROUGE-L",
    "CIDEr": "CIDEr-D (pycocoevalcap's CIDEr: sigma 6, clipped)",
    "SPICE": "SPICE",
}


def format_table(metrics: Mapping[str, Any]) -> str:
    """Fixed-width text table of an :func:`evaluate_pairs` result, for console logs.

    Rows: total, semantic, no_change, color, material, add, drop, move (those present); columns
    B4, M, R, C, S (when SPICE is present) and N (number of pairs), two decimals. When the
    metrics carry ``dataset``, ``main_metrics`` and ``protocol`` (the trainer adds them from
    the dataset's metadata), lines under the table say which metric the dataset's papers
    rank by and which pairs and references were scored.
    """
    rows: list[tuple[str, Mapping[str, Any]]] = [("total", metrics)]
    for name in ROW_ORDER[1:]:
        sub = metrics.get(name)
        if isinstance(sub, Mapping):
            rows.append((name, sub))
    columns = [(label, key) for label, key in TABLE_COLUMNS if key in metrics]
    name_w = max(len(name) for name, _ in rows)
    header = f"{'':<{name_w}}" + "".join(f" {label:>8}" for label, _ in columns) + f" {'N':>7}"
    lines = [header]
    for name, row in rows:
        cells = []
        for _, key in columns:
            value = row.get(key)
            cells.append(f" {value:>8.2f}" if isinstance(value, int | float) else f" {'-':>8}")
        n = row.get("num_pairs")
        cells.append(f" {n:>7d}" if isinstance(n, int) else f" {'-':>7}")
        lines.append(f"{name:<{name_w}}" + "".join(cells))
    notes = []
    if metrics.get("dataset"):
        notes.append(f"dataset: {metrics['dataset']}")
    if metrics.get("main_metrics"):
        notes.append("main metric(s): " + ", ".join(
            METRIC_NAMES.get(m, m) for m in metrics["main_metrics"]))
    if metrics.get("protocol"):
        notes.append(f"protocol: {metrics['protocol']}")
    notes.append("scores x100; B4 = BLEU-4, M = METEOR, R = ROUGE-L, C = CIDEr-D, S = SPICE")
    return "\n".join([*lines, *notes])
