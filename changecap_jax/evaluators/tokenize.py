"""The PTB tokeniser of the COCO caption protocol (Stanford CoreNLP 3.4.1, Java, through
pycocoevalcap's jar): :func:`ptb_tokenize`, and :func:`tokenize_captions`, which tokenises every
caption of every subset in one Java call (it tokenises line by line, so one call gives the same
tokens as the two calls per subset that ``COCOEvalCap`` makes).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pycocoevalcap.tokenizer import ptbtokenizer as _ptb

logger = logging.getLogger(__name__)

# pycocoevalcap is a namespace package (no __init__.py), so locate it through a submodule.
PYCOCOEVALCAP_DIR = Path(_ptb.__file__).resolve().parent.parent
_TOKENIZER_JAR = PYCOCOEVALCAP_DIR / "tokenizer" / _ptb.STANFORD_CORENLP_3_4_1_JAR
# A line appended after the real captions so that trailing empty captions are not at the end of
# the tokeniser's input (where a missing final newline would otherwise be ambiguous).
_SENTINEL = "sentinel"


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
