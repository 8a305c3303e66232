"""CHEERS change-entity extraction (data_prep/entities.py): rules, files, CLI, spaCy."""

import itertools
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from conftest import SMALL, shared_file

from changecap_jax.data.synthetic import scenes
from data_prep.methods import change_entities as entities

REPO = Path(__file__).resolve().parents[1]

# Real CLEVR-Change training captions, quoted verbatim in a public third-party prompt file
# (the official change_captions.json is not in ../shared/data), with their subjects. They
# cover the relational forms the synthetic templates lack ("that is on the right side of",
# "in front of", "left of", "to the right of", "behind").
REAL_CLEVR_CHANGE = {
    "the large brown matte block that is on the right side of the large brown cylinder is gone":
        "large brown matte block",
    "the large brown rubber cube that is in front of the large blue matte cylinder is missing":
        "large brown rubber cube",
    "the tiny yellow cylinder turned brown": "tiny yellow cylinder",
    "the small matte object became brown": "small matte object",
    "the tiny yellow rubber cylinder that is behind the rubber block became brown":
        "tiny yellow rubber cylinder",
    "the matte cylinder became brown": "matte cylinder",
    "the small yellow matte cylinder on the left side of the brown cube changed to brown":
        "small yellow matte cylinder",
    "the small yellow cylinder changed to brown": "small yellow cylinder",
    "the small yellow rubber cylinder left of the brown cube turned brown":
        "small yellow rubber cylinder",
    "the tiny yellow rubber cylinder behind the small metallic sphere turned brown":
        "tiny yellow rubber cylinder",
    "the block changed its location": "block",
    "the red metal object changed its location": "red metal object",
    "the red block is in a different location": "red block",
    "the red metallic cube changed its location": "red metallic cube",
    "the small red metallic block that is to the right of the small matte ball changed its "
    "location": "small red metallic block",
    "the red cube is in a different location": "red cube",
    "the small red shiny cube right of the tiny brown object changed its location":
        "small red shiny cube",
    "the small red metallic block that is to the right of the tiny brown metal sphere is in a "
    "different location": "small red metallic block",
    "the small red metallic block to the right of the small green object is in a different "
    "location": "small red metallic block",
    "the tiny matte ball has been added": "tiny matte ball",
    "the tiny gray thing has been newly placed": "tiny gray thing",
    "the tiny gray object has been newly placed": "tiny gray object",
    "the small gray thing has been added": "small gray thing",
    "the tiny gray rubber ball that is right of the large matte ball has appeared":
        "tiny gray rubber ball",
}

# Spot-the-Diff / IER style sentences (the first five are from the real train files).
OTHER_FORMS = {
    "the blue car is no longer there": "blue car",
    "there is a person walking": "person",
    "the person in the blue shirt from the image on the left is no longer present": "person",
    "the two people in the upper part of the picture are gone": "two people",
    "there are two people in the seconde picture that are near the handicapped parking place":
        "two people",
    "there is no longer a white van in the lot": "white van",
    "in the after image, the car is gone": "car",
    "in the second picture there is a man walking on the sidewalk": "man",
    "the only difference is that the white car is gone": "white car",
    "the right image has an extra person": "extra person",
    "the tall building in the back is gone": "tall building",
    "the left car has moved": "left car",
    "one of the two people has left": "two people",
    "remove the man on the left": "man",
    "Make the sky bluer.": "sky",
    "can you remove her hat": "hat",
    "animal1 ' s wings are darker than animal2": "animal1's wings",
    "frame is missing from the window": "frame",  # an editing verb used as a noun
    "the blue pick up truck moved": "blue pickup truck",
    "the person wearing yellow in front of the sign has changed positions": "person",
    "there is a dark car visible near the street lamp": "dark car",
    "the picture on the right does not have the white pickup truck": "white pickup truck",
}


def _template_regex(template):
    """A template as a regex whose group 'd' is the object description."""
    parts = re.split(r"(\{d\}|\{v\})", template)
    return re.compile("^" + "".join(
        "(?P<d>.+?)" if p == "{d}" else r"\w+" if p == "{v}" else re.escape(p)
        for p in parts) + "$")


def _attribute_of(word):
    for field, table in (("size", scenes.SIZE_WORDS), ("material", scenes.MATERIAL_WORDS),
                         ("shape", scenes.SHAPE_WORDS)):
        for value, words in table.items():
            if word in words:
                return field, value
    return ("color", word) if word in scenes.COLORS else None


def test_every_synthetic_template_and_description_is_exact():
    # All descriptions _describe can write (any subset of size / color / material, then a
    # shape word or a generic noun) in every template: ~30k captions.
    sizes = [()] + [(w,) for ws in scenes.SIZE_WORDS.values() for w in ws]
    colors = [()] + [(c,) for c in scenes.COLORS]
    materials = [()] + [(w,) for ws in scenes.MATERIAL_WORDS.values() for w in ws]
    nouns = [w for ws in scenes.SHAPE_WORDS.values() for w in ws] + list(scenes.GENERIC_WORDS)
    values = {"color": "blue", "material": "shiny"}
    checked = 0
    for change_type, templates in scenes.TEMPLATES.items():
        for template, s, c, m, noun in itertools.product(templates, sizes, colors, materials,
                                                         nouns):
            d = " ".join((*s, *c, *m, noun))
            caption = template.format(d="the " + d, v=values.get(change_type, ""))
            assert entities.rule_subject(caption) == (d, None), caption
            checked += 1
    assert checked == 16 * 5 * 9 * 6 * 7


@pytest.mark.parametrize("change_type", scenes.CHANGE_TYPES)
def test_synthetic_captions_give_the_changed_object(change_type):
    """On generated examples: the entity is the template's description of the changed
    object, every word of it names one of that object's attributes, and every template
    form is met."""
    regexes = [_template_regex(t) for t in scenes.TEMPLATES[change_type]]
    seen = set()
    captions = []
    for k in range(150):
        ex = scenes.sample_example(np.random.default_rng([11, k]), change_type, "moderate", 6)
        obj = (ex.after[ex.changed_index_after] if change_type == "add"
               else ex.before[ex.changed_index_before])
        for caption in ex.change_captions:
            matches = [(j, r.match(caption)) for j, r in enumerate(regexes) if r.match(caption)]
            assert matches, caption
            j, match = matches[0]
            seen.add(j)
            entity, reason = entities.rule_subject(caption)
            assert reason is None and "the " + entity == match.group("d"), caption
            for word in entity.split()[:-1]:
                field, value = _attribute_of(word)
                assert getattr(obj, field) == value, (caption, word)
            noun = entity.split()[-1]
            assert noun in scenes.GENERIC_WORDS or _attribute_of(noun) == ("shape", obj.shape)
            captions.append(caption)
    assert seen == set(range(len(regexes)))
    extraction = entities.extract_entities(captions, backend="rules")
    assert extraction.parse_rate == 1.0 and not extraction.unparsed


def test_no_change_captions_are_recognised_not_failures():
    for caption in scenes.NO_CHANGE_CAPTIONS:
        assert entities.is_no_change(caption), caption
    for caption in ("there are no differences", "no difference", "the images look the same"):
        assert entities.is_no_change(caption), caption
    for caption in ("there is no car in the lot", "there is no longer a car", "the car is gone"):
        assert not entities.is_no_change(caption), caption
    extraction = entities.extract_entities([*scenes.NO_CHANGE_CAPTIONS, "", "the cube moved"],
                                    backend="rules")
    assert extraction.num_no_change == len(scenes.NO_CHANGE_CAPTIONS)
    assert extraction.num_empty == 1 and extraction.num_unparsed == 0
    assert extraction.texts == ["cube"] and extraction.parse_rate == 1.0


def test_real_clevr_change_captions_quoted():
    for caption, subject in REAL_CLEVR_CHANGE.items():
        assert entities.rule_subject(caption) == (subject, None), caption


def test_real_clevr_change_caption_file():
    """All train change captions of the official change_captions.json, when it is present.

    The threshold is not measured here (the file is absent from ../shared/data): CLEVR-Change
    captions come from closed templates, every form of which is covered by the quoted
    captions above, so the rules should parse all; 99.9% leaves room for a stray form while
    still failing on any systematic gap (the message lists what failed)."""
    path = shared_file("clevr_change", "change_captions.json")
    captions = json.loads(path.read_text())
    split_path = path.parent / "splits.json"
    if split_path.exists():
        train = {f"CLEVR_default_{i:06d}.png" for i in json.loads(split_path.read_text())["train"]}
        captions = {k: v for k, v in captions.items() if k in train}
    extraction = entities.extract_entities(
        [c for cs in captions.values() for c in cs], backend="rules")
    assert extraction.parse_rate >= 0.999, extraction.summary(max_examples=30)
    assert extraction.num_no_change == 0


@pytest.mark.parametrize("name, path, key, threshold", [
    # measured with the rules: 96.7% (Spot-the-Diff), 95.8% (IER); regression guards
    ("spot_the_diff", ("spot_the_diff", "train.json"), "sentences", 0.96),
    ("image_editing_request", ("image_editing_request", "train.json"), "sents", 0.95),
])
def test_real_spot_the_diff_and_ier_best_effort(name, path, key, threshold):
    entries = json.loads(shared_file(*path).read_text())
    extraction = entities.extract_entities([s for e in entries for s in e[key]], backend="rules")
    assert extraction.parse_rate >= threshold, extraction.summary(max_examples=30)
    assert extraction.num_unparsed == sum(
        n for c, n in _occurrences(entries, key).items() if c in extraction.unparsed)
    if name == "spot_the_diff":
        assert extraction.num_no_change > 0  # "there are no differences" is not a failure
        assert extraction.texts[:3] == ["person", "people", "car"]


def _occurrences(entries, key):
    counts = {}
    for e in entries:
        for s in e[key]:
            counts[s] = counts.get(s, 0) + 1
    return counts


def test_other_dataset_forms():
    for caption, subject in OTHER_FORMS.items():
        assert entities.rule_subject(caption) == (subject, None), caption


def test_unparsed_report():
    captions = ["it is gone", "black car", "in the lot near the door", "is gone",
                "the cube moved", "the cube moved", "it is gone"]
    extraction = entities.extract_entities(captions, backend="rules")
    assert extraction.unparsed == {
        "it is gone": entities.PRONOUN, "black car": entities.FRAGMENT,
        "in the lot near the door": entities.LEADING_PP, "is gone": entities.NO_SUBJECT}
    assert extraction.num_captions == 7 and extraction.num_parsed == 2
    assert extraction.num_unparsed == 5  # occurrences: "it is gone" twice
    assert extraction.captions["it is gone"] is None
    assert extraction.parse_rate == pytest.approx(2 / 7)
    summary = extraction.summary()
    assert "unparsed: 5" in summary and "'black car'" in summary and entities.FRAGMENT in summary


def test_entity_ids_counts_and_order():
    captions = ["the cube moved", "the ball moved", "the tiny ball is gone",
                "the ball turned red", "the cube became blue", "the ball is missing"]
    extraction = entities.extract_entities(captions, backend="rules")
    assert [(e.id, e.text, e.count) for e in extraction.entities] == [
        (0, "ball", 3), (1, "cube", 2), (2, "tiny ball", 1)]
    # the order does not depend on the caption order
    again = entities.extract_entities(reversed(captions), backend="rules")
    assert again.entities == extraction.entities
    assert extraction.entity_of("the tiny ball is gone") == "tiny ball"


def test_save_and_load_round_trip(tmp_path):
    extraction = entities.extract_entities(["the cube moved", "it moved", "nothing has changed"],
                                    backend="rules", source={"dataset": "x"})
    path = tmp_path / "entities.json"
    entities.save_entities(path, extraction)
    assert [p.name for p in tmp_path.iterdir()] == ["entities.json"]  # no temp file left
    back = entities.load_entities(path)
    assert back == extraction


@pytest.mark.parametrize("mutate, key", [
    (lambda d: d.pop("entities"), "'entities' is missing"),
    (lambda d: d.update(backend="nltk"), "'backend' is 'nltk'"),
    (lambda d: d.update(format="other/1"), "'format'"),
    (lambda d: d["entities"][0].update(id=5), r"'entities\[0\].id' is 5"),
    (lambda d: d["entities"][0].update(count="2"), r"'entities\[0\].count' must be int"),
    (lambda d: d["entities"][1].update(count=5), r"'entities\[1\]' is out of order"),
    (lambda d: d["captions"].update({"the cube moved": "sphere"}),
     r"""'captions\["the cube moved"\]' names entity 'sphere'"""),
    (lambda d: d.update(num_parsed=99), "'num_parsed' is 99"),
    (lambda d: d.update(num_empty=-1), "'num_empty' is negative"),
    (lambda d: d["unparsed"].append({"caption": "the cube moved", "reason": "x"}),
     r"'unparsed\[1\].caption'"),
])
def test_load_errors_name_file_and_key(tmp_path, mutate, key):
    extraction = entities.extract_entities(["the cube moved", "the ball moved", "the ball is gone",
                                     "it moved"], backend="rules")
    data = extraction.to_json()
    mutate(data)
    path = tmp_path / "entities.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*" + key):
        entities.load_entities(path)


def test_load_rejects_bad_json(tmp_path):
    path = tmp_path / "entities.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=f"entity file {re.escape(str(path))} is not valid"):
        entities.load_entities(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        entities.load_entities(tmp_path / "missing.json")


def test_cli_on_small_synthetic_uses_train_change_captions_only(small_synthetic, tmp_path):
    # A copy, so the session's shared dataset directory is not written to.
    directory = small_synthetic.directory
    root = tmp_path / "data"
    shutil.copytree(directory.parents[1], root / directory.parents[1].name)
    copy = root / directory.relative_to(directory.parents[2])
    cmd = [sys.executable, "-m", "data_prep.entities", f"--data_dir={root}",
           "--dataset=synthetic", "--variant=moderate", "--backend=rules",
           *(f"--{k}={v}" for k, v in SMALL.items() if k != "feature_shape"),
           "--feature_shape=" + ",".join(map(str, SMALL["feature_shape"]))]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "unparsed: 0" in out.stdout and f"written: {copy / 'entities.json'}" in out.stdout
    extraction = entities.load_entities(copy / "entities.json")
    assert extraction.source["split"] == "train" and extraction.backend == "rules"

    def captions(split, field="change_captions"):
        source = small_synthetic.split(split)
        return [c.decode() for i in range(len(source)) for c in source[i][field]]

    train = captions("train")
    assert extraction.num_captions == len(train) and extraction.num_no_change == 0
    assert extraction.parse_rate == 1.0
    expected = {entities.rule_subject(c)[0] for c in train}
    assert set(extraction.texts) == expected
    test_only = {entities.rule_subject(c)[0] for c in captions("test")} - expected
    assert test_only, "the tiny dataset should have test entities that train lacks"
    assert not test_only & set(extraction.texts)
    assert not set(captions("train", "no_change_captions")) & set(extraction.captions)


def test_cli_errors_clearly_on_a_missing_dataset(tmp_path):
    cmd = [sys.executable, "-m", "data_prep.entities", f"--data_dir={tmp_path}",
           "--dataset=clevr_change"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "is not built in" in out.stderr


def test_auto_falls_back_to_rules_with_a_logged_reason(caplog):
    try:
        import spacy  # noqa: F401
        kwargs = {"spacy_model": "/nonexistent/spacy/pipeline"}
        reason = "cannot load the spaCy pipeline"
    except ImportError:
        kwargs, reason = {}, "spaCy is not installed"
    with caplog.at_level(logging.WARNING):
        extraction = entities.extract_entities(["the cube moved"], backend="auto", **kwargs)
    assert extraction.backend == "rules" and reason in extraction.fallback_reason
    assert reason in caplog.text and reason in extraction.summary()
    with pytest.raises(ValueError, match="needs spacy_model"):
        entities.extract_entities(["the cube moved"], backend="spacy")
    with pytest.raises(ValueError, match="unknown backend"):
        entities.extract_entities(["the cube moved"], backend="nltk")


def test_spacy_backend():
    spacy = pytest.importorskip(
        "spacy", reason="spaCy is not installed: the spaCy backend (the paper's extractor) "
        "is untested here; the rules backend is")
    model = os.environ.get("CHANGECAP_SPACY_MODEL", entities.DEFAULT_SPACY_MODEL)
    if not (spacy.util.is_package(model) or Path(model).exists()):
        pytest.skip(f"no spaCy pipeline {model!r} installed (set CHANGECAP_SPACY_MODEL to a "
                    "package name or path)")
    captions = list(REAL_CLEVR_CHANGE)[:10] + ["there is a person walking", "it moved"]
    extraction = entities.extract_entities(captions, backend="spacy", spacy_model=model)
    assert extraction.backend == "spacy" and extraction.spacy_model == model
    assert extraction.captions["the tiny yellow cylinder turned brown"] == "tiny yellow cylinder"
    assert extraction.captions["there is a person walking"] == "person"
    assert extraction.unparsed == {"it moved": entities.PRONOUN}


# --- spacy_subject on hand-made parses (runs without spaCy)


def _fake_doc(words, deps, heads, chunks, pos=None):
    tokens = [types.SimpleNamespace(i=i, text=w, lower_=w.lower(), dep_=d,
                                    pos_=(pos or {}).get(i, "NOUN"), text_with_ws=w + " ")
              for i, (w, d) in enumerate(zip(words, deps, strict=True))]
    for t, h in zip(tokens, heads, strict=True):
        t.head = tokens[h]
    for t in tokens:
        t.children = [c for c in tokens if c.head is t and c is not t]
    root = next(t for t in tokens if t.dep_ == "ROOT")
    sent = types.SimpleNamespace(root=root, start=0, text=" ".join(words))
    span = _Span(tokens, sent)
    return types.SimpleNamespace(
        sents=[span], noun_chunks=[_Span(tokens[a:b], None, a, b) for a, b in chunks])


class _Span(list):
    def __init__(self, tokens, sent=None, start=0, end=None):
        super().__init__(tokens)
        self.start, self.end = start, end if end is not None else len(tokens)
        if sent is not None:
            self.root, self.text = sent.root, sent.text


def test_spacy_subject_logic_on_fake_parses():
    doc = _fake_doc(
        "the small red cube that is behind the ball changed to blue".split(),
        ["det", "amod", "amod", "nsubj", "nsubj", "relcl", "prep", "det", "pobj", "ROOT",
         "prep", "pobj"],
        [3, 3, 3, 9, 5, 3, 5, 8, 6, 9, 9, 10], chunks=[(0, 4), (7, 9)])
    assert entities.spacy_subject(doc) == ("small red cube", None)  # the root's subject, not "that"
    doc = _fake_doc("there is a person walking".split(),
                    ["expl", "ROOT", "det", "attr", "acl"], [1, 1, 3, 1, 3], chunks=[(2, 4)])
    assert entities.spacy_subject(doc) == ("person", None)
    doc = _fake_doc("there are two people that are near the car".split(),
                    ["expl", "ROOT", "nummod", "attr", "nsubj", "relcl", "prep", "det", "pobj"],
                    [1, 1, 3, 1, 5, 3, 5, 8, 6], chunks=[(2, 4), (7, 9)])
    assert entities.spacy_subject(doc) == ("two people", None)  # not the relative "that"
    doc = _fake_doc("one of the cars moved".split(), ["nsubj", "prep", "det", "pobj", "ROOT"],
                    [4, 0, 3, 1, 4], chunks=[(0, 1), (2, 4)])
    assert entities.spacy_subject(doc) == ("cars", None)
    doc = _fake_doc("remove her hat".split(), ["ROOT", "poss", "dobj"], [0, 2, 0],
                    chunks=[(1, 3)], pos={0: "VERB"})
    assert entities.spacy_subject(doc) == ("hat", None)
    doc = _fake_doc("it moved".split(), ["nsubj", "ROOT"], [1, 1], chunks=[(0, 1)])
    assert entities.spacy_subject(doc) == (None, entities.PRONOUN)
