"""The oracle retrieval (data_prep/oracle_entities.py): the right entities first for
semantic pairs, everything else as the source retrieval had it, in a linked dataset copy the
trainer can read."""

from __future__ import annotations

import itertools
import json
import shutil

import numpy as np
import pytest
from conftest import SMALL
from entity_helpers import write_retrieval

from changecap_jax.data import datasets, entity_inputs
from changecap_jax.data.synthetic import builder as synthetic_builder
from changecap_jax.data.synthetic import scenes
from data_prep import entity_recall, oracle_entities


def test_oracle_ids_put_true_entities_first_in_stored_order():
    stored = np.array([[4, 1, 2],    # true 1 ranked second, true 3 not ranked
                       [0, 5, 6],    # no true entity ranked; true 2 and 3 exist
                       [7, 8, 9]])   # no true entity at all
    relevant = np.zeros((3, 10), bool)
    relevant[0, [1, 3]] = True
    relevant[1, [3, 2]] = True
    got = oracle_entities.oracle_ids(stored, relevant)
    assert got.tolist() == [[1, 3, 4], [2, 3, 0], [7, 8, 9]]


def _source_with_every_attribute_text(small_synthetic, tmp_path):
    """A copy of the small synthetic set whose retrieval ranks texts naming every attribute
    combination at random: (source dataset, its root, the texts)."""
    root = tmp_path / "source"
    shutil.copytree(small_synthetic.directory.parents[1],
                    root / small_synthetic.directory.parents[1].name)
    source = datasets.prepare("synthetic", root, "moderate", SMALL, build_if_missing=False)
    # Entity texts that name every attribute combination: each changed object has one that
    # refers to it unless another object of its scene has the same attributes.
    texts = [" ".join(words) for words in itertools.product(
        [w[0] for w in scenes.SIZE_WORDS.values()], scenes.COLORS,
        [w[0] for w in scenes.MATERIAL_WORDS.values()],
        [w[0] for w in scenes.SHAPE_WORDS.values()])]
    write_retrieval(source, k=3, dim=4, num_entities=len(texts), seed=1)
    (source.directory / entity_inputs.RETRIEVAL_DIR / "texts.json").write_text(
        json.dumps(texts))
    return source, root, texts


def test_write_oracle_on_a_synthetic_copy(small_synthetic, tmp_path):
    source, root, texts = _source_with_every_attribute_text(small_synthetic, tmp_path)
    before = entity_inputs.load(source.directory)

    target = tmp_path / "oracle" / source.directory.relative_to(root)
    meta = oracle_entities.write_oracle(source, target)
    assert meta["backbone"] == "oracle"
    oracle = datasets.prepare("synthetic", tmp_path / "oracle", "moderate", SMALL,
                              build_if_missing=False)
    assert oracle.directory == target
    assert len(oracle.split("train")) == len(source.split("train"))
    after = entity_inputs.load(target)
    config = source.builder.builder_config
    hits = []
    for split in before.meta["splits"]:
        old, new = before.split(split), after.split(split)
        np.testing.assert_array_equal(old.record_ids, new.record_ids)
        for o in before.orientations:
            if o != "semantic":
                np.testing.assert_array_equal(old.ids[o], new.ids[o])
        for row, record_id in enumerate(new.record_ids):
            obj, scene = entity_recall.changed_object(
                synthetic_builder.make_example(config, int(record_id)))
            true = entity_recall.true_entities(texts, obj, scene)
            hits.append(bool(true[new.ids["semantic"][row, 0]]))
            assert hits[-1] == bool(true.any())
        coverage = meta["backbone_details"]["semantic_pairs_with_a_true_entity"][split]
        assert coverage == np.mean(hits[-len(new.record_ids):])
    assert np.mean(hits) > 0.8  # the texts name nearly every changed object
    # The source's retrieval is untouched.
    np.testing.assert_array_equal(entity_inputs.load(source.directory).split("train").ids[
        "semantic"], before.split("train").ids["semantic"])


def test_a_fraction_orders_that_share_of_the_semantic_pairs(small_synthetic, tmp_path):
    source, root, texts = _source_with_every_attribute_text(small_synthetic, tmp_path)
    before = entity_inputs.load(source.directory)
    full = oracle_entities.write_oracle(source, tmp_path / "full" / "d")
    half = oracle_entities.write_oracle(source, tmp_path / "half" / "d", fraction=0.5, seed=3)
    assert half["backbone_details"]["fraction"] == 0.5
    oracle_full = entity_inputs.load(tmp_path / "full" / "d")
    oracle_half = entity_inputs.load(tmp_path / "half" / "d")
    config = source.builder.builder_config
    for split_index, split in enumerate(before.meta["splits"]):
        old = before.split(split).ids["semantic"]
        new = oracle_half.split(split).ids["semantic"]
        chosen = oracle_entities.oracle_rows(len(old), 0.5, 3, split_index)
        assert chosen.sum() == round(0.5 * len(old))
        np.testing.assert_array_equal(new[~chosen], old[~chosen])
        np.testing.assert_array_equal(new[chosen],
                                      oracle_full.split(split).ids["semantic"][chosen])
        hits = []
        for row, record_id in enumerate(oracle_half.split(split).record_ids):
            obj, scene = entity_recall.changed_object(
                synthetic_builder.make_example(config, int(record_id)))
            hits.append(bool(entity_recall.true_entities(texts, obj, scene)[new[row]].any()))
        recall = half["backbone_details"]["semantic_pairs_with_a_true_entity"][split]
        assert recall == np.mean(hits)
        # Between the source's random ranking and the full oracle's.
        assert recall < full["backbone_details"]["semantic_pairs_with_a_true_entity"][split]
    # Another seed draws other rows.
    assert not np.array_equal(oracle_entities.oracle_rows(40, 0.5, 3, 0),
                              oracle_entities.oracle_rows(40, 0.5, 4, 0))


def test_a_fraction_outside_0_1_is_refused_before_anything_is_written(small_synthetic,
                                                                      tmp_path):
    source, _, _ = _source_with_every_attribute_text(small_synthetic, tmp_path)
    with pytest.raises(ValueError, match=r"oracle fraction must lie in \[0, 1\], got 1.5"):
        oracle_entities.write_oracle(source, tmp_path / "out" / "d", fraction=1.5)
    assert not (tmp_path / "out").exists()
