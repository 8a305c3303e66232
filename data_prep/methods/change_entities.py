"""Change-entity extraction for CHEERS (paper §3.1.1): the subjects of the training captions.

CHEERS takes "the change entity" of a caption to be the subject of the sentence ("the small
red metal cube changed to blue" -> "small red metal cube"). It extracts the subjects of the
TRAINING captions of a dataset once; every image pair later retrieves its top-k entities from
that fixed list by CLIP similarity (paper §3.1.2). This module builds the list; retrieval is done
elsewhere.

    python -m data_prep.entities --data_dir=DIR --dataset=NAME [--variant=V] \\
        [--backend=auto|spacy|rules] [--spacy_model=NAME_OR_PATH]

(the command of ``data_prep/entities.py``; for the synthetic dataset training runs it on
first use, ``data_prep/first_use.py``) reads the train split of a built dataset
(``data_prep.build``),
extracts entities from its change captions and writes ``<dataset directory>/entities.json``
(atomically). Only the change captions are used: paper §3.1.1 defines an entity as what a caption
says has changed, and a no-change caption ("the two scenes seem identical") names none; its
grammatical subject ("scenes", "nothing") would only add noise to the retrieval list.
Captions that still state "no change" (Spot-the-Diff's "there are no differences") are
counted apart, not as failures.

Backends
--------
``spacy``: the paper's method. spaCy's dependency parse of the caption's first sentence; the
nominal subject (``nsubj`` / ``nsubjpass``) of the root; for an existential ("there is a
car") the ``attr`` of the root; else the first subject that is not a relative pronoun; for an
imperative ("remove the car") the root's ``dobj``. The entity is the subject's noun chunk.
The special subjects the rules handle ("one of X", "the difference is that X ...", "the
image has X") are followed the same way. A verbless caption ("white car on left side") has
no subject and stays unparsed. An installed English pipeline is needed (a package name such
as ``en_core_web_sm`` or a local path): nothing is downloaded. Checked with spaCy 3.8 and an
``en_core_web_sm`` 3.8 build: it agrees with the rules on 99.4% of synthetic captions (the
small model misreads some "the ... matte sphere turned ..." as "... matte").

``rules``: no dependency, exact on the CLEVR-Change templates (checked on the synthetic
templates and on real CLEVR-Change captions). The entity is the noun phrase the sentence
starts with, cut at the first word that cannot continue a noun phrase:

* an auxiliary or verb (``is``, ``has``, ``changed``, ``turned``, ``became``, ``moved``...);
* a preposition or relative word that starts a post-modifier (``that is behind the...``,
  ``on the left side of...``, ``in front of...``, ``to the right of...``, ``near``);
  ``left`` / ``right`` only when followed by ``of`` or a function word (``left of the cube``
  vs. ``the left car``);
* an ``-ing`` / ``-ed`` participle followed by a function word (``the person walking on``,
  ``the car parked in``), nouns like ``building`` / ``thing`` excepted;
* a conjunction or punctuation (the first conjunct is the subject, as spaCy's ``nsubj``).

Existentials ("there is (now / no longer) a person walking" -> "person"), imperatives of
editing verbs (Image Editing Request: "remove the man on the left" -> "man"), "the (only)
difference is (that) X ..." -> X's subject and "the second image has X" -> X are handled,
best effort, as are leading "in the after image, ..." phrases. A caption is left unparsed,
with its reason, when the phrase is empty, a bare pronoun, longer than
:data:`MAX_ENTITY_WORDS` or is the whole sentence (no verb).

Both backends parse :func:`normalize`'d text (lower case, "there's" spelled out, "can you" /
"please" dropped), lower-case the entity, strip its leading determiners and possessives (``the``,
``a``, ``this``, ``all``, ``her``...) and keep the rest of the noun chunk (numbers, adjectives,
``other``). Personal pronouns (``it``, ``they``, ``he``...) are no entity; indefinite persons
(``someone``) are kept, as spaCy's subject would give them.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from changecap_jax.io.jsonio import read_json, write_json_atomic

ENTITIES_FILE = "entities.json"
FORMAT = "changecap_jax.entities/1"
DEFAULT_SPACY_MODEL = "en_core_web_sm"  # tried by backend="auto" when no model is named
MAX_ENTITY_WORDS = 8  # a longer "noun phrase" means the rules missed the verb
Backend = Literal["auto", "spacy", "rules"]

# Reasons a caption gets no entity. NO_CHANGE and EMPTY are not parse failures.
NO_CHANGE = "states that nothing changed"
EMPTY = "empty caption"
NO_SUBJECT = "no subject before the verb"
PRONOUN = "the subject is a pronoun"
LEADING_PP = "starts with a prepositional phrase"
TOO_LONG = f"subject phrase longer than {MAX_ENTITY_WORDS} words"
FRAGMENT = "no verb: the whole caption is one noun phrase"
NO_OBJECT = "no object after the editing verb"

# ----------------------------------------------------------------------------- word lists

_DETERMINERS = frozenset(
    "the a an this that these those some any another each every both all either neither"
    .split())
# Stripped like determiners: "her hair" and "hair" are one entity.
_POSSESSIVES = frozenset("my your his her its our their".split())
# Subjects that name nothing. Indefinite persons ("someone is walking") stay entities, as
# spaCy's nsubj would give them.
_PRONOUNS = frozenset(
    "i you he she it we they me him her us them this that these those one something "
    "anything everything".split())
_BE = frozenset("is are was were be been being am".split())
_AUX = _BE | frozenset(
    "has have had do does did can could will would shall should may might must seems seem "
    "seemed appears appear looks look looked got gets get become becomes remains remain "
    "remained".split())
# Finite verbs that end a subject; change verbs of CLEVR-Change first. Past participles
# used as adjectives ("the parked car") are left to the participle rule.
_VERBS = frozenset(
    "changed turned became moved disappeared appeared vanished arrived entered exited went "
    "came walked drove stands sits shows show showed contains contain includes include lacks "
    "lack features switched swapped shifted grew shrank move moves "
    # participles that follow their noun ("the person wearing a hat"); "the moving truck"
    # keeps its adjective, as only words after the first one can end a phrase
    "wearing holding carrying walking standing sitting riding driving pushing pulling "
    "leaving entering turning heading talking running looking waiting moving".split())
# Predicative adjectives after the subject: "there is a dark car visible near ...".
_PREDICATIVES = frozenset("visible present absent gone missing".split())
_PREPOSITIONS = frozenset(
    "of in on at near by behind beside besides beneath below under underneath above over "
    "across along around between from with without into onto inside outside to toward "
    "towards through against among after before during like within beyond next than upon "
    "via off out".split())
_CLAUSE_WORDS = frozenset(
    "that which who whom whose where when while whereas because since although though if "
    "unless and or but nor so as , ; : ( ) \" -".split())
_ADVERBS = frozenset(
    "now no not never also still just already longer again currently actually clearly "
    "apparently suddenly here there too down up away back past forward further slightly "
    "instead".split())
_FUNCTION = (_DETERMINERS | _PRONOUNS | _AUX | _PREPOSITIONS | _CLAUSE_WORDS | _ADVERBS)
# "the after image": prepositions that may start a noun phrase as adjectives.
_ADJECTIVE_PREPOSITIONS = frozenset("after before".split())
# "one of the people", "all of the houses": the phrase after "of" is the entity.
_QUANTIFIERS = frozenset(
    "one two three four five some many most several few all none both each any half "
    "part rest".split())
# Nouns that look like participles.
_NOT_PARTICIPLES = frozenset(
    "thing something anything nothing everything building buildings ceiling railing railings "
    "awning awnings painting paintings clothing ring king wing wings string morning evening "
    "siding lighting opening crossing landing bedding wedding sibling parking spring shed "
    "bed red sled seed speed feed weed reed steed need".split())
_NOT_ADVERBS = frozenset("family butterfly dragonfly assembly supply anomaly".split())
# Subjects that introduce the change instead of naming it.
_DIFFERENCE_WORDS = frozenset("difference differences change changes".split())
_IMAGE_WORDS = frozenset(
    "image images picture pictures photo photos photograph pic scene frame one side "
    "version".split())
_HAVE_VERBS = frozenset(
    "has have had shows show showed contains contain includes include features".split())
_LEADING_WORDS = frozenset("now also additionally then so and but please".split())
# Imperatives of Image Editing Request ("remove the man"); their object is the entity.
_EDIT_VERB_STEMS = (
    "remove delete erase add insert put place change make turn replace crop brighten darken "
    "lighten increase decrease reduce adjust rotate flip move enlarge zoom blur sharpen color "
    "colour convert swap fix clean give cut paint take apply saturate desaturate enhance "
    "lower raise boost fill invert resize shrink straighten whiten highlight mirror clear "
    "edit draw restore tint transform get set let recolor shade smooth stretch switch define "
    "filter colorize cartoonize pixelate posterize outline select cover hide show warm cool "
    "soften fade dim trim frame focus center").split()
# Verbs whose object is followed by its new state ("make the sky bluer", "color the car red"):
# a state word after the object's first word ends it.
_RESULT_VERB_STEMS = frozenset(
    "make turn get set paint color colour recolor render keep leave change".split())
_STATE_WORDS = frozenset(
    "white black red green blue yellow gray grey brown purple cyan pink orange gold silver "
    "brighter darker lighter bigger smaller larger clearer sharper warmer cooler softer "
    "stronger whiter redder bluer greener more less higher lower deeper thicker thinner "
    "wider taller shorter better crisper richer transparent invisible visible bright dark "
    "clear sharp blurry blurred vintage grayscale greyscale monochrome".split())
_PARTICLES = frozenset("out up off away down back in on into".split())
# Requests around the imperative: "can you remove ...", "i want you to add ...".
_REQUEST_RE = re.compile(
    r"^(?:please |(?:can|could|would|will) you (?:please )?|i (?:want|would like|need)"
    r"(?: you)? to |we need to |you (?:should|need to|must) )+")


def _verb_forms(stem: str) -> set[str]:
    base = stem[:-1] if stem.endswith("e") else stem
    return {stem, stem + "s", stem + "d" if stem.endswith("e") else stem + "ed", base + "ing",
            stem + "es"}


_EDIT_VERBS = frozenset(f for stem in _EDIT_VERB_STEMS for f in _verb_forms(stem))
_RESULT_VERBS = frozenset(f for stem in _RESULT_VERB_STEMS for f in _verb_forms(stem))

_NO_CHANGE_RE = re.compile(
    r"^(?:there (?:is|are|was|were|seems? to be|appears? to be) (?:(?:no|not any)"
    r"(?: visible| noticeable| obvious| apparent)? (?:changes?|differences?)\b|nothing\b)"
    r"|no (?:visible |noticeable )?(?:changes?|differences?)\b"
    r"|nothing\b"
    r"|(?:the )?(?:two |both )?(?:scenes?|images?|pictures?|photos?) (?:seem|seems|look|looks|"
    r"are|is|remain|remains|appear|appears)(?: to be)? (?:identical|the same|unchanged))")


# ----------------------------------------------------------------------------- the result


@dataclasses.dataclass(frozen=True)
class Entity:
    """One change entity: its id (index in the sorted list), text and caption count."""

    id: int
    text: str
    count: int


@dataclasses.dataclass
class EntityExtraction:
    """The entity list of a set of captions, with the per-caption result.

    ``entities`` is sorted by descending count, then text; ``id`` is the position. Counts are
    over caption occurrences (a caption given for two pairs counts twice); ``captions`` and
    ``unparsed`` hold each distinct caption once.
    """

    backend: str  # "spacy" or "rules": what actually ran
    entities: list[Entity]
    captions: dict[str, str | None]  # caption -> entity text (None: no entity)
    unparsed: dict[str, str]  # caption -> why no entity (parse failures only)
    num_captions: int
    num_no_change: int = 0
    num_empty: int = 0
    spacy_model: str | None = None
    fallback_reason: str | None = None  # why backend="auto" did not use spaCy
    source: dict[str, Any] = dataclasses.field(default_factory=dict)  # dataset, split, ...

    @property
    def num_parsed(self) -> int:
        return sum(e.count for e in self.entities)

    @property
    def num_unparsed(self) -> int:
        return self.num_captions - self.num_parsed - self.num_no_change - self.num_empty

    @property
    def parse_rate(self) -> float:
        """Share of the captions that state a change which got an entity."""
        eligible = self.num_captions - self.num_no_change - self.num_empty
        return self.num_parsed / eligible if eligible else 1.0

    @property
    def texts(self) -> list[str]:
        """The entity texts in id order (what retrieval embeds)."""
        return [e.text for e in self.entities]

    def entity_of(self, caption: str) -> str | None:
        return self.captions[caption]

    def summary(self, max_entities: int = 20, max_examples: int = 10) -> str:
        lines = [
            f"backend: {self.backend}"
            + (f" ({self.spacy_model})" if self.spacy_model else "")
            + (f"; spaCy not used: {self.fallback_reason}" if self.fallback_reason else ""),
            f"captions: {self.num_captions} ({len(self.captions)} distinct); "
            f"with an entity: {self.num_parsed} ({100 * self.parse_rate:.2f}% of those "
            f"stating a change); no-change statements: {self.num_no_change}; "
            f"empty: {self.num_empty}; unparsed: {self.num_unparsed}",
            f"entities: {len(self.entities)} distinct",
        ]
        for e in self.entities[:max_entities]:
            lines.append(f"  {e.id:5d} {e.count:7d}  {e.text}")
        if len(self.entities) > max_entities:
            lines.append(f"  ... {len(self.entities) - max_entities} more")
        if self.unparsed:
            by_reason = collections.Counter(self.unparsed.values())
            lines.append(f"unparsed distinct captions: {len(self.unparsed)} "
                         f"({', '.join(f'{n} {r}' for r, n in by_reason.most_common())})")
            for caption, reason in list(self.unparsed.items())[:max_examples]:
                lines.append(f"  [{reason}] {caption!r}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "source": self.source,
            "backend": self.backend,
            "spacy_model": self.spacy_model,
            "fallback_reason": self.fallback_reason,
            "num_captions": self.num_captions,
            "num_parsed": self.num_parsed,
            "num_unparsed": self.num_unparsed,
            "num_no_change": self.num_no_change,
            "num_empty": self.num_empty,
            "entities": [{"id": e.id, "text": e.text, "count": e.count} for e in self.entities],
            "captions": self.captions,
            "unparsed": [{"caption": c, "reason": r} for c, r in self.unparsed.items()],
        }


# ----------------------------------------------------------------------------- rules


def normalize(caption: str) -> str:
    """The text both backends parse: lower case, possessives joined, "there's" spelled out,
    request phrases ("can you", "please") dropped."""
    text = caption.lower().replace("\u2019", "'").replace("`", "'")
    text = re.sub(r"\s*'\s*s\b", "'s", text)  # Birds-to-Words writes "animal1 ' s"
    text = re.sub(r"\bthere(?:'s| s|s)\b", "there is", text)
    text = re.sub(r"^the (is|are) ", r"there \1 ", text.strip())  # a Spot-the-Diff typo
    text = re.sub(r"\bpick[ -]up (truck|van)", r"pickup \1", text)  # not the verb "pick up"
    return re.sub(r"\s+", " ", _REQUEST_RE.sub("", text))


def _tokens(caption: str) -> list[str]:
    """Words of the normalized first sentence; punctuation split off."""
    text = normalize(caption)
    text = re.split(r"[.!?;]", text, maxsplit=1)[0]  # the subject is in the first sentence
    return re.findall(r"[\w'-]+|[^\w\s]", text)


def _ends_phrase(tokens: Sequence[str], i: int, phrase_len: int) -> bool:
    """Whether ``tokens[i]`` cannot continue a noun phrase of ``phrase_len`` words."""
    word = tokens[i]
    after = tokens[i + 1] if i + 1 < len(tokens) else None
    before_function = after is None or after in _FUNCTION
    if word in _CLAUSE_WORDS:
        return True
    if phrase_len == 0:  # nothing yet: "the after image", "the left car" start a phrase
        return word in _AUX or (word in _PREPOSITIONS and word not in _ADJECTIVE_PREPOSITIONS)
    if word in _PREPOSITIONS or word in _DETERMINERS:  # "the sphere the same size as"
        return True
    if word in _AUX or word in _VERBS or word in _ADVERBS or word in _PREDICATIVES:
        return True
    if word in ("left", "right"):  # "left of the cube", "the car left" vs "the left car"
        return before_function
    if (len(word) > 4 and word.endswith(("ing", "ed")) and word not in _NOT_PARTICIPLES
            and before_function and after not in _AUX):
        return True  # "the person walking on", "the car parked in"
    return len(word) > 5 and word.endswith("ly") and word not in _NOT_ADVERBS  # "vertically"


def _noun_phrase(tokens: Sequence[str], start: int) -> tuple[list[str], int]:
    """The noun phrase at ``start`` (determiners stripped) and the index after it."""
    i = start
    if tokens[i:i + 2] in (["at", "least"], ["at", "most"]):  # "at least three people"
        i += 2
    while i < len(tokens) and (tokens[i] in _DETERMINERS or tokens[i] in _POSSESSIVES):
        i += 1
    if i + 1 < len(tokens) and tokens[i] in _QUANTIFIERS and tokens[i + 1] == "of":
        return _noun_phrase(tokens, i + 2)
    if i < len(tokens) and tokens[i] == "of" and i > start:  # "all of the houses"
        return _noun_phrase(tokens, i + 1)
    words: list[str] = []
    while i < len(tokens) and not _ends_phrase(tokens, i, len(words)):
        words.append(tokens[i])
        i += 1
    return words, i


def _check_phrase(words: list[str], end: int, n: int, allow_fragment: bool) -> str | None:
    """The reason ``words`` is no entity, or None."""
    if not words:
        return NO_SUBJECT
    if len(words) == 1 and words[0] in _PRONOUNS:
        return PRONOUN
    if len(words) > MAX_ENTITY_WORDS:
        return TOO_LONG
    if end >= n and not allow_fragment:
        return FRAGMENT
    return None


def _next_verb(tokens: Sequence[str], i: int) -> int | None:
    for j in range(i, len(tokens)):
        if tokens[j] in _AUX or tokens[j] in _VERBS:
            return j
    return None


def _after_leading_place(tokens: list[str], allow_fragment: bool) -> tuple[str | None, str | None]:
    """:func:`_rule_parse` of a caption opening with a place phrase ("in the after image"):
    the subject after it, or LEADING_PP."""
    n = len(tokens)
    for j in range(1, n - 1):
        if tokens[j] == "there" and tokens[j + 1] in _AUX:
            return _rule_parse(tokens[j:], allow_fragment)
    place, end = _noun_phrase(tokens, 1)
    if place and end < n and (place[-1] in _IMAGE_WORDS or tokens[end] in _DETERMINERS):
        # the place phrase ended where the subject starts: "in the lot a car ..."
        return _rule_parse(tokens[end + (tokens[end] == ","):], allow_fragment)
    if "," in tokens:
        return _rule_parse(tokens[tokens.index(",") + 1:], allow_fragment)
    return None, LEADING_PP


def _rule_parse(tokens: list[str], allow_fragment: bool = False) -> tuple[str | None, str | None]:
    n = len(tokens)
    if not n:
        return None, NO_SUBJECT
    start = 0
    while start < n and tokens[start] in _LEADING_WORDS:
        start += 1
    tokens = tokens[start:]
    n = len(tokens)
    if not n:
        return None, NO_SUBJECT
    # "there is (now / no longer) a person walking" -> "person"
    if tokens[0] == "there" and n > 1 and (tokens[1] in _AUX or tokens[1] in ("exists", "exist")):
        i = 1
        while i < n and (tokens[i] in _AUX or tokens[i] in _ADVERBS or tokens[i] in (
                "to", "be", "used", "exists", "exist", "any", "more", "now")):
            i += 1
        words, _ = _noun_phrase(tokens, i)
        return _entity(words)
    # Editing imperatives: "remove the man on the left" -> "man" (not "shade is gone")
    if tokens[0] in _EDIT_VERBS and not (n > 1 and (tokens[1] in _AUX or tokens[1] in _VERBS)):
        i = 1
        while i < n and tokens[i] in _PARTICLES:
            i += 1
        if tokens[i:i + 1] == ["and"] and tokens[i + 1:i + 2] and tokens[i + 1] in _EDIT_VERBS:
            return _rule_parse(tokens[i + 1:], allow_fragment)  # "crop and zoom into X"
        words, _ = _noun_phrase(tokens, i)
        if tokens[0] in _RESULT_VERBS:  # "make the red car blue" -> "red car"
            cut = next((k for k in range(1, len(words)) if words[k] in _STATE_WORDS), None)
            words = words[:cut]
        return _entity(words) if words else (None, NO_OBJECT)
    # "in the after image(,) the cube is gone" / "in the second picture there is a car"
    if tokens[0] in _PREPOSITIONS and tokens[:2] not in (["at", "least"], ["at", "most"]) and not (
            tokens[0] in _ADJECTIVE_PREPOSITIONS and n > 1 and tokens[1] in _IMAGE_WORDS):
        return _after_leading_place(tokens, allow_fragment)
    words, end = _noun_phrase(tokens, 0)
    reason = _check_phrase(words, end, n, allow_fragment)
    if reason:
        return None, reason
    verb = _next_verb(tokens, end)
    # "the only difference is (that) the car is gone" -> the subject of what follows
    if words[-1] in _DIFFERENCE_WORDS and verb is not None and tokens[verb] in _BE:
        rest = tokens[verb + 1:]
        if rest and rest[0] == "that":
            rest = rest[1:]
        return _rule_parse(rest, allow_fragment=True)
    # "the image on the right has a car" -> "car"
    while verb is not None and verb + 1 < n and tokens[verb] not in _HAVE_VERBS and (
            tokens[verb + 1] in _AUX or tokens[verb + 1] in _ADVERBS):
        verb += 1  # "does not have"
    if words[-1] in _IMAGE_WORDS and verb is not None and tokens[verb] in _HAVE_VERBS:
        i = verb + 1
        while i < n and tokens[i] in _ADVERBS:
            i += 1
        obj, obj_end = _noun_phrase(tokens, i)
        if obj and _check_phrase(obj, obj_end, n, True) is None:
            return " ".join(obj), None
    return " ".join(words), None


def _entity(words: list[str]) -> tuple[str | None, str | None]:
    """A phrase that follows its verb (existential, imperative): may end the sentence."""
    reason = _check_phrase(words, 0, 1, allow_fragment=True)
    return (None, reason) if reason else (" ".join(words), None)


def rule_subject(caption: str) -> tuple[str | None, str | None]:
    """(entity, None) or (None, reason) for one caption with the rule-based extractor."""
    if not caption.strip():
        return None, EMPTY
    if is_no_change(caption):
        return None, NO_CHANGE
    return _rule_parse(_tokens(caption))


def is_no_change(caption: str) -> bool:
    """Whether a caption states that nothing changed (CLEVR-Change's no-change pool, "there
    are no differences", "the images look the same"...)."""
    return bool(_NO_CHANGE_RE.match(" ".join(_tokens(caption))))


# ----------------------------------------------------------------------------- spaCy


def load_spacy(model: str) -> Any:
    """An installed spaCy pipeline with a parser (package name or local path; no download)."""
    try:
        import spacy
    except ImportError as e:
        raise RuntimeError("the spaCy backend needs spaCy, which is not installed "
                           "(pip install spacy plus an English pipeline package)") from e
    try:
        nlp = spacy.load(model)
    except (OSError, ValueError) as e:  # E050 "can't find model" is an OSError
        raise RuntimeError(f"cannot load the spaCy pipeline {model!r} (a package name or a "
                           f"local path; nothing is downloaded): {e}") from e
    if "parser" not in nlp.pipe_names:
        raise RuntimeError(f"the spaCy pipeline {model!r} has no dependency parser "
                           f"(components: {nlp.pipe_names})")
    return nlp


_SUBJECT_DEPS = ("nsubj", "nsubjpass")
_RELATIVE_WORDS = frozenset("that which who whom whose".split())


def _child(token: Any, *deps: str) -> Any:
    return next((t for t in token.children if t.dep_ in deps), None)


def spacy_subject(doc: Any) -> tuple[str | None, str | None]:
    """(entity, None) or (None, reason) from a parsed spaCy ``Doc`` (its first sentence)."""
    sent = next(iter(doc.sents), None)
    if sent is None or not sent.text.strip():
        return None, EMPTY
    root = sent.root
    token = _child(root, *_SUBJECT_DEPS)
    if token is None and _child(root, "expl") is not None:
        token = _child(root, "attr", "nsubj", "dobj")  # "there is a car": the attr
    if token is None:  # a subject lower down, not a relative pronoun ("that is behind")
        token = next((t for t in sent if t.dep_ in _SUBJECT_DEPS
                      and t.lower_ not in _RELATIVE_WORDS), None)
    if token is None and root.i == sent.start and root.pos_ == "VERB":
        token = _child(root, "dobj")  # imperative: "remove the car"
    # The same special subjects as the rules: "one of the people", "the difference is
    # that X ...", "the right image has X".
    if token is not None and token.lower_ in _QUANTIFIERS:
        of = next((t for t in token.children if t.dep_ == "prep" and t.lower_ == "of"), None)
        token = _child(of, "pobj") if of is not None and _child(of, "pobj") else token
    if token is not None and token.lower_ in _DIFFERENCE_WORDS and root.lower_ in _BE:
        clause = _child(root, "ccomp")  # small models hang its subject on any of its words
        inner = None if clause is None else next(
            (t for t in clause.subtree if t.dep_ in _SUBJECT_DEPS), None)
        later = next((t for t in root.children  # or on the root itself
                      if t.dep_ in _SUBJECT_DEPS and t.i > token.i), None)
        token = inner or later or _child(root, "attr") or token
    if token is not None and token.lower_ in _IMAGE_WORDS and root.lower_ in _HAVE_VERBS:
        token = _child(root, "dobj") or token
    if token is None:
        return None, NO_SUBJECT
    if token.lower_ in _PRONOUNS:  # the same list as the rules ("someone" is kept)
        return None, PRONOUN
    chunk = next((c for c in doc.noun_chunks if c.start <= token.i < c.end), None)
    words = list(chunk) if chunk is not None else [token]
    while words and (words[0].dep_ in ("det", "predet")  # not "poss": "animal1's wings"
                     or words[0].lower_ in _DETERMINERS or words[0].lower_ in _POSSESSIVES):
        words = words[1:]
    text = "".join(t.text_with_ws for t in words).strip().lower()
    text = re.sub(r"\s+", " ", text)
    if not text:
        return None, NO_SUBJECT
    if len(text.split()) > MAX_ENTITY_WORDS:
        return None, TOO_LONG
    return text, None


# ----------------------------------------------------------------------------- extraction


def _choose_backend(backend: str, spacy_model: str | None) -> tuple[Any, str | None, str | None]:
    """(spaCy pipeline or None, model name, reason spaCy is not used under "auto")."""
    if backend == "rules":
        return None, None, None
    if backend == "spacy":
        if not spacy_model:
            raise ValueError("backend='spacy' needs spacy_model (an installed pipeline "
                             f"package such as {DEFAULT_SPACY_MODEL!r} or a local path)")
        return load_spacy(spacy_model), spacy_model, None
    if backend != "auto":
        raise ValueError(f"unknown backend {backend!r}; expected 'auto', 'spacy' or 'rules'")
    try:
        import spacy
    except ImportError:
        return None, None, "spaCy is not installed"
    model = spacy_model
    if not model:
        if not spacy.util.is_package(DEFAULT_SPACY_MODEL):
            return None, None, (f"no spaCy pipeline named (spacy_model) and "
                                f"{DEFAULT_SPACY_MODEL!r} is not installed")
        model = DEFAULT_SPACY_MODEL
    try:
        return load_spacy(model), model, None
    except RuntimeError as e:
        return None, None, str(e)


def extract_entities(
    captions: Iterable[str],
    *,
    backend: Backend = "auto",
    spacy_model: str | None = None,
    source: Mapping[str, Any] | None = None,
) -> EntityExtraction:
    """The change entities (caption subjects) of ``captions``; see the module docstring.

    backend "auto" uses spaCy when it and a pipeline (``spacy_model``, else
    :data:`DEFAULT_SPACY_MODEL`) are installed, else the rules, logging why.
    """
    nlp, model, fallback = _choose_backend(backend, spacy_model)
    if fallback:
        logging.warning("entity extraction: using the rule-based backend: %s", fallback)
    occurrences = collections.Counter(
        c.decode("utf-8") if isinstance(c, bytes) else str(c) for c in captions)
    distinct = list(occurrences)
    results: dict[str, tuple[str | None, str | None]] = {}
    to_parse = []
    for caption in distinct:  # both backends share the empty / no-change filter
        if not caption.strip():
            results[caption] = (None, EMPTY)
        elif is_no_change(caption):
            results[caption] = (None, NO_CHANGE)
        else:
            to_parse.append(caption)
    if nlp is not None:
        texts = (normalize(c) for c in to_parse)
        for caption, doc in zip(to_parse, nlp.pipe(texts, batch_size=256), strict=True):
            results[caption] = spacy_subject(doc)
    else:
        for caption in to_parse:
            results[caption] = _rule_parse(_tokens(caption))
    counts: collections.Counter[str] = collections.Counter()
    num_no_change = num_empty = 0
    unparsed: dict[str, str] = {}
    for caption in distinct:
        entity, reason = results[caption]
        if entity is not None:
            counts[entity] += occurrences[caption]
        elif reason == NO_CHANGE:
            num_no_change += occurrences[caption]
        elif reason == EMPTY:
            num_empty += occurrences[caption]
        else:
            unparsed[caption] = reason or NO_SUBJECT
    ordered = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))  # deterministic ids
    return EntityExtraction(
        backend="spacy" if nlp is not None else "rules",
        entities=[Entity(i, text, n) for i, (text, n) in enumerate(ordered)],
        captions={c: results[c][0] for c in distinct},
        unparsed=unparsed,
        num_captions=sum(occurrences.values()),
        num_no_change=num_no_change,
        num_empty=num_empty,
        spacy_model=model,
        fallback_reason=fallback,
        source=dict(source or {}),
    )


# ----------------------------------------------------------------------------- files


def save_entities(path: str | os.PathLike, extraction: EntityExtraction) -> None:
    """Writes ``extraction`` as JSON (temp file + ``os.replace``: never half-written)."""
    write_json_atomic(path, extraction.to_json(), indent=1)


def _fail(path: Path, key: str, problem: str) -> ValueError:
    return ValueError(f"entity file {path}: key {key!r} {problem}")


def _require(data: Mapping, path: Path, key: str, kind: type, where: str = "") -> Any:
    """``data[key]`` of type ``kind``; errors name the key as ``where + key``."""
    if key not in data:
        raise _fail(path, where + key, "is missing")
    value = data[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _fail(path, where + key, f"must be {kind.__name__}, got {type(value).__name__}")
    return value


def _read_entity_list(data: dict[str, Any], path: Path) -> list[Entity]:
    """The "entities" list of an entities.json, checked: ids are positions, texts non-empty,
    counts >= 1, sorted by descending count then text."""
    entities: list[Entity] = []
    for i, item in enumerate(_require(data, path, "entities", list)):
        key = f"entities[{i}]"
        if not isinstance(item, dict):
            raise _fail(path, key, f"must be an object, got {type(item).__name__}")
        eid = _require(item, path, "id", int, f"{key}.")
        text = _require(item, path, "text", str, f"{key}.")
        count = _require(item, path, "count", int, f"{key}.")
        if eid != i:
            raise _fail(path, f"{key}.id", f"is {eid}, expected {i} (ids are positions)")
        if not text.strip():
            raise _fail(path, f"{key}.text", "is empty")
        if count < 1:
            raise _fail(path, f"{key}.count", f"is {count}, expected >= 1")
        if entities and (-count, text) <= (-entities[-1].count, entities[-1].text):
            raise _fail(path, f"{key}", "is out of order or repeated (entities are sorted by "
                        "descending count, then text, each text once)")
        entities.append(Entity(eid, text, count))
    return entities


def load_entities(path: str | os.PathLike) -> EntityExtraction:
    """Reads an ``entities.json``; a malformed file raises ValueError naming it and the key."""
    path = Path(path)
    data = read_json(path, "entity file")
    if not isinstance(data, dict):
        raise ValueError(f"entity file {path}: expected a JSON object, got "
                         f"{type(data).__name__}")
    if data.get("format") != FORMAT:
        raise _fail(path, "format", f"is {data.get('format')!r}, expected {FORMAT!r}")
    backend = _require(data, path, "backend", str)
    if backend not in ("spacy", "rules"):
        raise _fail(path, "backend", f"is {backend!r}, expected 'spacy' or 'rules'")
    counts = {k: _require(data, path, k, int) for k in
              ("num_captions", "num_parsed", "num_unparsed", "num_no_change", "num_empty")}
    for key, value in counts.items():
        if value < 0:
            raise _fail(path, key, f"is negative ({value})")
    entities = _read_entity_list(data, path)
    known = {e.text for e in entities}
    captions = _require(data, path, "captions", dict)
    for caption, entity in captions.items():
        if entity is not None and entity not in known:
            raise _fail(path, f"captions[{json.dumps(caption)}]",
                        f"names entity {entity!r}, which is not in 'entities'")
    unparsed = {}
    for i, item in enumerate(_require(data, path, "unparsed", list)):
        if not isinstance(item, dict):
            raise _fail(path, f"unparsed[{i}]", "must be an object")
        caption = _require(item, path, "caption", str, f"unparsed[{i}].")
        unparsed[caption] = _require(item, path, "reason", str, f"unparsed[{i}].")
        if captions.get(caption, "") is not None:
            raise _fail(path, f"unparsed[{i}].caption",
                        f"{caption!r} is not in 'captions' with a null entity")
    source = data.get("source", {})
    if not isinstance(source, dict):
        raise _fail(path, "source", "must be an object")
    extraction = EntityExtraction(
        backend=backend, entities=entities, captions=captions, unparsed=unparsed,
        num_captions=counts["num_captions"], num_no_change=counts["num_no_change"],
        num_empty=counts["num_empty"], spacy_model=data.get("spacy_model"),
        fallback_reason=data.get("fallback_reason"), source=source)
    for key in ("num_parsed", "num_unparsed"):
        if getattr(extraction, key) != counts[key]:
            raise _fail(path, key, f"is {counts[key]} but the entities and counts give "
                                   f"{getattr(extraction, key)}")
    return extraction


# ----------------------------------------------------------------------------- datasets


def split_change_captions(dataset: Any, split: str = "train") -> list[str]:
    """Every change caption of one split of a built dataset (a ``PreparedDataset``)."""
    source = dataset.split(split)
    captions = []
    for i in range(len(source)):
        captions.extend(c.decode("utf-8") if isinstance(c, bytes) else str(c)
                        for c in source[i]["change_captions"])
    return captions


def save_dataset_entities(
    dataset: Any,
    *,
    backend: Backend = "auto",
    spacy_model: str | None = None,
    output: str | os.PathLike | None = None,
) -> tuple[Path, EntityExtraction]:
    """Extracts the entities of a built dataset's (a ``PreparedDataset``) train change
    captions and saves them (default ``<dataset directory>/entities.json``)."""
    captions = split_change_captions(dataset, "train")
    extraction = extract_entities(
        captions, backend=backend, spacy_model=spacy_model,
        # names, not the absolute directory: the file stays right when the data moves
        source={"dataset": dataset.name, "config": dataset.directory.parent.name,
                "version": dataset.directory.name, "split": "train", "field": "change_captions"})
    path = Path(output) if output else dataset.directory / ENTITIES_FILE
    save_entities(path, extraction)
    return path, extraction
