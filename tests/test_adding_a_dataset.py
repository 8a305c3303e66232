"""A new dataset plugs in with one builder module and no edit to the library
(docs/adding_a_dataset.md): tests/example_dataset/tiny_pairs.py is built by the build command,
named as package.module:ClassName, then trained on by its name, the loss falling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from example_dataset.tiny_pairs import FEATURE_CHW

from changecap_jax import parallel
from changecap_jax.data import datasets
from changecap_jax.trainers import captioning

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from configs import common, subtraction  # noqa: E402

# Three kinds of change, each with its own feature pattern and caption.
CHANGES = [("the red cube moved", 0), ("a blue ball appeared", 1),
           ("the green cylinder is gone", 2)]


def _raw(tmp: Path) -> tuple[Path, Path]:
    raw, features = tmp / "raw", tmp / "features"
    raw.mkdir()
    features.mkdir()
    rng = np.random.default_rng(0)
    patterns = rng.standard_normal((len(CHANGES), *FEATURE_CHW)).astype(np.float32) * 2
    entries = {}
    for split, n in (("train", 24), ("val", 6), ("test", 6)):
        entries[split] = []
        for i in range(n):
            caption, kind = CHANGES[i % len(CHANGES)]
            before = rng.standard_normal(FEATURE_CHW).astype(np.float32)
            names = (f"{split}_{i}_a.png", f"{split}_{i}_b.png")
            for name, grid in zip(names, (before, before + patterns[kind]), strict=True):
                (raw / name).write_bytes(b"")  # present; the features are the .npy files
                np.save(features / f"{name}.npy", grid)
            entries[split].append({"before": names[0], "after": names[1], "captions": [caption]})
    (raw / "pairs.json").write_text(json.dumps(entries))
    return raw, features


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiny_pairs")
    raw, features = _raw(tmp)
    data_dir = tmp / "data"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-m", "data_prep.build", "example_dataset.tiny_pairs:TinyPairs",
         f"--raw_dir={raw}", f"--features_dir={features}", f"--data_dir={data_dir}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dataset tiny_pairs" in done.stdout and "ready in" in done.stdout
    return data_dir


def test_the_built_dataset_is_read_by_its_name(built):
    dataset = datasets.prepare("tiny_pairs", built, build_if_missing=False)
    assert dataset.meta.split_sizes == {"train": 24, "val": 6, "test": 6}
    c, h, w = FEATURE_CHW
    assert dataset.meta.feature_shape == (h, w, c)
    assert dataset.meta.extractor == "tiny_pairs_features"
    record = dataset.split("train")[1]
    assert record["before"].shape == (h, w, c)
    assert dataset.vocab.decode(record["change_caption_ids"][0]) == "a blue ball appeared"


def test_the_library_does_not_know_the_dataset():
    for path in (ROOT / "changecap_jax").rglob("*.py"):
        assert "tiny_pairs" not in path.read_text(), path


def test_a_model_trains_on_it(built, tmp_path):
    config = subtraction.get_config("synthetic")
    config.dataset = common.prebuilt_dataset("tiny_pairs")
    config.dataset.data_dir = str(built)
    config.model.update(hidden_dim=32, num_heads=2, word_dim=16, pairs="semantic_only")
    config.update(batch_size=8, eval_batch_size=6, num_train_steps=40, log_every_steps=10,
                  eval_every_steps=1000, checkpoint_every_steps=1000, eval_splits=(),
                  final_eval_splits=("test",), spice="off", difficulty_bins=0)
    config.optim.learning_rate = 2e-3
    trainer = captioning.Trainer(config, tmp_path / "run", mesh=parallel.make_mesh(1))
    results = trainer.train()
    losses = [metrics["loss"] for _, metrics in trainer.history]
    assert losses == sorted(losses, reverse=True) and losses[-1] < 0.7 * losses[0], losses
    assert np.isfinite(results["test"]["CIDEr"])


def test_a_run_configs_dataset_group_opens_it(built, tmp_path):
    group = {"name": "tiny_pairs", "data_dir": str(built), "variant": "", "options": {},
             "build_if_missing": False}
    assert datasets.prepare_config(group).directory == datasets.prepare(
        "tiny_pairs", built, build_if_missing=False).directory
    # data_dir given to the call wins over the group's (an exported model read elsewhere).
    with pytest.raises(datasets.DatasetError, match=str(tmp_path / "elsewhere")):
        datasets.prepare_config(group, data_dir=tmp_path / "elsewhere")
