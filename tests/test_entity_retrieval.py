"""CHEERS entity retrieval (paper §3.1.2): Eq. 1 and its constraint against NumPy written from
the text, both backbones end to end on a small synthetic dataset, and the errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import SMALL

from changecap_jax.data import datasets, entity_inputs
from data_prep import entities as entity_lib
from data_prep import retrieval


def eq1_reference(s_bef, s_aft, k, absolute):
    """Per pair, written from §3.1.2: entities with a similarity above that image's average
    similarity (either image) are candidates; argmax of S_bef - S_aft (or |.|) among them,
    repeated for the next best; then the others, as our documented fill rule."""
    out = []
    for sb, sa in zip(s_bef, s_aft, strict=True):
        score = [abs(b - a) if absolute else b - a for b, a in zip(sb, sa, strict=True)]
        ok = [sb[e] > sum(sb) / len(sb) or sa[e] > sum(sa) / len(sa) for e in range(len(sb))]
        ranked = sorted(range(len(sb)), key=lambda e: (not ok[e], -score[e], e))
        out.append(ranked[:k])
    return np.array(out)


@pytest.mark.parametrize("difference", ["signed", "absolute"])
def test_equation_1_with_the_above_average_constraint(difference):
    rng = np.random.default_rng(0)
    s_bef, s_aft = rng.uniform(-1, 1, (50, 20)), rng.uniform(-1, 1, (50, 20))
    ids, scores, constrained = retrieval.retrieve(s_bef, s_aft, 3, difference)
    np.testing.assert_array_equal(ids, eq1_reference(s_bef, s_aft, 3, difference == "absolute"))
    want = np.take_along_axis(s_bef - s_aft, ids, 1)
    if difference == "absolute":
        want = np.abs(want)
    np.testing.assert_allclose(scores, want, atol=1e-6)
    assert constrained.all()  # 20 random entities: always >= 3 above the mean


def test_constraint_excludes_the_top_scorer_and_fills_short_lists():
    # Entity 0 has the largest S_bef - S_aft but is below average in both images.
    s_bef = np.array([[-0.5, 0.9, 0.8, 0.7, 0.6]])
    s_aft = np.array([[-0.99, 0.8, 0.6, 0.65, 0.7]])
    ids, _, constrained = retrieval.retrieve(s_bef, s_aft, 3)
    assert 0 not in ids[0]
    np.testing.assert_array_equal(ids[0], [2, 1, 3])  # 0.2, 0.1, 0.05 among 1..4
    # Only one entity above average anywhere: it comes first, the rest are filled, flagged.
    s_bef = np.array([[0.0, 0.0, 0.0, 1.0]])
    s_aft = np.array([[0.0, 0.0, 0.0, 1.0]])
    ids, _, constrained = retrieval.retrieve(s_bef, s_aft, 3)
    assert ids[0, 0] == 3
    np.testing.assert_array_equal(constrained[0], [True, False, False])
    np.testing.assert_array_equal(ids[0, 1:], [0, 1])  # ties to the lower id


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("retrieval_data")
    ds = datasets.prepare("synthetic", root, "moderate", SMALL)
    entity_lib.extract_dataset_entities("synthetic", root, "moderate", SMALL, backend="rules")
    return ds


def test_contrastive_backbone_end_to_end(dataset):
    settings = retrieval.ContrastiveSettings(steps=200, batch_size=32, dim=16, hidden=32)
    meta = retrieval.run_retrieval(dataset, k=3, contrastive=settings, overwrite=True)
    inputs = entity_inputs.load(dataset.directory)
    assert inputs.embeddings.shape == (meta["num_entities"], 16)
    np.testing.assert_allclose(np.linalg.norm(inputs.embeddings, axis=1), 1.0, atol=1e-5)
    for split in ("train", "val", "test"):
        source = dataset.split(split)
        record_ids, ids = inputs.split_ids(split, len(source))
        assert list(record_ids) == [int(source[i]["id"]) for i in range(len(source))]
        assert set(ids) == set(entity_inputs.ORIENTATIONS)
        for a in ids.values():
            assert a.shape == (len(source), 3)
            assert all(len(set(row)) == 3 for row in a)
    # The model is trained on train: a consistent objective and ranking must fit it far above
    # chance (a sign or index mix-up between training and retrieval would not).
    train = meta["accuracy"]["train"]
    assert train["n"] > 0 and train["top3"] > 0.5 > 10 * meta["chance_top3"]
    with pytest.raises(FileExistsError, match="--overwrite"):
        retrieval.run_retrieval(dataset, contrastive=settings)


def test_missing_entity_list_names_the_command(tmp_path):
    ds = datasets.prepare("synthetic", tmp_path, "moderate", SMALL)
    with pytest.raises(FileNotFoundError, match="data_prep.entities"):
        retrieval.run_retrieval(ds)


def test_malformed_retrieval_files_are_named(dataset, tmp_path):
    import shutil

    retrieval.run_retrieval(dataset, overwrite=True, contrastive=retrieval.ContrastiveSettings(
        steps=5, dim=8, hidden=8))
    copy = tmp_path / "copy"
    shutil.copytree(dataset.directory / entity_inputs.RETRIEVAL_DIR,
                    copy / entity_inputs.RETRIEVAL_DIR)
    meta_path = copy / entity_inputs.RETRIEVAL_DIR / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["embedding_dim"] = 99
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(entity_inputs.EntityInputError, match="embeddings.npy"):
        entity_inputs.load(copy)
    inputs = entity_inputs.load(dataset.directory)
    with pytest.raises(entity_inputs.EntityInputError, match="record_ids"):
        inputs.split_ids("test", 99)


def _tiny_clip(path):
    """A randomly initialised CLIP with a character-level BPE tokenizer, saved offline."""
    transformers = pytest.importorskip(
        "transformers", reason="transformers is not installed (optional: pip install -r "
        "requirements-torch.txt)")
    import torch

    torch.manual_seed(0)
    chars = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = {t: i for i, t in enumerate(chars + [c + "</w>" for c in chars]
                                        + ["<|startoftext|>", "<|endoftext|>"])}
    (path / "vocab.json").write_text(json.dumps(vocab))
    (path / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = transformers.CLIPTokenizer(str(path / "vocab.json"), str(path / "merges.txt"))
    images = transformers.CLIPImageProcessor(size={"shortest_edge": 32},
                                             crop_size={"height": 32, "width": 32})
    transformers.CLIPProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(path)
    config = transformers.CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=40,
                         bos_token_id=vocab["<|startoftext|>"],
                         eos_token_id=vocab["<|endoftext|>"]),
        vision_config=dict(image_size=32, patch_size=8, hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2),
        projection_dim=12)
    transformers.CLIPModel(config).save_pretrained(path)
    return path


@pytest.mark.torch
def test_clip_backbone_end_to_end_and_resumable(dataset, tmp_path):
    clip = _tiny_clip(tmp_path)
    cache = dataset.directory / f"{entity_inputs.RETRIEVAL_DIR}.clip_cache"
    # An interrupted run leaves its embeddings so far in the cache ...
    with pytest.raises(KeyboardInterrupt):
        retrieval.run_retrieval(dataset, backbone="clip", clip_path=str(clip), overwrite=True,
                                clip_options={"batch_size": 8, "max_batches": 2})
    (partial_file,) = cache.glob("*.npz")  # the first image field of the first split
    with np.load(partial_file) as partial:
        assert len(partial["embeddings"]) == 16
    # ... which a rerun continues from; the result equals a run from scratch.
    meta = retrieval.run_retrieval(dataset, backbone="clip", clip_path=str(clip),
                                   overwrite=True, clip_options={"batch_size": 8})
    resumed = {s: dict(np.load(dataset.directory / entity_inputs.RETRIEVAL_DIR / f"{s}.npz"))
               for s in ("train", "test")}
    assert not cache.exists()  # spent once the result is written
    retrieval.run_retrieval(dataset, backbone="clip", clip_path=str(clip), overwrite=True,
                            clip_options={"batch_size": 8})
    for split, arrays in resumed.items():
        fresh = np.load(dataset.directory / entity_inputs.RETRIEVAL_DIR / f"{split}.npz")
        for key in arrays:
            np.testing.assert_allclose(fresh[key], arrays[key], atol=1e-5, err_msg=key)
    assert meta["backbone"] == "clip" and meta["embedding_dim"] == 12
    inputs = entity_inputs.load(dataset.directory)
    assert inputs.split_ids("test", len(dataset.split("test")))[1]["semantic"].shape[1] == 3
