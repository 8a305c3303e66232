"""The whole real-data path: raw images -> ResNet-101 features -> CLEVR-Change dataset ->
``python -m changecap_jax.main`` with the paper preset and ``--config.dataset.*`` overrides.

The raw images are the synthetic dataset's own ``raw/`` folder, which is in the CLEVR-Change
layout; the ResNet-101 has random weights (none can be downloaded here).

Marked slow (80 s; run with ``pytest -m slow``): its parts are covered in the default run by
extraction while building (test_builder_image_editing_request's --weights path), the
CLEVR-Change builder on feature files (test_builder_clevr_change), the presets
(test_configs) and training on a built dataset (test_train, test_predict_export).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from builder_helpers import build

from changecap_jax.data import datasets

pytestmark = [pytest.mark.torch, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[1]
TINY_SYNTHETIC = {"num_train": 8, "num_val": 2, "num_test": 2, "feature_shape": (4, 4, 16)}


def test_raw_images_through_resnet_to_a_training_step(tmp_path, random_weights):
    torch = pytest.importorskip("torch")
    synthetic = datasets.prepare("synthetic", tmp_path / "synthetic", "moderate", TINY_SYNTHETIC)
    raw = synthetic.directory / "raw"
    data_dir = tmp_path / "real"
    prepared = build("clevr_change", raw, data_dir, weights=random_weights, layer=3)

    assert prepared.meta.split_sizes == {"train": 8, "val": 2, "test": 2}
    assert prepared.meta.feature_shape == (14, 14, 1024)
    assert prepared.meta.extractor == "resnet101_layer3"
    # Same examples and captions as the synthetic source; features from the network.
    record = prepared.split("val")[0]
    source = {int(r["id"]): r for r in (synthetic.split("val")[i] for i in range(2))}
    assert list(record["change_captions"]) == list(source[int(record["id"])]["change_captions"])
    from changecap_jax.features.extract import extract_features
    from changecap_jax.features.resnet import load_resnet101

    model = load_resnet101(random_weights, 3, device=torch.device("cpu"))
    image = raw / "sc_images" / f"CLEVR_semantic_{int(record['id']):06d}.png"
    ((_, direct),) = list(extract_features([image], model, 3))
    np.testing.assert_allclose(record["after_semantic"], direct.transpose(1, 2, 0), atol=1e-5)

    workdir = tmp_path / "work"
    overrides = {
        "dataset.data_dir": str(data_dir), "model.hidden_dim": 32, "model.num_heads": 4,
        "model.word_dim": 16, "model.ffn_dim": 64, "model.mlp_hidden_dim": 64,
        "batch_size": 8, "eval_batch_size": 8, "num_train_steps": 2, "log_every_steps": 1,
        "eval_every_steps": 1000, "checkpoint_every_steps": 1000, "spice": "off",
    }
    cmd = [sys.executable, "-m", "changecap_jax.main", "--config=configs/dirl.py:clevr_change",
           f"--workdir={workdir}", "--config.final_eval_splits=val",
           *[f"--config.{k}={v}" for k, v in overrides.items()]]
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((workdir / "metrics" / "val_2.json").read_text())
    assert metrics["num_pairs"] == 4  # 2 val examples x (semantic, distractor)
    assert metrics["dataset"] == "clevr_change"
    assert "protocol: both pairs" in result.stderr
