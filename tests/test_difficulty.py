"""The difficulty-binned evaluation (changecap_jax/evaluators/difficulty.py, common.DifficultyBins):
viewpoint IoU, quantile bins, change words, the pointing game on constructed attention whose
answer is known, the synthetic builder's IoU fields, and a tiny training run's metrics."""

from __future__ import annotations

import json
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from changecap_jax.data import boxes as geometry
from changecap_jax.data import datasets
from changecap_jax.data.synthetic import builder, render, scenes
from changecap_jax.evaluators import captions as ev
from changecap_jax.evaluators import common, difficulty, tokenize
from changecap_jax.models.base import ATTENTION
from tests.train_helpers import SMALL, tiny_config

IMAGE = (64, 64)  # (height, width) of the constructed cases
GRID = (4, 4)  # 16 x 16 pixel cells


def test_box_iou_and_the_viewpoint_mean():
    assert geometry.box_iou([0, 0, 10, 10], [5, 0, 10, 10]) == pytest.approx(50 / 150)
    assert geometry.box_iou([0, 0, 10, 10], [0, 0, 10, 10]) == 1.0
    assert geometry.box_iou([0, 0, 10, 10], [20, 20, 5, 5]) == 0.0
    # Hidden (0 size) and absent (-1) boxes leave the mean; nothing left gives NaN.
    pairs = [([0, 0, 10, 10], [5, 0, 10, 10]), ([0, 0, 4, 4], [0, 0, 4, 4]),
             ([0, 0, 0, 0], [1, 1, 3, 3]), ([-1, -1, -1, -1], [0, 0, 2, 2])]
    assert geometry.mean_box_iou(pairs) == pytest.approx((50 / 150 + 1.0) / 2)
    assert np.isnan(geometry.mean_box_iou(pairs[2:]))


def test_quantile_bins_sort_ascending_drop_nan_and_split_evenly():
    values = [0.9, np.nan, 0.1, 0.5, 0.3, 0.7, 0.2, np.nan]
    bins = difficulty.quantile_bins(values, 3)
    assert [list(b) for b in bins] == [[2, 6], [4, 3], [5, 0]]
    assert [len(b) for b in difficulty.quantile_bins(values, 4)] == [2, 2, 1, 1]
    assert len(difficulty.quantile_bins([0.4, 0.2], 5)) == 2
    with pytest.raises(ValueError, match="num_bins"):
        difficulty.quantile_bins(values, 0)


def test_change_words_are_the_first_run_of_object_words():
    words = ["<NULL>", "<START>", "<END>", "the", "small", "red", "cube", "left", "of",
             "blue", "sphere", "moved", "there", "is", "no", "change"]
    vocab = dict(enumerate(words))
    to_ids = lambda text: np.array([1] + [words.index(w) for w in text.split()] + [2, 0, 0])  # noqa: E731
    # Queries 3, 4, 5 generated tokens 4, 5, 6: "small red cube"; "blue sphere" is a referent.
    ids = to_ids("the small red cube left of blue sphere moved")
    assert difficulty.change_word_queries(ids, vocab).tolist() == [1, 2, 3]
    assert difficulty.change_word_queries(to_ids("there is no change"), vocab).size == 0


def test_cell_fractions_cover_the_box_area():
    fractions = geometry.cell_fractions(GRID, IMAGE, [8, 16, 24, 16])
    assert fractions.sum() * 16 * 16 == pytest.approx(24 * 16)
    np.testing.assert_allclose(fractions[1], [0.5, 1.0, 0.0, 0.0])
    assert fractions[[0, 2, 3]].sum() == 0


def _supersampled_union(grid, image_size, boxes, factor=40):
    """Each cell's share inside the union, by testing a fine lattice of points in it."""
    (gh, gw), (ih, iw) = grid, image_size
    ys = (np.arange(gh * factor) + 0.5) * ih / (gh * factor)
    xs = (np.arange(gw * factor) + 0.5) * iw / (gw * factor)
    inside = np.zeros((len(ys), len(xs)), bool)
    for x, y, w, h in boxes:
        if w > 0 and h > 0:
            inside |= ((xs[None, :] >= x) & (xs[None, :] <= x + w)
                       & (ys[:, None] >= y) & (ys[:, None] <= y + h))
    return inside.reshape(gh, factor, gw, factor).mean(axis=(1, 3))


@pytest.mark.parametrize("boxes", [
    [[60, 30, 80, 20], [-1, -1, -1, -1]],           # one box, the other absent
    [[0, 0, 100, 50], [50, 0, 100, 50]],             # overlapping: the overlap counts once
    [[10, 10, 30, 30], [120, 60, 70, 35]],           # disjoint
    [[20, 20, 100, 60], [40, 30, 20, 20], [30, 25, 50, 50]],  # nested, three boxes
])
def test_union_fractions_match_a_supersampled_union(boxes):
    got = geometry.union_fractions((4, 4), (100, 200), boxes)
    np.testing.assert_allclose(got, _supersampled_union((4, 4), (100, 200), boxes), atol=0.02)
    single = [b for b in boxes if b[2] > 0]
    if len(single) == 1:
        np.testing.assert_allclose(got, geometry.cell_fractions((4, 4), (100, 200), single[0]))


@pytest.mark.parametrize("box", [[16, 0, 16, 32], [10, 20, 30, 25]])
def test_pointing_known_answers(box):
    fractions = geometry.cell_fractions(GRID, IMAGE, box)
    share = box[2] * box[3] / (IMAGE[0] * IMAGE[1])
    inside = np.unravel_index(np.argmax(fractions), GRID)
    peaked = np.full(GRID, 0.01)
    peaked[inside] = 1.0
    uniform = np.ones(GRID)
    outside = np.full(GRID, 0.01)
    outside[np.unravel_index(np.argmin(fractions), GRID)] = 1.0
    assert geometry.pointing_score(peaked, fractions) == pytest.approx(fractions[inside])
    assert geometry.pointing_score(uniform, fractions) == pytest.approx(share)
    assert geometry.attention_in_box(uniform, fractions) == pytest.approx(share)
    assert geometry.pointing_score(outside, fractions) == 0.0
    if fractions.max() == 1.0:
        assert geometry.pointing_score(peaked, fractions) == 1.0


def test_score_pair_counts_each_present_box_once():
    on_box = np.zeros(GRID)
    on_box[0, 1] = 1.0  # the cell [16, 32) x [0, 16)
    absent = [-1, -1, -1, -1]
    assert difficulty.score_pair((on_box, on_box), ([16, 0, 16, 16], absent), IMAGE) == (
        1.0, 1.0, 1)
    hits, mass, count = difficulty.score_pair((on_box, np.ones(GRID)),
                                              ([16, 0, 16, 16], [0, 0, 32, 32]), IMAGE)
    assert (hits, count) == (pytest.approx(1.0 + 0.25), 2)
    assert mass == pytest.approx(1.0 + 0.25)


def test_synthetic_viewpoint_iou_is_one_without_a_camera_move():
    for example_id in range(10):  # every change type
        for variant, expect_one in (("none", True), ("extreme", False)):
            cfg = builder.make_config(variant, num_train=10, num_val=2, num_test=2)
            ex = builder.make_example(cfg, example_id)
            boxes = {k: render.render(objects, cam, light, cfg.image_size)[1]
                     for k, (objects, cam, light) in {
                         "before": (ex.before, ex.camera_before, ex.light_before),
                         "after": (ex.after, ex.camera_semantic, ex.light_semantic)}.items()}
            pairs = scenes.same_objects(ex)
            assert all(ex.before[i] == ex.after[j] for i, j in pairs), ex.change_type
            assert len(pairs) == len(ex.before) - (ex.change_type != "add")
            iou = geometry.mean_box_iou([(boxes["before"][i], boxes["after"][j])
                                           for i, j in pairs])
            assert (iou == pytest.approx(1.0)) == expect_one, (variant, ex.change_type, iou)


class PointingModel(nn.Module):
    """A stand-in captioner whose cross-attention is set by its inputs: channel 0 of the after
    grid holds the attention logits over the grid cells (one shared grid memory)."""

    MEMORY_LAYOUT = "shared_grid"

    def encode(self, before: jax.Array, after: jax.Array) -> jax.Array:
        return after.reshape(after.shape[0], -1, after.shape[-1])

    def decode(self, memory: jax.Array, ids: jax.Array) -> jax.Array:
        probs = jax.nn.softmax(memory[..., 0], axis=-1)
        self.sow(ATTENTION, "probs", jnp.broadcast_to(
            probs[:, None, None, :], (memory.shape[0], 2, ids.shape[1], memory.shape[1])))
        return jnp.zeros(ids.shape + (4,))


def test_evaluator_pointing_on_constructed_attention():
    """Two semantic pairs whose changed object's box is the cell (1, 2): attention peaked on
    that cell scores 100, uniform attention the box's share of the image (1/16)."""
    words = ["<NULL>", "<START>", "<END>", "the", "red", "cube", "moved"]
    dataset = types.SimpleNamespace(
        vocab=types.SimpleNamespace(id_to_word=dict(enumerate(words))),
        meta=types.SimpleNamespace(image_size=IMAGE))
    evaluator = common.DifficultyBins(PointingModel(), jnp.float32, dataset, num_bins=2)
    evaluator.start("test")
    logits = np.zeros((2, *GRID, 3), np.float32)
    logits[0, 1, 2, 0] = 30.0  # pair 0: attention on the box; pair 1: uniform
    box = np.array([32, 16, 16, 16], np.float32)
    ids = np.array([[1, 3, 4, 5, 6, 2, 0]] * 2)
    records = [{"bbox_before": box, "bbox_after": box, "viewpoint_iou_semantic": np.float32(v)}
               for v in (0.3, 0.8)]
    captions = [ev.PairCaption(f"{i:06d}.png", "the red cube moved",
                                       ["the red cube moved"], "move") for i in range(2)]
    evaluator.add(common.EvalBatch(
        {}, {"before": jnp.asarray(logits), "after_semantic": jnp.asarray(logits)},
        {"semantic": "after_semantic"}, np.arange(2),
        [("semantic", r, c) for r, c in zip(records, captions, strict=True)],
        {"semantic": ids}))
    entry = evaluator.finish(captions)["difficulty"]
    hard, easy = entry["bins"]["semantic"]
    assert (hard["iou_low"], easy["iou_low"]) == (pytest.approx(0.3), pytest.approx(0.8))
    assert hard["pointing"] == pytest.approx(100.0) and hard["num_boxes"] == 2
    assert easy["pointing"] == pytest.approx(100.0 / 16)
    assert easy["attention_in_box"] == pytest.approx(100.0 / 16)
    assert hard["attention_in_box"] == pytest.approx(100.0, abs=1e-6)
    assert entry["pointing"]["pointing"] == pytest.approx((100.0 + 100.0 / 16) / 2)
    assert evaluator.extra["000001.png"] == {"viewpoint_iou": pytest.approx(0.8),
                                             "pointing": pytest.approx(100.0 / 16)}


def test_bins_are_scored_alone():
    """Six semantic pairs in three IoU bins, captions of varied quality: each bin's scores
    equal scoring that bin's pairs alone; the hardest bin comes first."""
    dataset = types.SimpleNamespace(vocab=types.SimpleNamespace(id_to_word={}),
                                    meta=types.SimpleNamespace(image_size=None))
    evaluator = common.DifficultyBins(PointingModel(), jnp.float32, dataset, num_bins=3)
    evaluator.start("test")
    ious = [0.9, 0.1, 0.5, 0.2, 0.7, 0.4]
    generated = ["the red cube moved", "the blue ball is gone", "a cube", "the red cube moved",
                 "the thing turned red", "nothing has changed"]
    references = [["the red cube moved", "the red block changed its location"],
                  ["the blue sphere is gone"], ["the small cube has been added"],
                  ["the red cube moved"], ["the green thing turned red"],
                  ["the big sphere is missing"]]
    captions = [ev.PairCaption(f"{i:06d}.png", g, r, "move")
                for i, (g, r) in enumerate(zip(generated, references, strict=True))]
    records = [{"viewpoint_iou_semantic": np.float32(v)} for v in ious]
    evaluator.add(common.EvalBatch(
        {}, {}, {"semantic": "after_semantic"}, np.arange(6),
        [("semantic", r, c) for r, c in zip(records, captions, strict=True)]))
    rows = evaluator.finish(captions)["difficulty"]["bins"]["semantic"]
    assert [r["num_pairs"] for r in rows] == [2, 2, 2]
    # Each expected group scored as its own COCOEvalCap run (ev.score_tokenized's
    # subsets, tested against scoring alone in test_evaluation.py).
    groups = ([1, 3], [5, 2], [4, 0])
    alone = ev.score_tokenized(
        tokenize.tokenize_captions({c.image_id: c.caption for c in captions},
                                     {c.image_id: c.references for c in captions}),
        {k: [captions[i].image_id for i in g] for k, g in enumerate(groups)}, spice="off")
    for k, (row, members) in enumerate(zip(rows, groups, strict=True)):
        assert (row["iou_low"], row["iou_high"]) == (
            pytest.approx(ious[members[0]]), pytest.approx(ious[members[1]]))
        for metric in ("CIDEr", "METEOR", "Bleu_4"):
            assert row[metric] == pytest.approx(100 * alone[k][metric], rel=1e-12), metric
    assert len({round(r["CIDEr"], 6) for r in rows}) == 3  # the bins really differ


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("difficulty_data")
    datasets.prepare("synthetic", root, "moderate", SMALL)
    return str(root)


def test_trainer_evaluation_writes_binned_metrics(data_dir, tmp_path):
    """The trainer's evaluation carries each record's IoU and boxes to the evaluator: bins of
    the records' IoUs, every semantic pair scored or counted, the per-pair fields written."""
    from changecap_jax.trainers import captioning

    config = tiny_config(data_dir, spice="off", difficulty_bins=3)
    trainer = captioning.Trainer(config, tmp_path)
    entry = trainer.evaluate(trainer.init_state(), "test", 0)["difficulty"]
    source = trainer.dataset.split("test")
    captions = json.loads((tmp_path / "captions" / "test_0.json").read_text())
    by_id = {c["image_id"]: c for c in captions}
    for stream, suffix in (("semantic", ""), ("distractor", "_n")):
        ious = {f"{int(r['id']):06d}.png{suffix}": float(r[f"viewpoint_iou_{stream}"])
                for r in (source[i] for i in range(len(source)))}
        assert {i: by_id[i]["viewpoint_iou"] for i in ious} == pytest.approx(ious)
        ids = sorted(ious)
        rows = entry["bins"][stream]
        assert sum(r["num_pairs"] for r in rows) == len(ious) == SMALL["num_test"]
        for row, group in zip(rows, difficulty.quantile_bins([ious[i] for i in ids], 3),
                              strict=True):
            chosen = [ious[ids[k]] for k in group]
            assert (row["iou_low"], row["iou_high"]) == (min(chosen), max(chosen))
    # Every synthetic semantic pair has a changed-object box: each is scored or counted.
    pointing = entry["pointing"]
    assert pointing["num_pairs"] + pointing["pairs_without_change_words"] == SMALL["num_test"]
    scored = [c["pointing"] for c in captions if "pointing" in c]
    assert len(scored) == pointing["num_pairs"]
    if scored:
        assert 0.0 <= pointing["pointing"] <= 100.0
    else:
        assert pointing["pointing"] is None and pointing["num_boxes"] == 0
