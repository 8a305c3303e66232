"""Recall@k of retrieved change entities (data_prep/entity_recall.py) on hand-made
cases whose recall is known by construction."""

from __future__ import annotations

import math

import numpy as np
import pytest

from changecap_jax.data.synthetic import scenes
from data_prep import entity_recall as er


def obj(size, color, material, shape, x=0.0):
    return scenes.SceneObject(size, color, material, shape, x, 0.0, 0.0)


RED_CUBE = obj("small", "red", "metal", "cube")
BLUE_CUBE = obj("small", "blue", "metal", "cube", 1.0)
RED_BALL = obj("large", "red", "rubber", "sphere", 2.0)
SCENE = (RED_CUBE, BLUE_CUBE, RED_BALL)
TEXTS = [
    "small red metal cube",  # 0 refers to RED_CUBE
    "red cube",  # 1 refers to RED_CUBE (unique: the other red object is a sphere)
    "red thing",  # 2 ambiguous: RED_CUBE and RED_BALL
    "tiny shiny block",  # 3 ambiguous: RED_CUBE and BLUE_CUBE
    "blue cube",  # 4 refers to BLUE_CUBE
    "big matte ball",  # 5 refers to RED_BALL
    "red",  # 6 no noun
    "car",  # 7 not a synthetic word
]


def test_parse_entity():
    assert er.parse_entity("tiny shiny block") == {"size": "small", "material": "metal",
                                                   "shape": "cube"}
    assert er.parse_entity("red thing") == {"color": "red"}
    assert er.parse_entity("red") is None
    assert er.parse_entity("red car") is None
    assert er.parse_entity("red blue cube") is None


def test_true_entities_needs_a_unique_reference():
    got = er.true_entities(TEXTS, RED_CUBE, SCENE)
    assert got.tolist() == [True, True, False, False, False, False, False, False]
    assert np.flatnonzero(er.true_entities(TEXTS, RED_BALL, SCENE)).tolist() == [5]


def test_recall_at_k_known_case():
    relevant = np.zeros((4, len(TEXTS)), bool)
    relevant[:, :2] = True  # every pair's true entities are 0 and 1
    ranked = np.array([[0, 4, 5, 6],   # hit at 1
                       [4, 1, 5, 6],   # hit at 2
                       [4, 5, 6, 0],   # hit at 4
                       [4, 5, 6, 7]])  # never
    assert er.recall_at_k(ranked, relevant, [1, 2, 3, 4]) == {1: 0.25, 2: 0.5, 3: 0.5, 4: 0.75}
    with pytest.raises(ValueError, match="outside"):
        er.recall_at_k(ranked, relevant, [5])


def test_chance_recall():
    relevant = np.zeros((1, 10), bool)
    relevant[0, :2] = True
    got = er.chance_recall_at_k(relevant, [1, 3])
    assert got[1] == pytest.approx(0.2)
    assert got[3] == pytest.approx(1 - math.comb(8, 3) / math.comb(10, 3))
    # Monte Carlo agrees with the closed form
    rng = np.random.default_rng(0)
    ranked = np.stack([rng.permutation(10)[:3] for _ in range(20000)])
    mc = er.recall_at_k(ranked, np.repeat(relevant, len(ranked), 0), [3])[3]
    assert mc == pytest.approx(got[3], abs=0.01)


def test_auroc():
    assert er.auroc(np.array([2.0, 3.0]), np.array([0.0, 1.0])) == 1.0
    assert er.auroc(np.array([0.0, 1.0]), np.array([2.0, 3.0])) == 0.0
    assert er.auroc(np.array([1.0]), np.array([1.0])) == 0.5


def test_split_recall_on_examples():
    """Two hand-made examples: a colour change of RED_CUBE, an add of RED_BALL."""
    def example(change_type, before, after, ib, ia):
        cam, light = scenes.Camera(), scenes.Lighting()
        return scenes.Example(tuple(before), tuple(after), change_type, ib, ia, cam, cam, cam,
                              light, light, light, (), ())

    recolored = obj("small", "green", "metal", "cube")
    ex_color = example("color", SCENE, (recolored, BLUE_CUBE, RED_BALL), 0, 0)
    ex_add = example("add", SCENE[:2], SCENE, -1, 2)
    ranked = {"semantic": np.array([[1, 4], [4, 5]]), "distractor": np.array([[4, 3], [0, 1]])}
    scores = {"semantic": np.array([[0.9, 0.1], [0.8, 0.1]]),
              "distractor": np.array([[0.2, 0.1], [0.3, 0.1]])}
    res = er.split_recall(TEXTS, [ex_color, ex_add], ranked, scores, [1, 2])
    assert res["semantic"]["refers"] == {1: 0.5, 2: 1.0}
    assert res["semantic"]["by_change_type"]["add"] == {1: 0.0, 2: 1.0}
    assert res["distractor"]["refers"] == {1: 0.0, 2: 0.0}
    # colour named: pair 0 (red) by "red cube" at 1; pair 1 (red ball) by "big matte ball"? no
    # colour there, so never
    assert res["semantic"]["color"] == {1: 0.5, 2: 0.5}
    assert res["top1_score_auroc_semantic_vs_distractor"] == 1.0


def test_command_without_the_dataset_is_one_line_and_status_2(tmp_path, capsys):
    assert er.main([f"--data_dir={tmp_path}", "--splits=test"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "data_prep.build" in err[0], err
