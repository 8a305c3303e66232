"""CLEVR-Change builder: official raw layout -> ArrayRecord -> grain, and its error cases."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from builder_helpers import (
    CLEVR_CHANGE_CAPTIONS,
    CLEVR_NO_CHANGE,
    build,
    clevr_change_raw,
    records,
    texts,
)
from conftest import shared_file

from changecap_jax.data import datasets
from changecap_jax.data.vocab import Vocabulary
from data_prep.builders.base import BuildError
from data_prep.builders.clevr_change import read_splits, read_type_mapping

TYPES = ["color", "material", "add", "drop", "move"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = clevr_change_raw(tmp_path_factory.mktemp("raw"), with_features=True)
    data_dir = tmp_path_factory.mktemp("data")
    return root, build("clevr_change", root, data_dir, features_dir=root / "features")


def test_round_trip_ids_captions_types_features(built):
    root, prepared = built
    assert prepared.meta.split_sizes == {"train": 3, "val": 1, "test": 1}
    assert prepared.meta.feature_shape == (14, 14, 1024)
    assert prepared.meta.skipped == {"images in neither splits.json nor type_mapping.json": 1}
    assert prepared.meta.has_distractor
    for split, ids in {"train": [0, 1, 2], "val": [3], "test": [4]}.items():
        recs = records(prepared, split)
        assert sorted(recs) == [f"{i:06d}.png" for i in ids]
        for i in ids:
            rec = recs[f"{i:06d}.png"]
            captions, ctype = CLEVR_CHANGE_CAPTIONS[i]
            assert int(rec["id"]) == i
            assert texts(rec["change_captions"]) == captions
            assert texts(rec["no_change_captions"]) == CLEVR_NO_CHANGE[: 1 + i % 3]
            assert prepared.meta.change_types[int(rec["change_type"])] == ctype
            expected_ids = prepared.vocab.encode_many(
                captions, prepared.meta.max_caption_len, allow_unk=split != "train")
            np.testing.assert_array_equal(rec["change_caption_ids"], expected_ids)
            if split == "train":
                assert [prepared.vocab.decode(r) for r in rec["change_caption_ids"]] == captions
            for key, fsub, prefix in (("before", "features", "default"),
                                      ("after_semantic", "sc_features", "semantic"),
                                      ("after_distractor", "nsc_features", "nonsemantic")):
                chw = np.load(root / "features" / fsub / f"CLEVR_{prefix}_{i:06d}.png.npy")
                assert rec[key].dtype == np.float32
                np.testing.assert_array_equal(rec[key], chw.transpose(1, 2, 0))


def test_vocabulary_and_length_follow_the_official_rules(built):
    _, prepared = built
    train = [c for i in (0, 1, 2) for c in CLEVR_CHANGE_CAPTIONS[i][0]]
    train += [c for i in (0, 1, 2) for c in CLEVR_NO_CHANGE[: 1 + i % 3]]
    assert prepared.vocab == Vocabulary.build(train)
    longest = max(len(c.split()) for caps, _ in CLEVR_CHANGE_CAPTIONS.values() for c in caps)
    assert prepared.meta.max_caption_len == longest + 2  # <START> ... <END>
    # A val/test word outside the train vocabulary becomes <UNK> (index 1).
    test_rec = records(prepared, "test")["000004.png"]
    assert 1 in test_rec["change_caption_ids"][0]  # "location" is not a train word


def test_trainer_pipeline_reads_the_dataset(built):
    from changecap_jax.data import pipeline

    _, prepared = built
    loader = pipeline.train_loader(prepared.split("train"), global_batch_size=2, seed=0)
    batch = next(iter(loader))
    assert batch["before"].shape == (2, 14, 14, 1024)
    assert batch["change_caption"].shape == (2, prepared.meta.max_caption_len)
    assert batch["no_change_caption"].shape == (2, prepared.meta.max_caption_len)


# (dtype, variant suffix, half a unit in the last place: relative, and absolute where
# float16 runs out of exponent, its subnormal step 2**-24)
@pytest.mark.parametrize("dtype, suffix, rtol, atol", [("float16", "_fp16", 2**-11, 2**-24),
                                                        ("bfloat16", "_bf16", 2**-8, 1e-38)])
def test_half_precision_variant_reads_back_in_half_the_bytes(built, tmp_path, dtype, suffix,
                                                             rtol, atol):
    from changecap_jax.data import schema

    root, full = built
    half = build("clevr_change", root, tmp_path, features_dir=root / "features",
                 feature_dtype=dtype)
    assert half.directory.parent.name == "layer3" + suffix
    assert (half.meta.feature_dtype, full.meta.feature_dtype) == (dtype, "float32")
    ratio = (schema.split_bytes(half.directory, "train")["record_bytes"]
             / schema.split_bytes(full.directory, "train")["record_bytes"])
    assert 0.45 < ratio < 0.55
    for split in ("train", "val"):
        low, ref = records(half, split), records(full, split)
        assert sorted(low) == sorted(ref)
        for image_id, rec in low.items():
            for key in ("before", "after_semantic", "after_distractor"):
                assert rec[key].dtype == np.dtype(schema.FEATURE_DTYPES[dtype])
                np.testing.assert_allclose(rec[key].astype(np.float32), ref[image_id][key],
                                           rtol=rtol, atol=atol, err_msg=f"{image_id} {key}")


def _broken(tmp_path: Path, edit) -> Path:
    root = clevr_change_raw(tmp_path / "raw")
    edit(root / "data")
    return root


def _rewrite(path: Path, fn) -> None:
    path.write_text(json.dumps(fn(json.loads(path.read_text()))))


@pytest.mark.parametrize("edit, message", [
    (lambda d: (d / "no_change_captions.json").unlink(), "no_change_captions.json"),
    (lambda d: (d / "sc_images" / "CLEVR_semantic_000002.png").unlink(),
     "CLEVR_semantic_000002.png"),
    (lambda d: _rewrite(d / "change_captions.json",
                        lambda c: {**c, "CLEVR_default_000005.png": ["a cube"]}),
     "CLEVR_default_000005.png"),
    (lambda d: _rewrite(d / "splits.json", lambda s: {**s, "test": [4, 5]}), "id 5"),
    (lambda d: _rewrite(d / "splits.json", lambda s: {**s, "val": [3, 0]}), "id 0"),
    (lambda d: _rewrite(d / "change_captions.json",
                        lambda c: {k: v for k, v in c.items() if not k.endswith("1.png")}),
     "CLEVR_default_000001.png"),
    (lambda d: _rewrite(d / "change_captions.json",
                        lambda c: {**c, "CLEVR_default_000002.png": [""]}), "empty caption"),
])
def test_bad_raw_data_stops_with_a_message_and_leaves_nothing(tmp_path, edit, message):
    root = _broken(tmp_path, edit)
    features = tmp_path / "features"
    features.mkdir()
    with pytest.raises(Exception, match=message) as info:
        build("clevr_change", root, tmp_path / "out", features_dir=features)
    assert isinstance(info.value, BuildError | ValueError)
    built_dirs = [p for p in (tmp_path / "out").rglob("dataset_info.json")]
    assert built_dirs == []
    assert not list((tmp_path / "out").rglob("*.array_record*"))


def test_feature_of_the_wrong_shape_names_file_and_shapes(tmp_path):
    root = clevr_change_raw(tmp_path / "raw", with_features=True)
    bad = root / "features" / "sc_features" / "CLEVR_semantic_000003.png.npy"
    np.save(bad, np.zeros((2048, 7, 7), np.float32))
    with pytest.raises(BuildError, match=r"CLEVR_semantic_000003.png.npy.*\(2048, 7, 7\).*"
                                         r"\(1024, 14, 14\)"):
        build("clevr_change", root, tmp_path / "out", features_dir=root / "features")
    assert not list((tmp_path / "out").rglob("dataset_info.json"))


def test_missing_feature_file_is_named(tmp_path):
    root = clevr_change_raw(tmp_path / "raw", with_features=True)
    shutil.rmtree(root / "features" / "nsc_features")
    with pytest.raises(BuildError, match="CLEVR_nonsemantic_000000.png"):
        build("clevr_change", root, tmp_path / "out", features_dir=root / "features")


def test_unbuilt_dataset_error_says_how_to_build(tmp_path):
    with pytest.raises(datasets.DatasetError, match="data_prep.build clevr_change"):
        datasets.prepare("clevr_change", tmp_path)


# ---------------------------------------------------------------------------------------------
# The real annotation files of ../shared/data


def test_real_splits_and_type_blocks():
    splits = read_splits(shared_file("clevr_change", "splits.json"))
    assert {k: len(v) for k, v in splits.items()} == {"train": 33830, "val": 1988, "test": 3985}
    types = read_type_mapping(shared_file("clevr_change", "type_mapping.json"))
    assert set(types) == {i for ids in splits.values() for i in ids}
    for i, t in types.items():
        assert TYPES[t] == ["color", "material", "add", "drop", "move"][i // 8000]
    counts = np.bincount(list(types.values()))
    assert counts.tolist() == [7958, 7963, 7966, 7961, 7955]
    assert 597 not in types and 857 not in types  # two of the 197 unannotated ids


def test_real_vocabulary_is_reproduced_by_the_builder_rules():
    official = json.loads(shared_file("clevr_change", "transformer_vocab.json").read_text())
    words = [w for w in official if not w.startswith("<")]
    # Captions whose train vocabulary is complete: the official rules give the same ids.
    rebuilt = Vocabulary.build([" ".join(words[i:i + 7]) for i in range(0, len(words), 7)])
    assert rebuilt.word_to_id == official


def test_build_command_line(tmp_path):
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    root = clevr_change_raw(tmp_path / "raw", with_features=True)
    env = {**os.environ, "PYTHONPATH": str(repo)}
    cmd = [sys.executable, "-m", "data_prep.build", "clevr_change", f"--raw_dir={root}",
           f"--features_dir={root / 'features'}", f"--data_dir={tmp_path / 'out'}"]
    done = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "dataset clevr_change (layer3) ready" in done.stdout
    assert "skipped 1: images in neither splits.json nor type_mapping.json" in done.stdout
    assert datasets.prepare("clevr_change", tmp_path / "out").meta.split_sizes["train"] == 3
    (root / "data" / "splits.json").unlink()
    cmd[-1] = f"--data_dir={tmp_path / 'out2'}"
    failed = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert failed.returncode != 0
    assert "error: missing split file" in failed.stderr and "splits.json" in failed.stderr
