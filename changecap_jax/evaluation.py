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

Public API:

* :func:`score_captions` -- raw scores (in [0, 1], as pycocoevalcap returns them) of one set;
* :func:`tokenize_captions` + :func:`score_tokenized` -- tokenise once, score several subsets;
* :class:`PairCaption`, :func:`evaluate_pairs` -- the papers' table (x100) with per-type rows;
* :func:`format_table`, :func:`write_results` -- console table and atomic result files;
* :func:`coco_reference_file`, :func:`references_from_coco` -- the official COCO-style GT files;
* :data:`PROTOCOLS`, :func:`evaluate_pairs_idc`, :func:`evaluate_with_protocol`,
  :func:`score_captions_idc`, :func:`compare_protocols`, :func:`format_protocol_comparison` --
  the IDC-PCL protocol and a side-by-side comparison with the COCO one.

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

import atexit
import logging
import os
import re
import shutil
import subprocess
import tempfile
import zipfile
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
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
from pycocoevalcap.tokenizer import ptbtokenizer as _ptb

from changecap_jax.errors import UserError
from changecap_jax.jsonio import write_json_atomic

logger = logging.getLogger(__name__)

__all__ = [
    "BLEU_KEYS",
    "CHANGE_TYPES",
    "IDC_METRIC_KEYS",
    "IDC_SUBSET_NOTE",
    "METRIC_KEYS",
    "NO_CHANGE",
    "PROTOCOLS",
    "PairCaption",
    "SpiceUnavailableError",
    "TokenizedCaptions",
    "coco_reference_file",
    "compare_protocols",
    "evaluate_pairs",
    "evaluate_pairs_idc",
    "evaluate_with_protocol",
    "format_protocol_comparison",
    "format_table",
    "ptb_tokenize",
    "references_from_coco",
    "score_captions",
    "score_captions_idc",
    "score_tokenized",
    "spice_missing_files",
    "spice_setup_message",
    "tokenize_captions",
    "write_results",
]

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
# pycocoevalcap is a namespace package (no __init__.py), so locate it through a submodule.
_PKG_DIR = Path(_ptb.__file__).resolve().parent.parent
_TOKENIZER_JAR = _PKG_DIR / "tokenizer" / _ptb.STANFORD_CORENLP_3_4_1_JAR
_SPICE_DIR = _PKG_DIR / "spice"
# A line appended after the real captions so that trailing empty captions are not at the end of
# the tokeniser's input (where a missing final newline would otherwise be ambiguous).
_SENTINEL = "sentinel"


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
# Tokenisation
# ---------------------------------------------------------------------------------------------


def _require_java() -> str:
    java = shutil.which("java")
    if java is None:
        raise RuntimeError(
            "caption evaluation needs a Java runtime ('java' on PATH) for the PTB tokenizer, "
            "METEOR and SPICE"
        )
    return java


def _one_line(caption: str) -> str:
    # pycocoevalcap replaces "\n" by " "; the tokenizer also breaks lines at "\r", U+2028, ...,
    # which would shift every later caption, so every line break Python knows becomes a space.
    return " ".join(caption.splitlines()) if caption else caption


def ptb_tokenize(captions: Mapping[Hashable, Sequence[str]]) -> dict[Hashable, list[str]]:
    """PTB-tokenise captions exactly like ``pycocoevalcap``'s ``PTBTokenizer``, in one Java call
    at most.

    Runs ``edu.stanford.nlp.process.PTBTokenizer -preserveLines -lowerCase`` from the same
    ``stanford-corenlp-3.4.1.jar`` and removes the same punctuation tokens.  Differences, which
    change no token of a well-formed caption: the temporary input file lives in the system temp
    directory rather than inside site-packages, every line break (not only ``"\\n"``) inside a
    caption becomes a space, and the number of output lines is checked.

    Lines tokenised before in this process are taken from a memo (``-preserveLines`` tokenises
    each line on its own), so scoring the same captions again, as each evaluator of an
    evaluation does, starts no Java process.

    Args:
        captions: key -> list of raw caption strings (keys may be any hashable).

    Returns:
        key -> list of tokenised captions (lowercased, space-joined tokens), same order.
    """
    keys: list[Hashable] = []
    lines: list[str] = []
    for key, caps in captions.items():
        for cap in caps:
            if not isinstance(cap, str):
                raise TypeError(f"caption for {key!r} is not a string: {cap!r}")
            keys.append(key)
            lines.append(_one_line(cap))
    new_lines = list(dict.fromkeys(line for line in lines if line not in _TOKENIZED))
    if new_lines:
        if len(_TOKENIZED) + len(new_lines) > _TOKENIZED_LIMIT:
            _TOKENIZED.clear()
        _TOKENIZED.update(zip(new_lines, _run_ptb_tokenizer(new_lines), strict=True))
    out: dict[Hashable, list[str]] = {key: [] for key in captions}
    for key, line in zip(keys, lines, strict=True):
        out[key].append(_TOKENIZED[line])
    return out


_TOKENIZED: dict[str, str] = {}  # one line -> its tokenised form, this process's memo
_TOKENIZED_LIMIT = 1_000_000  # lines; the memo restarts beyond it


def _run_ptb_tokenizer(lines: list[str]) -> list[str]:
    """One Java PTBTokenizer call on ``lines`` (no line breaks inside): their tokenised forms,
    punctuation tokens removed."""
    java = _require_java()
    fd, tmp_name = tempfile.mkstemp(prefix="ptb_", suffix=".txt")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write("\n".join([*lines, _SENTINEL]).encode("utf-8"))
        cmd = [
            java,
            "-cp",
            str(_TOKENIZER_JAR),
            "edu.stanford.nlp.process.PTBTokenizer",
            "-preserveLines",
            "-lowerCase",
            tmp_name,
        ]
        proc = subprocess.run(cmd, capture_output=True, check=False)
    finally:
        os.remove(tmp_name)
    if proc.returncode != 0:
        raise RuntimeError(
            f"PTBTokenizer failed (exit {proc.returncode}): {proc.stderr.decode(errors='replace')}"
        )
    token_lines = proc.stdout.decode("utf-8").split("\n")
    if len(token_lines) < len(lines) + 1 or token_lines[len(lines)].strip() != _SENTINEL:
        raise RuntimeError(
            f"PTBTokenizer returned {len(token_lines)} lines for {len(lines)} captions; "
            "the caption/line alignment is broken"
        )
    punct = set(_ptb.PUNCTUATIONS)
    return [" ".join(w for w in line.rstrip().split(" ") if w not in punct)
            for line in token_lines[:len(lines)]]


@dataclass(frozen=True)
class TokenizedCaptions:
    """PTB-tokenised predictions and references, keyed by image id (see :func:`tokenize_captions`).

    Attributes:
        predictions: image id -> tokenised predicted caption.
        references: image id -> tokenised reference captions (non-empty list).
    """

    predictions: dict[str, str]
    references: dict[str, list[str]]


def _validate(predictions: Mapping[str, str], references: Mapping[str, Sequence[str]]) -> None:
    if not predictions:
        raise ValueError("no predictions to score")
    for image_id, caption in predictions.items():
        if not isinstance(caption, str):
            raise TypeError(f"prediction for {image_id!r} is not a string: {caption!r}")
        if image_id not in references:
            raise ValueError(f"no references for image id {image_id!r}")
        refs = references[image_id]
        if isinstance(refs, str):
            raise TypeError(f"references for {image_id!r} must be a list of strings, not a string")
        if len(refs) == 0:
            raise ValueError(f"empty reference list for image id {image_id!r}")


def tokenize_captions(
    predictions: Mapping[str, str], references: Mapping[str, Sequence[str]]
) -> TokenizedCaptions:
    """Validate and PTB-tokenise predictions and their references with one Java call.

    Only the references of ids in ``predictions`` are tokenised (others are ignored).

    Raises:
        ValueError: naming the id, when a prediction has no references or an empty list.
    """
    _validate(predictions, references)
    raw: dict[Hashable, list[str]] = {}
    for image_id, caption in predictions.items():
        raw[("pred", image_id)] = [caption]
        raw[("ref", image_id)] = list(references[image_id])
    tok = ptb_tokenize(raw)
    return TokenizedCaptions(
        predictions={i: tok[("pred", i)][0] for i in predictions},
        references={i: tok[("ref", i)] for i in predictions},
    )


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


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


_CAPTION_FIELDS = ("image_id", "caption", "references", "change_type")


def write_results(
    workdir: str | os.PathLike[str],
    split: str,
    step: int,
    records: list[PairCaption],
    metrics: dict[str, Any],
    extra: dict[str, dict[str, Any]] | None = None,
) -> tuple[Path, Path]:
    """Write the captions and metrics files of one evaluation.

    Paths: ``<workdir>/captions/<split>_<step>.json`` and ``<workdir>/metrics/<split>_<step>.json``.

    The captions file is in COCO result format (a list of ``{"image_id", "caption"}``) with
    ``"references"`` and ``"change_type"`` added to each entry, plus the fields of
    ``extra[image_id]`` when given. The metrics file holds ``metrics`` as is (full floats). Both are
    written atomically (temp file in the target directory, then ``os.replace``).

    Returns:
        (captions path, metrics path).

    Raises:
        ValueError: when ``extra`` names an id that is not in ``records`` or a reserved field.
    """
    extra = extra or {}
    ids = {r.image_id for r in records}
    unknown = [i for i in extra if i not in ids]
    if unknown:
        raise ValueError(f"extra has ids that are not in records: {unknown[:5]!r}")
    entries: list[dict[str, Any]] = []
    for rec in records:
        entry: dict[str, Any] = {
            "image_id": rec.image_id,
            "caption": rec.caption,
            "references": list(rec.references),
            "change_type": rec.change_type,
        }
        fields = extra.get(rec.image_id, {})
        clash = [k for k in fields if k in _CAPTION_FIELDS]
        if clash:
            raise ValueError(f"extra[{rec.image_id!r}] overrides reserved fields {clash!r}")
        entry.update(fields)
        entries.append(entry)
    root = Path(workdir)
    name = f"{split}_{step}.json"
    captions_path = root / "captions" / name
    metrics_path = root / "metrics" / name
    write_json_atomic(captions_path, entries)
    write_json_atomic(metrics_path, metrics)
    return captions_path, metrics_path


def coco_reference_file(records: Iterable[PairCaption]) -> dict[str, Any]:
    """The official COCO-caption GT dict (like ``total_change_captions_reformat.json``).

    ``"images"`` lists ``{"filename": id, "id": id}`` once per record and ``"annotations"``
    ``{"caption", "id": running int, "image_id"}`` per reference; ``"info"``, ``"licenses"`` and
    ``"type"`` are filled with the same placeholders as the official files so that older
    coco-caption loaders accept it.
    """
    info = {
        k: "dummy" for k in ("contributor", "date_created", "description", "url", "version", "year")
    }
    gt: dict[str, Any] = {
        "info": info,
        "licenses": info,
        "type": "captions",
        "images": [],
        "annotations": [],
    }
    count = 0
    for rec in records:
        gt["images"].append({"filename": rec.image_id, "id": rec.image_id})
        for caption in rec.references:
            gt["annotations"].append({"caption": caption, "id": count, "image_id": rec.image_id})
            count += 1
    return gt


def references_from_coco(gt: Mapping[str, Any]) -> dict[str, list[str]]:
    """Read references back from a COCO-caption GT dict: image id -> list of captions.

    Ids are returned as strings (``str(image_id)``). The order follows ``"images"`` when present
    (duplicates collapsed, as in Spot-the-Diff's official GT file), then annotation order; images
    without annotations are left out.

    Raises:
        ValueError: naming the missing key / entry when the input is malformed.
    """
    if not isinstance(gt, Mapping):
        raise ValueError(f"COCO GT must be a dict, got {type(gt).__name__}")
    if "annotations" not in gt:
        raise ValueError("COCO GT is missing the 'annotations' key")
    annotations = gt["annotations"]
    if not isinstance(annotations, list):
        raise ValueError("COCO GT 'annotations' must be a list")
    order: list[str] = []
    images = gt.get("images")
    if images is not None:
        if not isinstance(images, list):
            raise ValueError("COCO GT 'images' must be a list")
        for k, img in enumerate(images):
            if not isinstance(img, Mapping) or "id" not in img:
                raise ValueError(f"COCO GT 'images'[{k}] is missing the 'id' key")
            order.append(str(img["id"]))
    refs: dict[str, list[str]] = {}
    for k, ann in enumerate(annotations):
        if not isinstance(ann, Mapping):
            raise ValueError(f"COCO GT 'annotations'[{k}] is not a dict")
        for key in ("image_id", "caption"):
            if key not in ann:
                raise ValueError(f"COCO GT 'annotations'[{k}] is missing the {key!r} key")
        if not isinstance(ann["caption"], str):
            raise ValueError(f"COCO GT 'annotations'[{k}]['caption'] is not a string")
        refs.setdefault(str(ann["image_id"]), []).append(ann["caption"])
    ordered = {i: refs[i] for i in dict.fromkeys(order) if i in refs}
    ordered.update({i: c for i, c in refs.items() if i not in ordered})
    return ordered


# ---------------------------------------------------------------------------------------------
# The IDC-PCL protocol (yaolinli/IDC eval/eval_models.py + eval/eval.py)
# ---------------------------------------------------------------------------------------------


#: Evaluation protocols :func:`evaluate_with_protocol` accepts ("coco" is :func:`evaluate_pairs`).
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
