"""IDC-PCL FDA hard negatives (data_prep/methods/negative_mining.py, data/word_classes.py;
the command data_prep/hard_negatives.py)."""

from __future__ import annotations

import collections
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from changecap_jax.data import negatives
from changecap_jax.data import word_classes as wc
from changecap_jax.data.synthetic import scenes
from changecap_jax.data.vocab import tokenize
from data_prep.methods import negative_mining as hn

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def result(small_synthetic):
    return hn.generate(small_synthetic, seed=0, pos="lexicon")


@pytest.fixture(scope="module")
def dataset_pairs(small_synthetic):
    """split -> [(image_id, semantic, references)], read independently of the module."""
    out = {}
    for split in ("train", "val", "test"):
        source = small_synthetic.split(split)
        pairs = []
        for i in range(len(source)):
            rec = source[i]
            image_id = rec["image_id"].decode()
            pairs.append((image_id, True, [c.decode() for c in rec["change_captions"]]))
            pairs.append((image_id, False, [c.decode() for c in rec["no_change_captions"]]))
        out[split] = pairs
    return out


def words(text: str) -> list[str]:
    return [t.lower() for t in tokenize(text)[1:-1] if t.strip()]


def sample_captions(n: int, seed: int = 0) -> list[list[str]]:
    rng = np.random.default_rng(seed)
    caps = []
    for i in range(n):
        ex = scenes.sample_example(rng, scenes.CHANGE_TYPES[i % 5], "moderate", 6)
        caps += list(ex.change_captions) + list(ex.no_change_captions)
    return [tokenize(c)[1:-1] for c in caps]


def negatives_of(result, labels):
    for split, records in result.records.items():
        for rec in records:
            for neg, kind in zip(rec["neg_samples"], rec["neg_kinds"], strict=True):
                if kind in labels:
                    yield split, rec, neg


# ----------------------------------------------------------------------------- word classes


def test_fallback_word_classes_are_exact_on_the_synthetic_vocabulary(result, small_synthetic):
    classes = result.classes
    assert classes.source == "lexicon"
    expected = {}
    for colour in scenes.COLORS:
        expected[colour] = "colour"
    for table, cls in ((scenes.SIZE_WORDS, "size"), (scenes.MATERIAL_WORDS, "material"),
                       (scenes.SHAPE_WORDS, "shape")):
        for value, synonyms in table.items():
            for w in synonyms:
                expected[w] = cls
            # synonyms share a sense, other values do not
            assert len({classes.sense_of(w) for w in synonyms}) == 1, value
        senses = [classes.sense_of(ws[0]) for ws in table.values()]
        assert len(set(senses)) == len(senses)
    for w in scenes.GENERIC_WORDS:
        expected[w] = "generic"
    vocab_words = [w for w in small_synthetic.vocab.word_to_id if not w.startswith("<")]
    got = {w: classes.class_of(w) for w in vocab_words if classes.class_of(w)}
    assert got == {w: c for w, c in expected.items() if w in vocab_words}
    assert set(expected) <= set(vocab_words)  # the tiny set still uses every attribute word
    assert classes.expanded == {}
    assert "grey" in classes.missing_lexicon["colour"]  # checked against the vocabulary
    assert classes.is_head("cube") and classes.is_head("thing") and not classes.is_head("red")
    assert not classes.can_replace("thing") and classes.can_replace("tiny")


def test_distributional_check_on_a_larger_synthetic_sample():
    tokens = sample_captions(1500)
    tfidf = hn.TfIdf(hn.caption_key(t) for t in tokens)
    classes = wc.build_word_classes(tokens, tfidf.idf, min_df=10)
    assert classes.expanded == {} and classes.inconsistent == {}
    # An attribute word the lexicon lacks is found from its positions.
    renamed = [["magenta" if w == "purple" else w for w in t] for t in tokens]
    classes = wc.build_word_classes(renamed, tfidf.idf, min_df=10)
    assert classes.expanded == {"magenta": "colour"}
    assert classes.class_of("magenta") == "colour" and classes.can_replace("magenta")


def test_noun_phrases_and_swaps(result):
    classes = result.classes
    t = "the small red cube that is behind the big sphere moved".split()
    assert classes.noun_phrases(t) == [(0, 4), (7, 10)]
    swaps = [" ".join(s) for s in hn.swap_rewrites(t, classes)]
    assert "the big sphere that is behind the small red cube moved" in swaps
    swaps = [" ".join(s) for s in hn.swap_rewrites("the red cube changed to blue".split(),
                                                   classes)]
    assert swaps == ["the blue cube changed to red"]
    # synonyms are not swapped: the meaning would not change
    assert hn.swap_rewrites("the metal cube turned shiny".split(), classes) == []
    profile = hn.subject_profile([hn.Caption("", tuple("the small red metal cube moved".split()))],
                                 classes)
    assert not hn.contradicts("the red cube".split(), profile, classes)  # may be the same one
    assert not hn.contradicts("the tiny red metallic block".split(), profile, classes)
    assert hn.contradicts("the red rubber cube".split(), profile, classes)


def test_renderer_round_trips_the_clevr_tokeniser():
    render = hn.make_renderer("clevr", tokenize)
    tokens = tokenize("the cube, which was red; moved.")[1:-1]
    text = render(tokens)
    assert text == "the cube, which was red; moved"
    assert tokenize(text)[1:-1] == tokens


def test_pos_tags_give_noun_and_adjective_classes(result, small_synthetic):
    # A stand-in for spaCy: the module only needs word -> majority Penn tag.
    tags = {"change": "NN", "difference": "NN", "scene": "NN", "location": "NN",
            "scenes": "NNS", "same": "JJ", "identical": "JJ", "different": "JJ"}
    train = [ref.tokens for pair in hn.read_pairs(small_synthetic, "train")[0]
             for ref in pair.references]
    tfidf = hn.TfIdf(hn.caption_key(t) for t in train)
    classes = wc.build_word_classes(train, tfidf.idf, pos_tags=tags, pos_source="fake",
                                    min_df=1)
    assert classes.source == "lexicon+fake"
    assert classes.class_of("change") == "pos:NN" and classes.class_of("red") == "colour"
    assert classes.is_head("scene") and not classes.is_head("identical")
    with_pos = hn.generate(small_synthetic, seed=0, classes=classes)
    replaced = [(rec, neg) for _, rec, neg in negatives_of(with_pos, {"replace"})
                if rec["img2"].startswith("CLEVR_nonsemantic")]
    assert replaced, "no-change captions are rewritten once their nouns have a class"
    for rec, neg in replaced:
        assert any(_replaced_positions(ref, neg, classes) for ref in rec["sentences"])
    before = sum(v for k, v in result.summary["splits"]["train"]["negatives"].items()
                 if k == "retrieve-for-replace")
    after = with_pos.summary["splits"]["train"]["negatives"].get("retrieve-for-replace", 0)
    assert after < before


# ----------------------------------------------------------------------------- the three kinds


def test_every_pair_gets_six_negatives_none_a_positive(result, dataset_pairs):
    for split, records in result.records.items():
        assert [(r["image_id"], r["img2"].split("_")[1] == "semantic", r["sentences"])
                for r in records] == dataset_pairs[split]
        for rec in records:
            assert len(rec["neg_samples"]) == negatives.NUM_NEGATIVES == len(rec["neg_kinds"])
            refs = {tuple(words(s)) for s in rec["sentences"]}
            keys = [tuple(words(n)) for n in rec["neg_samples"]]
            assert not refs & set(keys), rec
            assert len(set(keys)) == len(keys), rec  # the tiny splits still have enough
            assert [k.split("-")[-1] if "-for-" in k else k.split("-")[0]
                    for k in rec["neg_kinds"]] == [k for k in hn.KINDS for _ in range(2)]


def _brute_tfidf(train_texts):
    docs = [words(t) for t in train_texts]
    df = collections.Counter(w for d in docs for w in set(d) if any(c.isalnum() for c in w))
    idf = {w: math.log((1 + len(docs)) / (1 + n)) + 1 for w, n in df.items()}

    def vec(text):
        counts = collections.Counter(w for w in words(text) if w in idf)
        v = {w: n * idf[w] for w, n in counts.items()}
        norm = math.sqrt(sum(x * x for x in v.values()))
        return {w: x / norm for w, x in v.items()} if norm else {}

    return idf, vec


def test_retrieve_is_the_top_tfidf_neighbour(result, dataset_pairs):
    train_texts = [t for _, _, refs in dataset_pairs["train"] for t in refs]
    _, vec = _brute_tfidf(train_texts)
    checked = 0
    for split, records in result.records.items():
        pairs = dataset_pairs[split]
        no_change = {tuple(words(t)) for _, sem, refs in pairs if not sem for t in refs}
        for n, rec in enumerate(records):
            own = {tuple(words(t)) for t in pairs[n][2]}
            query = collections.Counter()
            for key in own:
                for w, x in vec(" ".join(key)).items():
                    query[w] += x
            norm = math.sqrt(sum(x * x for x in query.values()))
            cands = {}
            for m, (_, _, refs) in enumerate(pairs):
                for t in refs:
                    key = tuple(words(t))
                    if m == n or key in own or (not pairs[n][1] and key in no_change):
                        continue
                    cands[key] = sum(query[w] * x for w, x in vec(t).items()) / norm
            best = sorted(cands.values(), reverse=True)
            got = [tuple(words(neg)) for neg, kind in
                   zip(rec["neg_samples"], rec["neg_kinds"], strict=True) if kind == "retrieve"]
            assert len(got) == 2
            for rank, key in enumerate(got):
                assert key in cands, "a retrieved caption is another pair's caption"
                assert cands[key] == pytest.approx(best[rank], abs=1e-5)
            checked += 1
    assert checked == sum(len(r) for r in result.records.values())


def _replaced_positions(ref, neg, classes):
    a, b = tokenize(ref)[1:-1], tokenize(neg)[1:-1]
    if len(a) != len(b):
        return None
    diff = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    ok = diff and all(classes.class_of(a[i]) == classes.class_of(b[i]) is not None
                      and classes.sense_of(a[i]) != classes.sense_of(b[i]) for i in diff)
    return diff if ok else None


def test_replace_changes_the_top_half_words_within_their_class(result, dataset_pairs):
    classes = result.classes
    idf, _ = _brute_tfidf([t for _, _, refs in dataset_pairs["train"] for t in refs])
    found = 0
    for _, rec, neg in negatives_of(result, {"replace"}):
        matches = []
        for ref in rec["sentences"]:
            diff = _replaced_positions(ref, neg, classes)
            if diff is None:
                continue
            toks = [t.lower() for t in tokenize(ref)[1:-1]]
            cands = [i for i, t in enumerate(toks) if classes.can_replace(t)]
            weight = {i: toks.count(toks[i]) * idf.get(toks[i], 0.0) for i in cands}
            if len(diff) != math.ceil(len(cands) / 2):
                continue
            lowest_chosen = min(weight[i] for i in diff)
            if all(weight[i] <= lowest_chosen for i in cands if i not in diff):
                matches.append(ref)
        assert matches, (neg, rec["sentences"])
        found += 1
    assert found >= 2 * 40  # every semantic train pair has attribute words


def _swapped(ref, neg, classes):
    """Whether neg is ref with two spans exchanged: two noun phrases or two same-class words."""
    nps = set(classes.noun_phrases(ref))
    n = len(ref)
    for a in range(n):
        for b in range(a + 1, n + 1):
            for c in range(b, n):
                for d in range(c + 1, n + 1):
                    if ref[:a] + ref[c:d] + ref[b:c] + ref[a:b] + ref[d:] != neg:
                        continue
                    if (a, b) in nps and (c, d) in nps:
                        return True
                    if b == a + 1 and d == c + 1 and classes.class_of(ref[a]) == \
                            classes.class_of(ref[c]) is not None:
                        return True
    return False


def test_confuse_swaps_phrases_or_subjects(result, dataset_pairs):
    classes = result.classes
    kinds = collections.Counter()
    for split, rec, neg in negatives_of(result, {"confuse-swap", "confuse-subject"}):
        neg_t = tokenize(neg)[1:-1]
        refs = [tokenize(r)[1:-1] for r in rec["sentences"]]
        same_words = [r for r in refs if sorted(r) == sorted(neg_t)]
        if same_words:
            kinds["swap"] += 1
            assert any(r != neg_t and _swapped(r, neg_t, classes) for r in same_words), neg
            continue
        kinds["subject"] += 1
        # The subject of one reference is replaced by the subject of another pair's caption
        # that names a different attribute value.
        own = set(rec["sentences"])
        subjects = set()
        for _, _, texts in dataset_pairs[split]:
            for t in texts:
                if t in own:
                    continue
                toks = tokenize(t)[1:-1]
                nps = classes.noun_phrases(toks)
                if nps:
                    subjects.add(tuple(toks[nps[0][0] : nps[0][1]]))
        profile = hn.subject_profile([hn.Caption(r, tuple(tokenize(r)[1:-1]))
                                      for r in rec["sentences"]], classes)
        ok = False
        for r in refs:
            nps = classes.noun_phrases(r)
            if not nps:
                continue
            s0, e0 = nps[0]
            tail = len(r) - e0
            if neg_t[:s0] == r[:s0] and neg_t[len(neg_t) - tail :] == r[e0:]:
                donor = tuple(neg_t[s0 : len(neg_t) - tail])
                ok = ok or (donor in subjects and hn.contradicts(donor, profile, classes))
        assert ok, (neg, rec["sentences"])
    assert kinds["swap"] > 0 and kinds["subject"] > 0


def test_fallbacks_are_labelled_and_counted(result):
    for split, records in result.records.items():
        counts = collections.Counter(k for r in records for k in r["neg_kinds"])
        assert counts == collections.Counter(result.summary["splits"][split]["negatives"])
        for rec in records:
            if rec["img2"].startswith("CLEVR_nonsemantic"):
                # "there is no change" has no attribute word and no object
                assert rec["neg_kinds"] == ["retrieve"] * 2 + ["retrieve-for-replace"] * 2 + [
                    "retrieve-for-confuse"] * 2
                assert all(n.startswith("the ") for n in rec["neg_samples"])  # change captions
    text = hn.format_summary(result.summary)
    assert "retrieve-for-replace" in text and "confuse-swap" in text


def test_deterministic_for_a_seed_and_different_across_seeds(result, small_synthetic):
    again = hn.generate(small_synthetic, seed=0, pos="lexicon")
    assert again.records == result.records
    other = hn.generate(small_synthetic, seed=1, pos="lexicon")
    diff = sum(a["neg_samples"] != b["neg_samples"]
               for a, b in zip(result.records["train"], other.records["train"], strict=True))
    assert diff > 10


# ----------------------------------------------------------------------------- files


def test_reader_round_trips_our_file(result, tmp_path):
    path = negatives.negatives_path(tmp_path, "train")
    assert path.name == "train_neg_tfidf6.json"
    hn.write_negatives(result.records["train"], path)
    assert not [p for p in tmp_path.iterdir() if p.name != path.name]  # no temp file left
    records = negatives.load_negatives(path)
    assert [(r.img1, r.img2, list(r.sentences), list(r.negatives), r.image_id, list(r.kinds))
            for r in records] == [
        (r["img1"], r["img2"], r["sentences"], r["neg_samples"], r["image_id"], r["neg_kinds"])
        for r in result.records["train"]]
    by_pair = negatives.negatives_by_pair(records)
    first = result.records["train"][0]
    assert by_pair[(first["image_id"], True)] == tuple(first["neg_samples"])
    assert len(by_pair) == len(records)


def official_line(img_id: str = "000001", kind: str = "semantic", **override) -> str:
    rec = {"img1": f"CLEVR_default_{img_id}.png", "img2": f"CLEVR_{kind}_{img_id}.png",
           "sentences": ["the red cube moved", "the red block changed its location"],
           "neg_samples": ["the blue cube moved", "the red sphere moved", "the red cube is gone",
                           "the red cube turned blue", "the small cube moved",
                           "the red cube has appeared"]}
    rec.update(override)
    return json.dumps(rec)


def test_reader_reads_the_official_format(tmp_path):
    path = tmp_path / "val_neg_tfidf6.json"
    path.write_text(official_line() + "\n\n" + official_line(kind="nonsemantic", sentences=
                                                           "there is no change") + "\n")
    a, b = negatives.load_negatives(path)
    assert (a.image_id, a.semantic, a.kinds) == ("000001.png", True, None)
    assert (b.image_id, b.semantic, b.sentences) == ("000001.png", False,
                                                     ("there is no change",))
    assert a.negatives[0] == "the blue cube moved" and len(a.negatives) == 6
    assert set(negatives.negatives_by_pair([a, b])) == {("000001.png", True), ("000001.png", False)}
    # the same records as one JSON array
    path.write_text("[" + official_line() + "]")
    assert negatives.load_negatives(path)[0].image_id == "000001.png"


@pytest.mark.parametrize("content, message", [
    (official_line().replace('"neg_samples"', '"negs"'), "missing key 'neg_samples'"),
    (official_line(neg_samples=["a", "b"]), "'neg_samples' must hold 6 strings, got 2"),
    (official_line(neg_samples="the blue cube moved"), "'neg_samples' must be a list"),
    (official_line(neg_samples=["a", "b", "c", "d", "e", 6]), "'neg_samples'[5] must be a "
                                                              "non-empty string"),
    (official_line(sentences=[]), "'sentences' must not be empty"),
    (official_line(img2=None), "'img2' must be a non-empty string"),
    (official_line(neg_kinds=["retrieve"]), "'neg_kinds' must hold 6 strings"),
    ("[1, 2]", "record 0: expected a JSON object"),
    (official_line() + "\n{not json", "line 2: not valid JSON"),
    (official_line() + "\n" + official_line(), "line 2: pair img1="),
    ("\n", "holds no records"),
])
def test_reader_names_the_problem(tmp_path, content, message):
    path = tmp_path / "train_neg_tfidf6.json"
    path.write_text(content)
    with pytest.raises(negatives.NegativesFileError) as err:
        negatives.load_negatives(path)
    assert message in str(err.value) and str(path) in str(err.value)


def test_reader_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope_neg_tfidf6.json"):
        negatives.load_negatives(tmp_path / "nope_neg_tfidf6.json")


def test_cli_writes_the_official_files(small_synthetic, tmp_path):
    from tests.conftest import SMALL

    root = small_synthetic.directory.parents[2]
    options = [f"--option={k}={','.join(map(str, v)) if isinstance(v, tuple) else v}"
               for k, v in SMALL.items()]
    proc = subprocess.run(
        [sys.executable, "-m", "data_prep.hard_negatives", f"--data_dir={root}",
         "--dataset=synthetic", "--variant=moderate", "--seed=0", "--pos=lexicon",
         f"--out={tmp_path}", *options],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "retrieve: 160 by its rule" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "test_neg_tfidf6.json", "train_neg_tfidf6.json", "val_neg_tfidf6.json"]
    ours = negatives.load_negatives(tmp_path / "train_neg_tfidf6.json")
    expected = hn.generate(small_synthetic, seed=0, pos="lexicon").records["train"]
    assert [list(r.negatives) for r in ours] == [r["neg_samples"] for r in expected]


def _pairs(*groups):
    return [hn.Pair(f"{i:06d}.png", True, [hn.Caption(t, tuple(tokenize(t)[1:-1])) for t in g])
            for i, g in enumerate(groups)]


def test_too_few_captions_repeat_and_none_is_an_error():
    pairs = _pairs(["the red cube moved"], ["the blue sphere moved"])
    out = hn.negatives_for_pairs({"train": pairs}, "synthetic", "clevr", tokenize,
                                 splits=["train"], pos="lexicon", min_df=1)
    rec = out.records["train"][0]
    # the only other caption, and the only rewrite (the words present: red/blue, cube/sphere)
    assert set(rec["neg_samples"]) == {"the blue sphere moved", "the blue cube moved"}
    assert rec["neg_kinds"] == ["retrieve", "repeat-for-retrieve", "replace",
                                "repeat-for-replace", "repeat-for-confuse", "repeat-for-confuse"]
    assert "the red cube moved" not in rec["neg_samples"]
    with pytest.raises(hn.HardNegativeError, match="no possible negative"):
        hn.negatives_for_pairs({"train": pairs[:1]}, "synthetic", "clevr", tokenize,
                               splits=["train"], pos="lexicon")


def test_pos_auto_uses_spacy_only_when_installed(monkeypatch):
    tokens = sample_captions(20)
    tfidf = hn.TfIdf(hn.caption_key(t) for t in tokens)
    monkeypatch.setattr(wc, "spacy_tagger", lambda package=None: None)
    assert hn.make_word_classes(tokens, tfidf, "auto").source == "lexicon"
    with pytest.raises(hn.HardNegativeError, match="spaCy"):
        hn.make_word_classes(tokens, tfidf, "spacy")
    fake = (lambda token_lists: {"location": "NN", "scene": "NN"}, "spacy:fake")
    monkeypatch.setattr(wc, "spacy_tagger", lambda package=None: fake)
    classes = hn.make_word_classes(tokens, tfidf, "auto", min_df=1)
    assert classes.source == "lexicon+spacy:fake" and classes.class_of("scene") == "pos:NN"
    assert hn.make_word_classes(tokens, tfidf, "lexicon").source == "lexicon"
