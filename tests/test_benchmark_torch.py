"""python -m benchmarks.vs_pytorch --torch (benchmarks/torch_step.py): the
torch reference's step beside the jitted step, at tiny sizes.

Both sides start from the same weights (the reference's, through the model's converter table)
and, without dropout, their first-step losses on the same batch agree to 1e-5: a wrong batch
conversion (layout, coordinate channels, caption targets) or a wrong size fails it. No timing is
asserted beyond its being a positive, finite number.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from conftest import SMALL  # noqa: E402

from benchmarks import torch_step  # noqa: E402
from changecap_jax.commands import benchmark  # noqa: E402
from changecap_jax.commands import synthetic_inputs as si  # noqa: E402
from configs import dirl, scorer, subtraction  # noqa: E402
from tools.torch_reference import TorchReferenceError  # noqa: E402

pytestmark = pytest.mark.torch

REPO = Path(__file__).resolve().parents[1]
BATCH = 8  # the test processes see 8 CPU devices (conftest.py)
SHAPES = si.InputShapes(feature_shape=(4, 4, 8), vocab_size=20, caption_len=8)
TINY = dict(hidden_dim=16, num_heads=2, word_dim=8, encoder_layers=1, decoder_layers=1)
KEYS = ("torch_step_s", "torch_over_jax", "torch_threads", "torch_loss_first_step",
        "torch_jax_step_s", "torch_device", "loss_first_step")


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def tiny(module, preset: str = "synthetic", **model):
    config = module.get_config(preset)
    config.model.update(TINY, **model)
    config.batch_size = config.eval_batch_size = BATCH
    return config


def compare(config) -> dict:
    return benchmark.run(config, steps=2, decode_batches=0, synthetic_inputs=True,
                         shapes=SHAPES, matmul_size=0,
                         comparisons=[torch_step.TorchComparison(threads=1)])


@pytest.mark.parametrize("module, model", [
    (dirl, dict(ffn_dim=16, mlp_hidden_dim=16)),  # both pairs, coordinates, CCR_no_init
    (scorer, {}),  # both pairs, coordinates, frozen CBR, logit-scale clamps
], ids=["dirl", "scorer"])
def test_same_first_loss_and_a_ratio(module, model):
    config = tiny(module, **model)
    assert config.model.dropout_rate == 0.0  # the synthetic presets: same losses on both sides
    results = compare(config)
    for key in KEYS:
        assert key in results, key
    assert results["torch_threads"] == 1 and results["torch_device"] == "cpu"
    for key in ("torch_step_s", "torch_jax_step_s", "torch_over_jax"):
        assert math.isfinite(results[key]) and results[key] > 0, key
    assert results["torch_loss_first_step"] == pytest.approx(results["loss_first_step"],
                                                             abs=1e-5)
    lines = torch_step.torch_lines(results)
    assert lines[0].startswith("torch reference: median ") and "(>1: JAX faster)" in lines[0]
    assert "; 1 torch thread on cpu (JAX " in lines[0]


def test_one_pair_variant_without_coordinates():
    """DIRL's CLEVR-DC decoder (LayerNorms, xavier) on the semantic pair, no AddSpatialInfo."""
    config = tiny(dirl, ffn_dim=16, mlp_hidden_dim=16, variant="clevr_dc",
                  pairs="semantic_only", use_coordinates=False)
    results = compare(config)
    assert results["torch_loss_first_step"] == pytest.approx(results["loss_first_step"],
                                                             abs=1e-5)


def test_a_model_without_a_reference_is_refused():
    with pytest.raises(TorchReferenceError, match=r"model 'subtraction' has no torch "
                       r"reference; models with one: \['dirl', 'scorer'\]"):
        compare(tiny(subtraction))


@pytest.mark.parametrize("preset, field", [
    ("synthetic/transformer", "use_dirl"), ("synthetic/tm", "matching")])
def test_an_ablation_the_reference_lacks_is_refused(preset, field):
    module = dirl if field == "use_dirl" else scorer
    with pytest.raises(TorchReferenceError, match=f"torch reference is the .*'{field}'"):
        compare(tiny(module, preset))


def test_other_gradient_rows_are_refused():
    config = tiny(dirl, ffn_dim=16, mlp_hidden_dim=16)
    config.optim.zero_grad_rows = {}
    with pytest.raises(TorchReferenceError, match="zero_grad_rows is {}"):
        compare(config)


def test_other_compute_dtypes_are_refused():
    config = tiny(dirl)
    config.compute_dtype = "bfloat16"
    with pytest.raises(TorchReferenceError, match="--config.compute_dtype=float32"):
        compare(config)


def test_missing_torch_is_one_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now fails
    with pytest.raises(TorchReferenceError, match="pip install -r requirements-torch.txt"):
        compare(tiny(dirl, ffn_dim=16, mlp_hidden_dim=16))


def test_the_benchmark_imports_neither_torch_nor_the_reference_without_the_flag():
    code = ("import sys, changecap_jax.commands.benchmark; "
            "print(sorted(m for m in sys.modules if m == 'torch' or 'torch_reference' in m "
            "or m == 'benchmarks.torch_step'))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_dataset_batches(small_synthetic):
    """Without --synthetic_inputs: the built synthetic dataset's batches (more fields than the
    reference reads), the model's vocabulary from the dataset."""
    config = tiny(dirl, ffn_dim=16, mlp_hidden_dim=16)
    config.dataset.data_dir = str(small_synthetic.directory.parents[2])
    config.dataset.options = dict(SMALL)
    results = benchmark.run(config, steps=1, decode_batches=0, matmul_size=0,
                            comparisons=[torch_step.TorchComparison(threads=1)])
    assert results["inputs"] == "dataset"
    assert results["torch_loss_first_step"] == pytest.approx(results["loss_first_step"],
                                                             abs=1e-5)


@pytest.mark.parametrize("module, model", [
    (dirl, dict(ffn_dim=16, mlp_hidden_dim=16)),
    (scorer, {}),
], ids=["dirl", "scorer"])
def test_greedy_decoding_from_the_same_weights_agrees(module, model):
    """After the train-step rounds (which moved both sides' weights) the decoding comparison
    starts both from the shared initial weights: the same captions and log-probabilities."""
    config = tiny(module, **model)
    results = benchmark.run(config, steps=2, decode_batches=2, synthetic_inputs=True,
                            shapes=SHAPES, matmul_size=0,
                            comparisons=[torch_step.TorchComparison(threads=1)])
    assert results["torch_decode_pairs"] == BATCH and results["torch_decode_rounds"] == 2
    assert results["torch_decode_same_captions"] == 1.0
    assert results["torch_decode_max_log_prob_diff"] < 1e-5
    assert math.isfinite(results["torch_decode_over_jax"]) and results["torch_decode_over_jax"] > 0
    lines = torch_step.torch_lines(results)
    assert lines[2].startswith("torch reference greedy decode: median ")
    assert "100.0% of the captions identical" in lines[3]
