"""Captions to token ids by the official SCORER / DIRL rules (reference §2.4).

Tokenisation: every "," and ";" becomes its own token, every "." and "?" is deleted, the
string is split on the single space character, ``<START>`` is prepended and ``<END>``
appended. There is no lowercasing and no stripping: a double or leading space yields an
empty-string token, exactly as the official ``tokenize`` does.

Vocabulary: the specials ``<NULL>``=0 (padding), ``<UNK>``=1, ``<START>``=2, ``<END>``=3, then
every other token of the TRAIN captions in Python's sorted (code-point) order. It is saved as
the official ``word -> id`` JSON dict.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence

import numpy as np

from changecap_jax.jsonio import read_json, write_json_atomic

NULL, UNK, START, END = "<NULL>", "<UNK>", "<START>", "<END>"
SPECIAL_TOKENS = (NULL, UNK, START, END)
PAD_ID, UNK_ID, START_ID, END_ID = 0, 1, 2, 3

_KEEP = (";", ",")
_REMOVE = ("?", ".")


class CaptionError(ValueError):
    """A caption that cannot be tokenised or encoded (empty, unknown word, too long)."""


def tokenize(caption: str) -> list[str]:
    """Splits one caption into tokens by the official rules, ``<START>``/``<END>`` included."""
    if not isinstance(caption, str):
        raise CaptionError(f"caption must be a string, got {type(caption).__name__}: {caption!r}")
    for p in _KEEP:
        caption = caption.replace(p, f" {p}")
    for p in _REMOVE:
        caption = caption.replace(p, "")
    words = caption.split(" ")
    if words == [""]:
        raise CaptionError("empty caption: it has no words after tokenisation")
    return [START, *words, END]


class Vocabulary:
    """A word <-> id mapping in the official format."""

    def __init__(self, word_to_id: dict[str, int]):
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
    def build(cls, train_captions: Iterable[str]) -> Vocabulary:
        """Builds the vocabulary from TRAIN captions only (count threshold 1, as the official)."""
        words: set[str] = set()
        for caption in train_captions:
            words.update(tokenize(caption)[1:-1])
        words.difference_update(SPECIAL_TOKENS)
        word_to_id = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
        for w in sorted(words):
            word_to_id[w] = len(word_to_id)
        return cls(word_to_id)

    def encode(
        self,
        caption: str,
        max_len: int | None = None,
        *,
        allow_unk: bool = False,
        unknown_counter: dict[str, int] | None = None,
    ) -> np.ndarray:
        """Caption -> int32 ids ``<START> w.. <END>``, zero-padded to ``max_len``.

        Args:
          caption: the raw caption.
          max_len: pad to this length; a longer caption raises ``CaptionError``.
          allow_unk: False at train time (an unknown word is an error, as the official
            ``allow_unk=0``); True at eval time, where unknown words map to ``<UNK>``.
          unknown_counter: when given, counts each word mapped to ``<UNK>``.
        """
        ids = []
        for tok in tokenize(caption):
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
        unknown_counter: dict[str, int] | None = None,
    ) -> np.ndarray:
        """Encodes several captions into a (N, max_len) int32 array."""
        out = np.zeros((len(captions), max_len), np.int32)
        for n, caption in enumerate(captions):
            out[n] = self.encode(
                caption, max_len, allow_unk=allow_unk, unknown_counter=unknown_counter
            )
        return out

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Ids -> text: skips a leading ``<START>``, stops at the first ``<NULL>`` or ``<END>``."""
        words = []
        for n, i in enumerate(np.asarray(ids).tolist()):
            if n == 0 and i == START_ID:
                continue
            if i in (PAD_ID, END_ID):
                break
            words.append(self.id_to_word[int(i)])
        return " ".join(words)

    def save(self, path: str | os.PathLike) -> None:
        """Writes the official word -> id JSON atomically."""
        write_json_atomic(path, self.word_to_id)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Vocabulary:
        data = read_json(path, "vocabulary file")
        if not isinstance(data, dict):
            raise ValueError(f"vocabulary file {path} must hold a word -> id object")
        try:
            return cls({str(w): int(i) for w, i in data.items()})
        except ValueError as e:
            raise ValueError(f"vocabulary file {path}: {e}") from e


def max_caption_length(captions: Iterable[str]) -> int:
    """Longest tokenised caption, ``<START>``/``<END>`` included (the official L_h5)."""
    return max(len(tokenize(c)) for c in captions)


def log_unknown_words(counter: dict[str, int], where: str) -> None:
    """Warns once about words mapped to ``<UNK>``."""
    if counter:
        total = sum(counter.values())
        top = ", ".join(f"{w!r}x{n}" for w, n in sorted(counter.items(), key=lambda x: -x[1])[:10])
        logging.warning("%s: %d unknown word occurrences mapped to <UNK> (%s)", where, total, top)
