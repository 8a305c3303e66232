"""Word classes for rewriting captions: which words may be swapped for which.

IDC-PCL's "Replace" and "Confuse" hard negatives (``data_prep/methods/negative_mining.py``) need to
know, for a caption word, its class (a replacement must come from the same class) and its
*sense* (a replacement must mean something else: "tiny" for "small" is a paraphrase, not a
negative). The paper tags nouns and adjectives with Stanford CoreNLP; we build the classes
in three layers, earlier layers winning:

1. **Seed lexicon** (:data:`LEXICON`): the attribute words of CLEVR-style captions, by
   semantic class, each split into senses (synonym groups): colour (gray = grey, red, ...),
   size (small = tiny, large = big = huge), material (rubber = matte, metal = metallic =
   shiny), shape (cube = block, sphere = ball, cylinder), side (left, right), and the
   generic nouns thing = object (a head noun that is never replaced: swapping "thing" for
   "cube" need not change the meaning). It is *checked against the training vocabulary*:
   only lexicon words that occur in the training captions are used, the absent ones are
   reported, and a class with fewer than two senses present cannot replace anything.
   A second check compares every present lexicon word with the classes' distributional
   profiles (below) and reports a word whose captions place it clearly (cosine margin 0.1)
   nearer another class than its own, e.g. a colour word used as a noun.
2. **Distributional expansion** (always, from the training captions): each word is described
   by the positive PMI of its left and right neighbours (sentence ends included), L2
   normalised. A content word (alphabetic, not a function word, document frequency >=
   ``min_df``) outside the lexicon joins the lexicon class whose centroid it is closest to
   when the cosine is >= :data:`EXPAND_MIN_COSINE` (0.9), as a sense of its own. The lexicon
   covers every attribute word of the CLEVR-Change vocabulary, and on synthetic captions
   this adds nothing (tested; within the lexicon, shapes and the generic nouns are the
   closest distinct classes, at ~0.84, which is why "thing"/"object" need the lexicon); it
   catches an unlisted attribute word (tested with "magenta" in place of "purple").
3. **spaCy part-of-speech tags**, only when ``spacy`` imports and an English pipeline
   package is installed (``spacy.load`` of an installed package, nothing is downloaded):
   every other training word gets its majority Penn tag over the training captions, and the
   noun/adjective tags (NN, NNS, NNP, NNPS, JJ, JJR, JJS) become classes, as in the paper.
   Their replacement pools follow the paper's appendix A.2: the words that were among the
   top-50 % TF-IDF tagged words of at least one training caption, with document frequency
   >= ``min_df`` (paper: 10). Each word of a POS class is a sense of its own. Without spaCy
   these words have no class, so captions without lexicon words cannot be rewritten by
   "Replace" (the caller falls back and counts it).

Noun phrases (for "Confuse") are read off the classes: an optional determiner, then a run of
classed words that ends at the last *head* word in it (a shape / generic noun, or a NN* tag):
"the small red metal cube", "the thing", "the parked car" (with spaCy).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

# class -> (is a head noun class, replaceable, senses); every word lowercase.
LEXICON: dict[str, tuple[bool, bool, tuple[tuple[str, ...], ...]]] = {
    "colour": (False, True, (
        ("gray", "grey"), ("red",), ("blue",), ("green",), ("brown",), ("purple",), ("cyan",),
        ("yellow",), ("white",), ("black",), ("orange",), ("pink",), ("silver",),
        ("gold", "golden"),
    )),
    "size": (False, True, (("small", "tiny"), ("large", "big", "huge"))),
    "material": (False, True, (("rubber", "matte"), ("metal", "metallic", "shiny"))),
    "shape": (True, True, (("cube", "block"), ("sphere", "ball"), ("cylinder",))),
    "side": (False, True, (("left",), ("right",))),
    "generic": (True, False, (("thing", "object"),)),
}

NOUN_TAGS = frozenset({"NN", "NNS", "NNP", "NNPS"})
ADJ_TAGS = frozenset({"JJ", "JJR", "JJS"})

# Words that open a noun phrase. ("no" is left out: "there is no change" names no object.)
DETERMINERS = frozenset({
    "the", "a", "an", "this", "that", "these", "those", "another", "its", "his", "her",
    "their", "our", "my", "your", "each", "every", "some", "any",
})

# Closed-class English words, never expanded into a lexicon class.
FUNCTION_WORDS = DETERMINERS | frozenset({
    "and", "or", "but", "nor", "of", "to", "in", "on", "at", "by", "for", "from", "with",
    "into", "onto", "over", "under", "behind", "front", "near", "next", "than", "as", "is",
    "are", "was", "were", "be", "been", "being", "has", "have", "had", "do", "does", "did",
    "will", "would", "can", "could", "should", "may", "might", "must", "it", "they", "them",
    "there", "here", "not", "no", "now", "then", "so", "very", "which", "who", "whom",
    "what", "where", "when", "while", "both", "all", "one", "two", "three", "up", "down",
    "out", "off", "i", "you", "he", "she", "we", "me", "him", "us", "more", "less", "most",
    "also", "only", "just", "still",
})

EXPAND_MIN_COSINE = 0.9
INCONSISTENT_MARGIN = 0.1  # small training sets give noisy profiles; report clear cases only
START, END = "<s>", "</s>"


@dataclasses.dataclass
class WordClasses:
    """Class and sense of each known word, and the replacement pools.

    ``pools[cls]`` maps each sense of a class to its words (all training words); a word's
    replacements are the words of the *other* senses of its class.
    """

    word_class: dict[str, str]
    sense: dict[str, str]
    pools: dict[str, dict[str, tuple[str, ...]]]
    head_classes: frozenset[str]
    replaceable_classes: frozenset[str]
    source: str  # "lexicon" or "lexicon+spacy:<package>"
    missing_lexicon: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    expanded: dict[str, str] = dataclasses.field(default_factory=dict)
    inconsistent: dict[str, str] = dataclasses.field(default_factory=dict)

    def class_of(self, word: str) -> str | None:
        return self.word_class.get(word.lower())

    def sense_of(self, word: str) -> str | None:
        return self.sense.get(word.lower())

    def is_head(self, word: str) -> bool:
        return self.class_of(word) in self.head_classes

    def in_phrase(self, word: str) -> bool:
        """Whether the word can be part of a noun phrase (any classed word)."""
        return self.class_of(word) is not None

    def can_replace(self, word: str) -> bool:
        """A replaceable class that has a word of another sense to put in its place."""
        cls = self.class_of(word)
        if cls not in self.replaceable_classes:
            return False
        return any(s != self.sense_of(word) for s in self.pools.get(cls, {}))

    def replacement(self, word: str, rng: np.random.Generator) -> str:
        """A word of the same class and another sense: a uniform sense, then a uniform word."""
        cls, own = self.class_of(word), self.sense_of(word)
        senses = sorted(s for s in self.pools[cls] if s != own)
        words = self.pools[cls][senses[int(rng.integers(len(senses)))]]
        return words[int(rng.integers(len(words)))]

    def noun_phrases(self, words: Sequence[str]) -> list[tuple[int, int]]:
        """[start, end) spans: optional determiner + classed words ending at a head word."""
        spans, i, n = [], 0, len(words)
        while i < n:
            j = i + 1 if words[i].lower() in DETERMINERS else i
            k, last_head = j, -1
            while k < n and self.in_phrase(words[k]):
                if self.is_head(words[k]):
                    last_head = k
                k += 1
            if last_head >= 0:
                spans.append((i, last_head + 1))
                i = last_head + 1
            else:
                i += 1
        return spans


def context_profiles(token_lists: Iterable[Sequence[str]]) -> tuple[list[str], np.ndarray]:
    """Words and their L2-normalised PPMI vectors over left/right neighbours (lowercased)."""
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for tokens in token_lists:
        padded = [START, *(t.lower() for t in tokens), END]
        for i in range(1, len(padded) - 1):
            counts[padded[i]]["L:" + padded[i - 1]] += 1
            counts[padded[i]]["R:" + padded[i + 1]] += 1
    words = sorted(counts)
    features = sorted({f for c in counts.values() for f in c})
    index = {f: i for i, f in enumerate(features)}
    m = np.zeros((len(words), len(features)), np.float64)
    for r, w in enumerate(words):
        for f, c in counts[w].items():
            m[r, index[f]] = c
    if not words:
        return words, m
    p = m / m.sum()
    expected = p.sum(1, keepdims=True) * p.sum(0, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        pmi = np.where(p > 0, np.log(p / np.where(expected > 0, expected, 1.0)), 0.0)
    v = np.maximum(pmi, 0.0)
    norms = np.linalg.norm(v, axis=1, keepdims=True)
    return words, v / np.where(norms > 0, norms, 1.0)


def _top_half(weights: Sequence[float]) -> list[int]:
    """Indices of the top ceil(n/2) weights (ties: earlier first)."""
    order = sorted(range(len(weights)), key=lambda i: (-weights[i], i))
    return order[: math.ceil(len(weights) / 2)]


def build_word_classes(
    token_lists: Sequence[Sequence[str]],
    idf: Mapping[str, float],
    *,
    pos_tags: Mapping[str, str] | None = None,
    pos_source: str = "",
    min_df: int = 10,
) -> WordClasses:
    """Word classes from the training captions' tokens (see the module docstring).

    Args:
      token_lists: the training captions, tokenised (no <START>/<END>).
      idf: lowercase word -> inverse document frequency over those captions (for the POS
        pools' top-50 % rule).
      pos_tags: lowercase word -> its majority Penn tag over the training captions (spaCy), or
        None for the lexicon-only fallback.
      pos_source: what tagged them, for the report (e.g. "spacy:en_core_web_sm").
      min_df: document frequency a non-lexicon word needs to join a class.
    """
    df = collections.Counter(w for tokens in token_lists for w in {t.lower() for t in tokens})
    word_class, sense, pools, missing = _lexicon_classes(df)

    # Distributional expansion and the lexicon's consistency check.
    words, vectors = context_profiles(token_lists)
    row = {w: i for i, w in enumerate(words)}
    members: dict[str, list[int]] = collections.defaultdict(list)
    for w, cls in word_class.items():
        if w in row:
            members[cls].append(row[w])
    centroids = {c: _unit_centroid(vectors, r) for c, r in members.items()}
    centroids = {c: v for c, v in centroids.items() if v is not None}
    expanded = _expanded_words(words, vectors, row, centroids, word_class, df, min_df)
    for w, cls in expanded.items():
        word_class[w], sense[w] = cls, w
        pools.setdefault(cls, {})[w] = [w]
    inconsistent = _inconsistent_words(vectors, row, members, centroids, word_class,
                                       expanded, df, min_df)

    # spaCy layer: POS classes for the remaining nouns and adjectives (paper A.2 pools).
    source = "lexicon"
    if pos_tags is not None:
        source = f"lexicon+{pos_source or 'pos'}"
        _add_pos_classes(token_lists, idf, pos_tags, df, min_df, word_class, sense, pools)

    head_classes = {c for c, (head, _, _) in LEXICON.items() if head}
    head_classes |= {f"pos:{t}" for t in NOUN_TAGS}
    replaceable = {c for c, (_, rep, _) in LEXICON.items() if rep}
    replaceable |= {f"pos:{t}" for t in NOUN_TAGS | ADJ_TAGS}
    return WordClasses(
        word_class=word_class,
        sense=sense,
        pools={c: {s: tuple(ws) for s, ws in sorted(v.items())} for c, v in pools.items()},
        head_classes=frozenset(head_classes),
        replaceable_classes=frozenset(replaceable),
        source=source,
        missing_lexicon=missing,
        expanded=expanded,
        inconsistent=inconsistent,
    )


def _lexicon_classes(df: Mapping[str, int]) -> tuple[dict, dict, dict, dict]:
    """The lexicon's words that occur in the captions: (word -> class, word -> sense,
    class -> sense -> words, class -> the lexicon words that never occur)."""
    word_class: dict[str, str] = {}
    sense: dict[str, str] = {}
    pools: dict[str, dict[str, list[str]]] = {}
    missing: dict[str, list[str]] = {}
    for cls, (_, _, senses) in LEXICON.items():
        for group in senses:
            for w in group:
                if df[w] == 0:
                    missing.setdefault(cls, []).append(w)
                    continue
                word_class[w], sense[w] = cls, group[0]
                pools.setdefault(cls, {}).setdefault(group[0], []).append(w)
    for cls, senses in pools.items():
        if len(senses) < 2 and LEXICON[cls][1]:
            logging.info("lexicon class %r has one sense in the training captions: it cannot "
                         "be replaced", cls)
    return word_class, sense, pools, missing


def _unit_centroid(vectors: np.ndarray, rows: list[int]) -> np.ndarray | None:
    """The normalised sum of ``vectors[rows]`` (None for no rows or a zero sum)."""
    if not rows:
        return None
    c = vectors[rows].sum(0)
    n = np.linalg.norm(c)
    return c / n if n > 0 else None


def _expanded_words(words: Sequence[str], vectors: np.ndarray, row: Mapping[str, int],
                    centroids: Mapping[str, np.ndarray], word_class: Mapping[str, str],
                    df: Mapping[str, int], min_df: int) -> dict[str, str]:
    """Frequent content words outside the lexicon whose context profile lies near a class
    centroid: word -> that class."""
    expanded: dict[str, str] = {}
    if not centroids:
        return expanded
    names = sorted(centroids)
    cmat = np.stack([centroids[c] for c in names])
    for w in words:
        if (w in word_class or w in FUNCTION_WORDS or not w.isalpha()
                or df[w] < min_df):
            continue
        sims = cmat @ vectors[row[w]]
        best = int(np.argmax(sims))
        if sims[best] >= EXPAND_MIN_COSINE:
            expanded[w] = names[best]
    return expanded


def _inconsistent_words(vectors: np.ndarray, row: Mapping[str, int],
                        members: Mapping[str, list[int]], centroids: Mapping[str, np.ndarray],
                        word_class: Mapping[str, str], expanded: Mapping[str, str],
                        df: Mapping[str, int], min_df: int) -> dict[str, str]:
    """Lexicon words whose captions place them nearer another class: word -> that class."""
    inconsistent: dict[str, str] = {}
    for w, cls in sorted(word_class.items()):
        if w not in row or w in expanded or df[w] < min_df:
            continue
        own = _unit_centroid(vectors, [r for r in members[cls] if r != row[w]])
        if own is None:
            continue
        v = vectors[row[w]]
        own_sim = float(own @ v)
        for other, c in centroids.items():
            if other != cls and float(c @ v) > own_sim + INCONSISTENT_MARGIN:
                inconsistent[w] = other
                break
    return inconsistent


def _add_pos_classes(token_lists: Sequence[Sequence[str]], idf: Mapping[str, float],
                     pos_tags: Mapping[str, str], df: Mapping[str, int], min_df: int,
                     word_class: dict[str, str], sense: dict[str, str],
                     pools: dict[str, dict[str, list[str]]]) -> None:
    """Adds a "pos:<tag>" class for each remaining noun and adjective; pools hold the words in
    the top half (by idf) of some caption's tagged words (in place)."""
    pos_words = {w: t for w, t in pos_tags.items()
                 if t in NOUN_TAGS | ADJ_TAGS and w not in word_class and w.isalpha()}
    pooled: set[str] = set()
    for tokens in token_lists:
        tagged = [t.lower() for t in tokens if t.lower() in pos_words]
        weights = [idf.get(w, 0.0) * tagged.count(w) for w in tagged]
        pooled.update(tagged[i] for i in _top_half(weights))
    for w, tag in pos_words.items():
        word_class[w], sense[w] = f"pos:{tag}", w
        if w in pooled and df[w] >= min_df:
            pools.setdefault(f"pos:{tag}", {})[w] = [w]


def spacy_tagger(
    package: str | None = None,
) -> tuple[Callable[[Sequence[Sequence[str]]], dict[str, str]], str] | None:
    """A function mapping tokenised captions to lowercase word -> majority Penn tag, from an
    installed English spaCy pipeline (``package`` or the first of the installed ones), and
    its name; None when spaCy or an English pipeline is not installed (nothing is
    downloaded)."""
    try:
        import spacy
        from spacy.tokens import Doc
    except ImportError:
        return None
    try:
        names = [package] if package else sorted(spacy.util.get_installed_models())
    except Exception:  # noqa: BLE001 - an odd spaCy install means "no tagger", not a crash
        return None
    nlp, chosen = None, ""
    for name in names:
        try:
            candidate = spacy.load(name, exclude=["parser", "ner", "lemmatizer", "senter"])
        except Exception:  # noqa: BLE001 - a broken package: try the next one
            continue
        if candidate.lang == "en":
            nlp, chosen = candidate, name
            break
    if nlp is None:
        return None

    def tag(token_lists: Sequence[Sequence[str]]) -> dict[str, str]:
        votes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        unique = sorted({tuple(t for t in ts if t.strip()) for ts in token_lists} - {()})
        for ws in unique:
            doc = Doc(nlp.vocab, words=list(ws))  # our tokens, not spaCy's tokenisation
            for _, component in nlp.pipeline:
                doc = component(doc)
            for tok in doc:
                votes[tok.text.lower()][tok.tag_] += 1
        # Majority tag; ties by tag name, so the result does not depend on order.
        return {w: min(c.items(), key=lambda kv: (-kv[1], kv[0]))[0] for w, c in votes.items()}

    return tag, f"spacy:{chosen}"
