"""Hard negative captions for IDC-PCL's Fine-grained Difference Aligning (FDA) pretraining.

    python -m data_prep.hard_negatives --data_dir=DIR --dataset=NAME [--variant=V] [--seed=0]
        [--out=DIR] [--splits=train,val] [--pos=auto|spacy|lexicon] [--min_df=10]
        [--option=num_train=40 ...]   (synthetic only: the options it was built with)

(the command of ``data_prep/hard_negatives.py``; ``data_prep/first_use.py`` runs it for the
synthetic dataset on first use).

IDC-PCL (Yao et al., AAAI 2022, §2.2 and appendix A.2) contrasts each image pair with its
caption and 6 rewritten captions, 2 of each kind: Retrieve, Replace, Confuse. The authors
distributed their files (``{train,val}_neg_tfidf6.json``, Baidu archive) but not the code
that made them, so this is our own construction, seeded and deterministic. The inputs are a
built dataset's pairs that carry captions: each record's semantic pair (``change_captions``)
and, where the dataset has a distractor, its no-change pair (``no_change_captions``), in
every split.

Captions are tokenised by the dataset's tokeniser (``vocab.tokenize``); two captions are *equal*
when their lowercased tokens are (so "the cube moved." equals "the cube moved"). A negative is
never equal to any reference of its pair, nor to another negative of the pair where avoidable.

**TF-IDF** (the paper's similarity and word importance), fitted on the TRAIN captions only:
every reference of every train pair is a document; terms are the lowercased tokens with a
letter or digit; idf(w) = ln((1 + N) / (1 + df(w))) + 1 (N documents, df(w) of them contain w);
a caption's vector is count(w) * idf(w) over train terms (others ignored), L2-normalised.
A pair's query vector is the normalised sum of its distinct references' vectors.

**Retrieve**: the candidates are the distinct captions of the *other* pairs of the same split
(each split is its own pool; the val file depends on train only through idf), minus those equal
to a reference of the pair. For a no-change pair the other no-change captions are left out too:
they paraphrase its own ("nothing has changed" vs "there is no change") and would be false
negatives. Candidates are ranked by cosine with the pair's query; exact ties (to 1e-6) are
broken by a seeded random order of the pool. The first two are the Retrieve negatives. (A
caption of another pair that paraphrases this pair's change is not detected; the paper's
retrieval has the same blind spot.)

**Replace**: a reference of the pair (drawn at random) is rewritten: its words that have a
replaceable class with a word of another sense available (``data/word_classes.py``:
colour, size, material, shape, side, and with spaCy the noun/adjective tags) are ranked by TF-IDF
weight in the caption (ties: earlier first); the top ceil(50 %) are each replaced by a word of
the same class and another sense (uniform over the other senses, then over their words), so
"small" never becomes its synonym "tiny". New draws (cycling over the references) until two
distinct results that equal no reference, at most 12 tries.

**Confuse**, in this order:

1. *swap within a sentence*: for each reference, with its noun phrases NP0 (the subject) ...
   NPk (see ``WordClasses.noun_phrases``): swap NP0 with each later NPj of different text
   ("the red cube left of the sphere" -> "the sphere left of the red cube"), and swap each
   classed word of NP0 with each later word of the same class and another sense, i.e. the
   subject's attribute with the object/complement ("the red cube changed to blue" -> "the blue
   cube changed to red"). The words are the same, the order differs. Two are drawn at random
   from all such results (over all references).
2. *swap subjects across sentences*, for the slots still empty: a reference's subject NP0 is
   replaced by the subject of one of the pair's 32 nearest Retrieve-ranked captions, when
   that subject contradicts the pair's subjects (it names, for a class the pair's subjects
   use, a sense none of them has: "the small red rubber cube" for a pair whose subjects say
   "metal"; a subject that only drops attributes, e.g. "the red cube", may name the same
   object and is not used). Donors are drawn from the first 10 such subjects.

**Fallbacks** (counted and printed): a kind that cannot give 2 distinct negatives for a pair
fills its empty slots with the pair's next Retrieve neighbours (ranks 3, 4, ..., skipping
any text already used), labelled ``retrieve-for-replace`` / ``retrieve-for-confuse``. Typical
cases: no-change captions ("there is no change" has no attribute word and no object), captions
without a replaceable word. Only if the split has too few distinct captions are negatives
repeated (``repeat``); a pair with no possible negative at all is an error.

**Randomness**: every pair draws from its own ``numpy.random.Generator`` seeded with
``[seed, crc32(split), pair index]``, so a pair's negatives depend only on the seed, the
training captions and its split's captions. The same seed gives identical files.

**Output** (``--out``, default the dataset's directory): ``{split}_neg_tfidf6.json`` per split,
the official name (``neg_name = "neg_tfidf6"`` in the IDC config), so one naming rule and one
reader (``changecap_jax.data.negatives.load_negatives``, re-exported here; the pretraining
pipeline reads the files with it) serve our files and the authors'. The format is the official
one: JSON lines, one object per pair, ``{"img1", "img2", "sentences": [references],
"neg_samples": [6 negatives]}`` (the official loader takes ``neg_samples`` in file order after
the positive). ``img1``/``img2`` follow the CLEVR-Change naming the IDC loader relies on
(``<prefix>_default_<image_id>``, ``<prefix>_semantic_<image_id>`` or ``..._nonsemantic_...``,
prefix ``CLEVR`` for the CLEVR-style datasets). We add two keys, which a reader that looks
keys up by name (as the official loader does) passes over: ``image_id`` (the record's id in
our datasets) and ``neg_kinds`` (how each negative was made). Files are written atomically
(temp file + ``os.replace``).

Cost: ranking is one matrix product per batch of pairs against the split's distinct captions;
at CLEVR-Change scale (72k train pairs, 42k distinct captions) the negatives take ~100 s on
CPU, on top of reading the records (which hold the features too).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import os
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from changecap_jax import console
from changecap_jax.data import word_classes as wc
from changecap_jax.data.vocab import CaptionError
from changecap_jax.errors import UserError
from changecap_jax.io.jsonio import atomic_write

NUM_PER_KIND = 2
DEFAULT_SEED = 0
DEFAULT_MIN_DF = 10  # paper: 10
KINDS = ("retrieve", "replace", "confuse")
NEIGHBOURS = 32  # retrieve-ranked captions kept per pair (fallbacks and subject donors)
DONOR_CHOICES = 10
REPLACE_TRIES = 12
TIE_DECIMALS = 6
CLEVR_STYLE = ("synthetic", "clevr_change", "clevr_dc")


class HardNegativeError(UserError, RuntimeError):
    """Negatives cannot be built (e.g. a split with no other caption to retrieve)."""


# ----------------------------------------------------------------------------- captions, pairs


@dataclasses.dataclass(frozen=True)
class Caption:
    text: str  # as stored in the dataset
    tokens: tuple[str, ...]  # tokeniser output without <START>/<END>

    @functools.cached_property
    def key(self) -> tuple[str, ...]:
        return caption_key(self.tokens)


@dataclasses.dataclass
class Pair:
    image_id: str
    semantic: bool  # False: a distractor (no-change) pair
    references: list[Caption]


def caption_key(tokens: Iterable[str]) -> tuple[str, ...]:
    """What two captions must share to count as equal: their lowercased non-empty tokens."""
    return tuple(t.lower() for t in tokens if t.strip())


def _is_term(word: str) -> bool:
    return any(ch.isalnum() for ch in word)


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def read_pairs(
    prepared: Any, split: str, *, progress: bool = False
) -> tuple[list[Pair], collections.Counter]:
    """The caption-bearing pairs of one split (semantic, then no-change, per record) and what
    was skipped (captions the tokeniser rejects, pairs left with no caption)."""
    source = prepared.split(split)
    pairs: list[Pair] = []
    skipped: collections.Counter = collections.Counter()
    for index in _progress(range(len(source)), progress, f"reading {split}"):
        record = source[index]
        image_id = _text(record["image_id"])
        for key, semantic in (("change_captions", True), ("no_change_captions", False)):
            if key not in record:
                continue
            refs = []
            for raw in np.asarray(record[key]).reshape(-1).tolist():
                text = _text(raw)
                try:
                    tokens = tuple(prepared.vocab.tokenize(text)[1:-1])
                except CaptionError:
                    skipped["unusable reference caption"] += 1
                    continue
                if caption_key(tokens):
                    refs.append(Caption(text, tokens))
                else:
                    skipped["unusable reference caption"] += 1
            if refs:
                pairs.append(Pair(image_id, semantic, refs))
            elif semantic:
                skipped["pair without a usable caption"] += 1
    return pairs, skipped


def _progress(items: Any, enabled: bool, desc: str) -> Any:
    if not enabled:
        return items
    return console.Progress(items, desc=desc,
                            unit="pair" if "reading" not in desc else "record", mininterval=1.0)


# ----------------------------------------------------------------------------- TF-IDF


class TfIdf:
    """TF-IDF over training captions (formula in the module docstring)."""

    def __init__(self, documents: Iterable[tuple[str, ...]]):
        df: collections.Counter[str] = collections.Counter()
        n = 0
        for key in documents:
            n += 1
            df.update({w for w in key if _is_term(w)})
        self.num_documents = n
        self.terms = sorted(df)
        self.index = {w: i for i, w in enumerate(self.terms)}
        self.idf = {w: math.log((1 + n) / (1 + df[w])) + 1.0 for w in self.terms}
        self._idf = np.array([self.idf[w] for w in self.terms], np.float64)

    def weights(self, key: Sequence[str]) -> list[float]:
        """Each token's count-in-caption x idf (0 for a token that is not a train term)."""
        counts = collections.Counter(key)
        return [counts[w] * self.idf.get(w, 0.0) for w in key]

    def matrix(self, keys: Sequence[tuple[str, ...]]) -> np.ndarray:
        """(len(keys), terms) float32 rows, L2-normalised (a row of unknown words stays 0)."""
        m = np.zeros((len(keys), len(self.terms)), np.float64)
        for r, key in enumerate(keys):
            for w in key:
                j = self.index.get(w)
                if j is not None:
                    m[r, j] += 1.0
        m *= self._idf
        norms = np.linalg.norm(m, axis=1, keepdims=True)
        return (m / np.where(norms > 0, norms, 1.0)).astype(np.float32)


@dataclasses.dataclass
class Pool:
    """The distinct captions of one split, with which pairs own them."""

    keys: list[tuple[str, ...]]
    texts: list[str]  # first stored text of each key
    tokens: list[tuple[str, ...]]
    no_change: np.ndarray  # (U,) bool: some no-change pair has this caption
    pair_refs: list[np.ndarray]  # per pair: pool indices of its references

    @classmethod
    def build(cls, pairs: Sequence[Pair]) -> Pool:
        index: dict[tuple[str, ...], int] = {}
        keys, texts, tokens, no_change, pair_refs = [], [], [], [], []
        for pair in pairs:
            own = []
            for ref in pair.references:
                k = ref.key
                if k not in index:
                    index[k] = len(keys)
                    keys.append(k)
                    texts.append(ref.text)
                    tokens.append(ref.tokens)
                    no_change.append(False)
                if not pair.semantic:
                    no_change[index[k]] = True
                own.append(index[k])
            pair_refs.append(np.array(sorted(set(own)), np.int64))
        return cls(keys, texts, tokens, np.array(no_change, bool), pair_refs)


def rank_neighbours(
    pairs: Sequence[Pair], pool: Pool, tfidf: TfIdf, tiebreak: np.ndarray,
    count: int = NEIGHBOURS, *, batch: int = 256, progress: bool = False, desc: str = "",
) -> list[np.ndarray]:
    """Per pair, the pool indices of its ``count`` best Retrieve candidates, best first.

    Scores are cosines rounded to 1e-6; ``tiebreak`` (a permutation of the pool) orders equal
    scores, lowest first. Both go into one int64 sort key, so a row's top entries come from
    one ``argpartition`` with no tie handling of its own. Pairs with the same references (the
    templated no-change pairs) are ranked once.
    """
    pool_m = tfidf.matrix(pool.keys)
    size = len(pool.keys)
    # Lower key = better: -(rounded score * size + size - 1 - tiebreak); excluded: +1.
    tie_key = (np.asarray(tiebreak, np.int64) - (size - 1))[None, :]
    groups: dict[tuple[bool, tuple[int, ...]], int] = {}
    group_of = [groups.setdefault((p.semantic, tuple(pool.pair_refs[n].tolist())), len(groups))
                for n, p in enumerate(pairs)]
    unique = list(groups)
    ranked: list[np.ndarray] = []
    k = min(count, size)
    for start in _progress(range(0, len(unique), batch), progress, desc or "ranking"):
        chunk = unique[start : start + batch]
        q = np.stack([pool_m[list(refs)].sum(0) for _, refs in chunk])
        norms = np.linalg.norm(q, axis=1, keepdims=True)
        q /= np.where(norms > 0, norms, 1.0)
        scores = np.rint(np.clip(q @ pool_m.T, 0.0, None) * 10**TIE_DECIMALS)
        keys = scores.astype(np.int64)
        keys *= -size
        keys += tie_key
        for r, (semantic, refs) in enumerate(chunk):
            keys[r, list(refs)] = 1  # its own captions
            if not semantic:
                keys[r, pool.no_change] = 1  # paraphrases of its own "no change"
        if k == 0:
            ranked.extend(np.zeros((0,), np.int64) for _ in chunk)
            continue
        top = np.argpartition(keys, k - 1, axis=1)[:, :k]
        for r in range(len(chunk)):
            row = top[r][np.argsort(keys[r, top[r]], kind="stable")]
            ranked.append(row[keys[r, row] <= 0])
    return [ranked[g] for g in group_of]


# ----------------------------------------------------------------------------- rewriting


Renderer = Callable[[Sequence[str]], str | None]


def make_renderer(tokenizer: str, tokenize: Callable[[str], list[str]]) -> Renderer:
    """Tokens -> caption text that the dataset's tokeniser splits back into the same tokens
    (None when it cannot: the candidate is dropped)."""

    def render(tokens: Sequence[str]) -> str | None:
        text = " ".join(tokens)
        if tokenizer == "clevr":  # its tokeniser puts the space before "," and ";" back
            text = text.replace(" ,", ",").replace(" ;", ";")
        try:
            back = tokenize(text)[1:-1]
        except ValueError:
            return None
        return text if tuple(back) == tuple(tokens) else None

    return render


def replace_candidates(tokens: Sequence[str], classes: wc.WordClasses, tfidf: TfIdf) -> list[int]:
    """Positions Replace rewrites: the top ceil(50 %) replaceable words by TF-IDF weight."""
    key = [t.lower() for t in tokens]
    weights = tfidf.weights(key)
    cands = [i for i, t in enumerate(tokens) if t.strip() and classes.can_replace(t)]
    cands.sort(key=lambda i: (-weights[i], i))
    return sorted(cands[: math.ceil(len(cands) / 2)])


def _match_case(new: str, old: str) -> str:
    return new[:1].upper() + new[1:] if old[:1].isupper() else new


def swap_rewrites(tokens: Sequence[str], classes: wc.WordClasses) -> list[list[str]]:
    """Confuse rule 1: subject NP0 swapped with a later NP, or an NP0 word swapped with a later
    word of its class and another sense (the same words in another order)."""
    words = list(tokens)
    nps = classes.noun_phrases(words)
    if not nps:
        return []
    s0, e0 = nps[0]
    out = []
    for s, e in nps[1:]:
        if caption_key(words[s0:e0]) != caption_key(words[s:e]):
            out.append(words[:s0] + words[s:e] + words[e0:s] + words[s0:e0] + words[e:])
    for p in range(s0, e0):
        cls = classes.class_of(words[p])
        if cls not in classes.replaceable_classes:
            continue
        for q in range(e0, len(words)):
            if classes.class_of(words[q]) == cls and (
                    classes.sense_of(words[q]) != classes.sense_of(words[p])):
                new = list(words)
                new[p], new[q] = new[q], new[p]
                out.append(new)
    return out


def subject_span(tokens: Sequence[str], classes: wc.WordClasses) -> tuple[int, int] | None:
    """The subject: the first noun phrase, or None."""
    nps = classes.noun_phrases(tokens)
    return nps[0] if nps else None


def subject_profile(refs: Sequence[Caption], classes: wc.WordClasses) -> dict[str, set[str]]:
    """class -> the senses the pair's subjects (NP0 of each reference) use."""
    profile: dict[str, set[str]] = collections.defaultdict(set)
    for ref in refs:
        span = subject_span(ref.tokens, classes)
        if span:
            for w in ref.tokens[span[0] : span[1]]:
                cls = classes.class_of(w)
                if cls is not None:
                    profile[cls].add(classes.sense_of(w))
    return profile


def contradicts(words: Sequence[str], profile: dict[str, set[str]],
                classes: wc.WordClasses) -> bool:
    """Whether a subject names, for a class the pair's subjects use, a sense they never do."""
    for w in words:
        cls = classes.class_of(w)
        if cls in profile and classes.sense_of(w) not in profile[cls]:
            return True
    return False


class Rewriter:
    """Word classes, TF-IDF and renderer, with the per-caption analyses memoised (captions
    repeat across pairs: CLEVR-Change has ~40k distinct captions for ~80k pairs)."""

    def __init__(self, classes: wc.WordClasses, tfidf: TfIdf, render: Renderer):
        self.classes, self.tfidf, self.render = classes, tfidf, render
        self._positions: dict[tuple[str, ...], list[int]] = {}
        self._swaps: dict[tuple[str, ...], list[list[str]]] = {}
        self._subject: dict[tuple[str, ...], tuple[int, int] | None] = {}

    def positions(self, tokens: tuple[str, ...]) -> list[int]:
        if tokens not in self._positions:
            self._positions[tokens] = replace_candidates(tokens, self.classes, self.tfidf)
        return self._positions[tokens]

    def swaps(self, tokens: tuple[str, ...]) -> list[list[str]]:
        if tokens not in self._swaps:
            self._swaps[tokens] = swap_rewrites(tokens, self.classes)
        return self._swaps[tokens]

    def subject(self, tokens: tuple[str, ...]) -> tuple[int, int] | None:
        if tokens not in self._subject:
            self._subject[tokens] = subject_span(tokens, self.classes)
        return self._subject[tokens]


def replace_rewrites(
    refs: Sequence[Caption], rw: Rewriter, rng: np.random.Generator,
    used: set[tuple[str, ...]], want: int = NUM_PER_KIND,
) -> list[tuple[str, int]]:
    """Up to ``want`` Replace negatives (text, number of replaced words)."""
    plans = [(ref, rw.positions(ref.tokens)) for ref in refs]
    plans = [(ref, pos) for ref, pos in plans if pos]
    if not plans:
        return []
    order = rng.permutation(len(plans))
    out: list[tuple[str, int]] = []
    for attempt in range(REPLACE_TRIES):
        ref, positions = plans[order[attempt % len(plans)]]
        new = list(ref.tokens)
        for p in positions:
            new[p] = _match_case(rw.classes.replacement(new[p], rng), new[p])
        key = caption_key(new)
        text = rw.render(new) if key not in used else None
        if text is not None:
            used.add(key)
            out.append((text, len(positions)))
            if len(out) == want:
                break
    return out


def confuse_rewrites(
    refs: Sequence[Caption], neighbours: np.ndarray, pool: Pool, rw: Rewriter,
    rng: np.random.Generator, used: set[tuple[str, ...]], want: int = NUM_PER_KIND,
) -> list[tuple[str, str]]:
    """Up to ``want`` Confuse negatives (text, "confuse-swap" | "confuse-subject")."""
    out: list[tuple[str, str]] = []
    swaps: dict[tuple[str, ...], list[str]] = {}
    for ref in refs:
        for new in rw.swaps(ref.tokens):
            swaps.setdefault(caption_key(new), new)
    swap_keys = [k for k in swaps if k not in used]
    for j in rng.permutation(len(swap_keys)):
        text = rw.render(swaps[swap_keys[j]])
        if text is not None:
            used.add(swap_keys[j])
            out.append((text, "confuse-swap"))
            if len(out) == want:
                return out

    sources = [(ref, rw.subject(ref.tokens)) for ref in refs]
    sources = [(ref, span) for ref, span in sources if span]
    if not sources:
        return out
    profile = subject_profile(refs, rw.classes)
    donors: dict[tuple[str, ...], tuple[str, ...]] = {}
    for idx in neighbours:
        tokens = pool.tokens[idx]
        span = rw.subject(tokens)
        if span:
            subject = tokens[span[0] : span[1]]
            if contradicts(subject, profile, rw.classes):
                donors.setdefault(caption_key(subject), subject)
                if len(donors) == DONOR_CHOICES:
                    break
    if not donors:
        return out
    donor_list = list(donors.values())
    order = rng.permutation(len(sources))
    for attempt in range(4 * DONOR_CHOICES):
        ref, (s0, e0) = sources[order[attempt % len(sources)]]
        donor = donor_list[int(rng.integers(len(donor_list)))]
        new = [*ref.tokens[:s0], *donor, *ref.tokens[e0:]]
        key = caption_key(new)
        text = rw.render(new) if key not in used else None
        if text is not None:
            used.add(key)
            out.append((text, "confuse-subject"))
            if len(out) == want:
                break
    return out


def pair_negatives(
    pair: Pair, neighbours: np.ndarray, pool: Pool, rw: Rewriter, rng: np.random.Generator,
    kinds: Sequence[str] = KINDS, per_kind: int = NUM_PER_KIND,
) -> tuple[list[str], list[str], list[int]]:
    """The ``per_kind`` negatives of each of ``kinds`` of one pair (6 by default), their kind
    labels, and the replaced-word counts. ``kinds`` starts with "retrieve" (the fallback);
    A.3's caption sources use ("retrieve", "replace") with 3 each."""
    used = {ref.key for ref in pair.references}
    fresh: Iterator[int] = (int(i) for i in neighbours)

    def next_retrieved() -> str | None:
        for idx in fresh:
            if pool.keys[idx] not in used:
                used.add(pool.keys[idx])
                return pool.texts[idx]
        return None

    slots: dict[str, list[tuple[str, str]]] = {}
    retrieved = []
    for _ in range(per_kind):
        text = next_retrieved()
        if text is not None:
            retrieved.append((text, "retrieve"))
    slots["retrieve"] = retrieved
    replaced = (replace_rewrites(pair.references, rw, rng, used, per_kind)
                if "replace" in kinds else [])
    slots["replace"] = [(t, "replace") for t, _ in replaced]
    if "confuse" in kinds:
        slots["confuse"] = confuse_rewrites(pair.references, neighbours, pool, rw, rng, used,
                                            per_kind)
    for kind in kinds[1:]:  # fallback: the next retrieve neighbours
        while len(slots[kind]) < per_kind:
            text = next_retrieved()
            if text is None:
                break
            slots[kind].append((text, f"retrieve-for-{kind}"))
    made = [x for kind in kinds for x in slots[kind]]
    if not made:
        raise HardNegativeError(
            f"pair {pair.image_id!r} ({'semantic' if pair.semantic else 'no-change'}) has no "
            "possible negative: its split has no other caption")
    negatives, labels = [], []
    for kind in kinds:
        for j in range(per_kind):
            if j < len(slots[kind]):
                text, label = slots[kind][j]
            else:  # too few distinct captions in the split: repeat one
                text, label = made[len(negatives) % len(made)][0], f"repeat-for-{kind}"
            negatives.append(text)
            labels.append(label)
    return negatives, labels, [n for _, n in replaced]


# ----------------------------------------------------------------------------- driver


def image_names(dataset: str, image_id: str, semantic: bool) -> tuple[str, str]:
    """img1 / img2 by the CLEVR-Change naming IDC's loader reads the pair kind from."""
    prefix = "CLEVR" if dataset in CLEVR_STYLE else dataset.replace("_", "-")
    kind = "semantic" if semantic else "nonsemantic"
    return f"{prefix}_default_{image_id}", f"{prefix}_{kind}_{image_id}"


@dataclasses.dataclass
class HardNegatives:
    records: dict[str, list[dict[str, Any]]]  # split -> file records
    classes: wc.WordClasses
    summary: dict[str, Any]


def make_word_classes(
    train_tokens: Sequence[Sequence[str]], tfidf: TfIdf, pos: str = "auto",
    spacy_model: str | None = None, min_df: int = 10,
) -> wc.WordClasses:
    """Word classes from the training captions; ``pos``: auto | spacy | lexicon."""
    if pos not in ("auto", "spacy", "lexicon"):
        raise ValueError(f"pos must be auto, spacy or lexicon, got {pos!r}")
    tags, source = None, ""
    if pos != "lexicon":
        tagger = wc.spacy_tagger(spacy_model)
        if tagger is None and pos == "spacy":
            raise HardNegativeError(
                "--pos=spacy: spaCy or an installed English pipeline "
                f"({spacy_model or 'any'}) is missing; install one or use --pos=lexicon")
        if tagger is not None:
            tag, source = tagger
            tags = tag(train_tokens)
    return wc.build_word_classes(train_tokens, tfidf.idf, pos_tags=tags, pos_source=source,
                                 min_df=min_df)


def generate(
    prepared: Any, *, seed: int = DEFAULT_SEED, splits: Sequence[str] | None = None,
    pos: str = "auto", spacy_model: str | None = None, min_df: int = DEFAULT_MIN_DF,
    classes: wc.WordClasses | None = None, progress: bool = False,
) -> HardNegatives:
    """Builds the negatives of every pair of ``splits`` (default: all) of a prepared dataset."""
    available = list(prepared.builder.info.splits.keys())
    order = [s for s in ("train", "val", "valid", "test") if s in available]
    splits = list(splits) if splits else order + sorted(set(available) - set(order))
    for s in splits:
        if s not in available:
            raise HardNegativeError(f"dataset {prepared.name!r} in {prepared.directory} has no "
                                    f"split {s!r}; splits: {sorted(available)}")
    if "train" not in available:
        raise HardNegativeError(f"dataset {prepared.name!r} has no train split to fit TF-IDF on")
    pairs = {"train": read_pairs(prepared, "train", progress=progress)}
    for s in splits:
        if s not in pairs:
            pairs[s] = read_pairs(prepared, s, progress=progress)
    return negatives_for_pairs(
        {s: pairs[s][0] for s in pairs}, prepared.name, prepared.vocab.tokenizer,
        prepared.vocab.tokenize, splits=splits, seed=seed, pos=pos, spacy_model=spacy_model,
        min_df=min_df, classes=classes, progress=progress,
        skipped={s: pairs[s][1] for s in pairs})


def negatives_for_pairs(
    pairs: dict[str, list[Pair]], dataset: str, tokenizer: str,
    tokenize: Callable[[str], list[str]], *, splits: Sequence[str], seed: int = 0,
    pos: str = "auto", spacy_model: str | None = None, min_df: int = 10,
    classes: wc.WordClasses | None = None, progress: bool = False,
    skipped: dict[str, collections.Counter] | None = None,
    kinds: Sequence[str] = KINDS, per_kind: int = NUM_PER_KIND,
) -> HardNegatives:
    """The negatives of ``pairs[split]`` for each of ``splits``; ``pairs["train"]`` fits the
    TF-IDF and the word classes (see :func:`generate`); ``kinds`` / ``per_kind`` as
    :func:`pair_negatives`."""
    if not kinds or kinds[0] != "retrieve" or set(kinds) - set(KINDS) or per_kind < 1:
        raise ValueError(f"kinds {tuple(kinds)} must start with 'retrieve' and be among "
                         f"{KINDS}; per_kind {per_kind} >= 1")
    train_refs = [ref for pair in pairs["train"] for ref in pair.references]
    tfidf = TfIdf(ref.key for ref in train_refs)
    if classes is None:
        classes = make_word_classes([ref.tokens for ref in train_refs], tfidf, pos,
                                    spacy_model, min_df)
    rewriter = Rewriter(classes, tfidf, make_renderer(tokenizer, tokenize))
    records: dict[str, list[dict[str, Any]]] = {}
    summary: dict[str, Any] = {"word_classes": _classes_summary(classes), "splits": {}}
    for split in splits:
        split_pairs = pairs[split]
        pool = Pool.build(split_pairs)
        split_rng = np.random.default_rng([seed, zlib.crc32(split.encode())])
        tiebreak = split_rng.permutation(len(pool.keys))
        neighbours = rank_neighbours(split_pairs, pool, tfidf, tiebreak, progress=progress,
                                     desc=f"ranking {split}")
        out, labels, replaced = [], collections.Counter(), []
        for n, pair in enumerate(_progress(split_pairs, progress, f"negatives {split}")):
            rng = np.random.default_rng([seed, zlib.crc32(split.encode()), n])
            negs, made, counts = pair_negatives(pair, neighbours[n], pool, rewriter, rng,
                                                kinds, per_kind)
            labels.update(made)
            replaced.extend(counts)
            img1, img2 = image_names(dataset, pair.image_id, pair.semantic)
            out.append({"img1": img1, "img2": img2,
                        "sentences": [ref.text for ref in pair.references],
                        "neg_samples": negs, "image_id": pair.image_id, "neg_kinds": made})
        records[split] = out
        lengths = [len(ref.key) for pair in split_pairs for ref in pair.references]
        summary["splits"][split] = {
            "pairs": len(split_pairs),
            "no_change_pairs": sum(not p.semantic for p in split_pairs),
            "distinct_captions": len(pool.keys),
            "negatives": dict(sorted(labels.items())),
            "avg_replaced_words": float(np.mean(replaced)) if replaced else 0.0,
            "avg_caption_words": float(np.mean(lengths)) if lengths else 0.0,
            "skipped": dict((skipped or {}).get(split, {})),
        }
    return HardNegatives(records, classes, summary)


def _classes_summary(classes: wc.WordClasses) -> dict[str, Any]:
    return {
        "source": classes.source,
        "classes": {c: {s: list(ws) for s, ws in senses.items()}
                    for c, senses in sorted(classes.pools.items()) if not c.startswith("pos:")},
        "pos_classes": {c: len(senses) for c, senses in sorted(classes.pools.items())
                        if c.startswith("pos:")},
        "lexicon_words_absent_from_train": classes.missing_lexicon,
        "expanded": classes.expanded,
        "lexicon_words_placed_elsewhere": classes.inconsistent,
    }


def write_negatives(records: Sequence[dict[str, Any]], path: str | os.PathLike) -> None:
    """One JSON object per line, written atomically."""
    def write(fh: Any) -> None:
        for rec in records:
            fh.write(json.dumps(rec, ensure_ascii=False) + "\n")

    atomic_write(path, write)


def format_summary(summary: dict[str, Any]) -> str:
    lines = []
    wcs = summary["word_classes"]
    lines.append(f"word classes: {wcs['source']}")
    for cls, senses in wcs["classes"].items():
        lines.append(f"  {cls}: " + " | ".join("/".join(ws) for ws in senses.values()))
    for cls, n in wcs["pos_classes"].items():
        lines.append(f"  {cls}: {n} words")
    absent = "; ".join(f"{c}: {', '.join(ws)}"
                       for c, ws in sorted(wcs["lexicon_words_absent_from_train"].items()))
    if absent:
        lines.append(f"  lexicon words absent from the training captions (unused): {absent}")
    if wcs["expanded"]:
        lines.append(f"  added from the captions' distribution: {wcs['expanded']}")
    if wcs["lexicon_words_placed_elsewhere"]:
        lines.append("  lexicon words whose captions place them in another class: "
                     f"{wcs['lexicon_words_placed_elsewhere']}")
    for split, s in summary["splits"].items():
        lines.append(f"{split}: {s['pairs']} pairs ({s['no_change_pairs']} no-change), "
                     f"{s['distinct_captions']} distinct captions")
        counts = s["negatives"]
        for kind in KINDS:
            own = {k: n for k, n in counts.items()
                   if "-for-" not in k and k.split("-")[0] == kind}
            fell = {k: n for k, n in counts.items() if k.endswith(f"-for-{kind}")}
            detail = f" {own}" if len(own) > 1 else ""
            extra = f"; fallbacks {fell}" if fell else ""
            lines.append(f"  {kind}: {sum(own.values())} by its rule{detail}{extra}")
        lines.append(f"  replaced words per Replace negative: {s['avg_replaced_words']:.2f} "
                     f"(captions average {s['avg_caption_words']:.1f} words)")
        for reason, n in s["skipped"].items():
            lines.append(f"  skipped {n}: {reason}")
    return "\n".join(lines)
