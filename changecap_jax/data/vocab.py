"""Captions to token ids, by each dataset's official rules.

Tokenisers (:data:`TOKENIZERS`; each returns the words with ``<START>``/``<END>`` around them):

* ``clevr`` — SCORER / DIRL / RCC (reference §2.4), used for CLEVR-Change, CLEVR-DC and
  Spot-the-Diff: every "," and ";" becomes its own token, every "." and "?" is deleted, the
  string is split on the single space character. No lowercasing and no stripping: a double or
  leading space yields an empty-string token, exactly as the official ``tokenize`` does.
* ``ier`` — Image Editing Request (airsplay ``src/tok.py``, datasets.md §4): split on runs of
  non-word characters (kept), strip and lowercase each piece, drop empty pieces; a piece made
  only of punctuation becomes one token per character unless it is all dots.
* ``whitespace`` — Birds-to-Words, whose descriptions are already tokenised and lowercased:
  split on any whitespace.

Vocabulary: the specials ``<NULL>``=0 (padding), ``<UNK>``=1, ``<START>``=2, ``<END>``=3, then
the words. By default (SCORER / DIRL) every token of the TRAIN captions, in Python's sorted
(code-point) order; IER orders words by descending frequency and keeps those seen at least 3
times (:meth:`Vocabulary.build`). It is saved as the official ``word -> id`` JSON dict; the
tokeniser's name is kept in the dataset's ``meta.json``.

Section numbers (§) and quirk ids (S-Q, D-Q, I-Q) refer to docs/official/ (see its README.md).
"""

from __future__ import annotations

import collections
import logging
import os
import re
import string
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from changecap_jax.errors import UserError
from changecap_jax.io.jsonio import read_json, write_json_atomic

NULL, UNK, START, END = "<NULL>", "<UNK>", "<START>", "<END>"
SPECIAL_TOKENS = (NULL, UNK, START, END)
PAD_ID, UNK_ID, START_ID, END_ID = 0, 1, 2, 3

_KEEP = (";", ",")
_REMOVE = ("?", ".")


class CaptionError(UserError, ValueError):
    """A caption that cannot be tokenised or encoded (empty, unknown word, too long)."""


def _check_text(caption: object) -> str:
    if not isinstance(caption, str):
        raise CaptionError(f"caption must be a string, got {type(caption).__name__}: {caption!r}")
    return caption


def tokenize(caption: str) -> list[str]:
    """Splits one caption by the official SCORER / DIRL rules, ``<START>``/``<END>`` included."""
    caption = _check_text(caption)
    for p in _KEEP:
        caption = caption.replace(p, f" {p}")
    for p in _REMOVE:
        caption = caption.replace(p, "")
    words = caption.split(" ")
    if words == [""]:
        raise CaptionError("empty caption: it has no words after tokenisation")
    return [START, *words, END]


_IER_SPLIT = re.compile(r"(\W+)")


def tokenize_ier(caption: str) -> list[str]:
    """Image Editing Request rules (airsplay ``src/tok.py``), ``<START>``/``<END>`` included."""
    words: list[str] = []
    for piece in _IER_SPLIT.split(_check_text(caption).strip()):
        piece = piece.strip().lower()
        if not piece:
            continue
        if all(c in string.punctuation for c in piece) and not all(c == "." for c in piece):
            words.extend(piece)  # "!?" -> "!", "?"; "..." stays one token
        else:
            words.append(piece)
    if not words:
        raise CaptionError(f"empty caption {caption!r}: it has no words after tokenisation")
    return [START, *words, END]


def tokenize_whitespace(caption: str) -> list[str]:
    """Already tokenised text (Birds-to-Words): split on whitespace."""
    words = _check_text(caption).split()
    if not words:
        raise CaptionError(f"empty caption {caption!r}: it has no words after tokenisation")
    return [START, *words, END]


TOKENIZERS: dict[str, Callable[[str], list[str]]] = {
    "clevr": tokenize,
    "ier": tokenize_ier,
    "whitespace": tokenize_whitespace,
}


def get_tokenizer(name: str) -> Callable[[str], list[str]]:
    if name not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {name!r}; known: {sorted(TOKENIZERS)}")
    return TOKENIZERS[name]


class Vocabulary:
    """A word <-> id mapping in the official format."""

    def __init__(self, word_to_id: dict[str, int], tokenizer: str = "clevr"):
        self.tokenizer = tokenizer
        self._tokenize = get_tokenizer(tokenizer)
        for i, tok in enumerate(SPECIAL_TOKENS):
            if word_to_id.get(tok) != i:
                raise ValueError(
                    f"vocabulary must map {tok!r} to {i}, found {word_to_id.get(tok)!r}"
                )
        ids = sorted(word_to_id.values())
        if ids != list(range(len(ids))):
            raise ValueError("vocabulary ids must be exactly 0..V-1 with no gaps or repeats")
        self.word_to_id = dict(word_to_id)
        self.id_to_word = {i: w for w, i in word_to_id.items()}

    def __len__(self) -> int:
        return len(self.word_to_id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vocabulary) and self.word_to_id == other.word_to_id

    @classmethod
    def build(
        cls,
        captions: Iterable[str],
        tokenizer: str = "clevr",
        *,
        min_count: int = 1,
        order: str = "sorted",
    ) -> Vocabulary:
        """Builds the vocabulary from the given (training) captions.

        Args:
          captions: the captions the official script builds from (TRAIN only for SCORER /
            DIRL; train + valid for IER).
          tokenizer: a name in :data:`TOKENIZERS`.
          min_count: words seen fewer times are left out (official threshold 1; IER 3).
          order: "sorted" (code-point order, SCORER / DIRL) or "frequency" (most frequent
            first, ties in order of first appearance, as ``Counter.most_common``; IER).
        """
        if order not in ("sorted", "frequency"):
            raise ValueError(f"order must be 'sorted' or 'frequency', got {order!r}")
        tokenize_fn = get_tokenizer(tokenizer)
        counts: collections.Counter[str] = collections.Counter()
        for caption in captions:
            counts.update(tokenize_fn(caption)[1:-1])
        for special in SPECIAL_TOKENS:
            counts.pop(special, None)
        kept = [w for w, n in counts.most_common() if n >= min_count]
        if order == "sorted":
            kept.sort()
        word_to_id = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
        for w in kept:
            word_to_id[w] = len(word_to_id)
        return cls(word_to_id, tokenizer)

    def tokenize(self, caption: str) -> list[str]:
        """The caption's tokens by this vocabulary's tokeniser, ``<START>``/``<END>`` included."""
        return self._tokenize(caption)

    def encode(
        self,
        caption: str,
        max_len: int | None = None,
        *,
        allow_unk: bool = False,
        unknown_counter: dict[str, int] | None = None,
        truncate: bool = False,
    ) -> np.ndarray:
        """Caption -> int32 ids ``<START> w.. <END>``, zero-padded to ``max_len``.

        Args:
          caption: the raw caption.
          max_len: pad to this length; a longer caption raises ``CaptionError``.
          allow_unk: False at train time (an unknown word is an error, as the official
            ``allow_unk=0``); True at eval time, where unknown words map to ``<UNK>``.
          unknown_counter: when given, counts each word mapped to ``<UNK>``.
          truncate: cut a longer caption to ``max_len`` with a forced ``<END>`` (IER's
            rule) instead of raising.
        """
        ids = []
        for tok in self._tokenize(caption):
            i = self.word_to_id.get(tok)
            if i is None:
                if not allow_unk:
                    raise CaptionError(
                        f"word {tok!r} of caption {caption!r} is not in the vocabulary "
                        "(unknown words are an error at train time)"
                    )
                i = UNK_ID
                if unknown_counter is not None:
                    unknown_counter[tok] = unknown_counter.get(tok, 0) + 1
            ids.append(i)
        if max_len is None:
            max_len = len(ids)
        if len(ids) > max_len and truncate:
            ids = [*ids[: max_len - 1], END_ID]
        if len(ids) > max_len:
            raise CaptionError(
                f"caption {caption!r} has {len(ids)} tokens with <START>/<END>, "
                f"more than max_len={max_len}"
            )
        out = np.zeros((max_len,), np.int32)
        out[: len(ids)] = ids
        return out

    def encode_many(
        self, captions: Sequence[str], max_len: int, *, allow_unk: bool = False,
        unknown_counter: dict[str, int] | None = None, truncate: bool = False,
    ) -> np.ndarray:
        """Encodes several captions into a (N, max_len) int32 array."""
        out = np.zeros((len(captions), max_len), np.int32)
        for n, caption in enumerate(captions):
            out[n] = self.encode(
                caption, max_len, allow_unk=allow_unk, unknown_counter=unknown_counter,
                truncate=truncate,
            )
        return out

    def decode(self, ids: Sequence[int] | np.ndarray,
               extra_tokens: Mapping[int, str] | None = None) -> str:
        """Ids -> text: skips a leading ``<START>``, stops at the first ``<NULL>`` or ``<END>``.
        ``extra_tokens`` names ids a model emits beyond the vocabulary (e.g. its [MASK] row)."""
        extra = extra_tokens or {}
        words = []
        for n, i in enumerate(np.asarray(ids).tolist()):
            if n == 0 and i == START_ID:
                continue
            if i in (PAD_ID, END_ID):
                break
            word = self.id_to_word.get(int(i), extra.get(int(i)))
            if word is None:
                raise ValueError(f"id {i} is neither in the vocabulary ({len(self)} words) nor "
                                 f"one of the model's extra tokens {sorted(extra)}")
            words.append(word)
        return " ".join(words)

    def save(self, path: str | os.PathLike) -> None:
        """Writes the official word -> id JSON atomically."""
        write_json_atomic(path, self.word_to_id)

    @classmethod
    def load(cls, path: str | os.PathLike, tokenizer: str = "clevr") -> Vocabulary:
        data = read_json(path, "vocabulary file")
        if not isinstance(data, dict):
            raise ValueError(f"vocabulary file {path} must hold a word -> id object")
        try:
            return cls({str(w): int(i) for w, i in data.items()}, tokenizer)
        except ValueError as e:
            raise ValueError(f"vocabulary file {path}: {e}") from e


def max_caption_length(captions: Iterable[str], tokenizer: str = "clevr") -> int:
    """Longest tokenised caption, ``<START>``/``<END>`` included (the official L_h5)."""
    tokenize_fn = get_tokenizer(tokenizer)
    return max(len(tokenize_fn(c)) for c in captions)


def log_unknown_words(counter: dict[str, int], where: str) -> None:
    """Warns once about words mapped to ``<UNK>``."""
    if counter:
        total = sum(counter.values())
        top = ", ".join(f"{w!r}x{n}" for w, n in sorted(counter.items(), key=lambda x: -x[1])[:10])
        logging.warning("%s: %d unknown word occurrences mapped to <UNK> (%s)", where, total, top)
