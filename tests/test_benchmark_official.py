"""``python -m benchmarks.vs_pytorch --official``: the official training iteration timed
beside the jitted step, against the stand-in for the official checkouts that
tests/test_reproduce.py uses (the
project's torch reference laid out as tuyunbin/DIRL and tuyunbin/SCORER,
tests/torch_helpers/official_layout.py), at tiny sizes. With CHANGECAP_OFFICIAL_DIRL /
CHANGECAP_OFFICIAL_SCORER pointing at real checkouts, the benchmark runs against them too.

Checked: the timing and report (our ``configs`` package survives the import), that one timed
step is the official loss and an optimiser update (dropout on, as in official training), and
the errors for a model without official code, a config the official code cannot build as it
is, and a folder that is not a checkout."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torch_helpers import official_layout  # noqa: E402

from benchmarks import official_step as benchmark_official  # noqa: E402
from changecap_jax.commands import benchmark  # noqa: E402
from changecap_jax.commands import synthetic_inputs as si  # noqa: E402
from changecap_jax.commands.reproduce import official, run  # noqa: E402

pytestmark = pytest.mark.torch

TINY = dict(hidden_dim=16, num_heads=2, word_dim=8, encoder_layers=1, decoder_layers=1,
            mlp_hidden_dim=64, ffn_dim=64)  # the official MLP and FFN are 4 x hidden
SHAPES = si.InputShapes((4, 4, 6), 12, 7)
BATCH = 8  # the test processes see 8 CPU devices


def tiny_config(model: str = "dirl"):
    from configs import dirl, scorer

    config = {"dirl": dirl, "scorer": scorer}[model].get_config("clevr_change")
    config.model.update({k: v for k, v in TINY.items() if k in config.model})
    config.batch_size = config.eval_batch_size = BATCH
    return config


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    return official_layout.write_checkout(tmp_path_factory.mktemp("official") / "dirl", "dirl")


def test_benchmark_times_the_official_step(checkout):
    import configs

    results = benchmark.run(tiny_config(), steps=2, decode_batches=0, synthetic_inputs=True,
                            shapes=SHAPES, matmul_size=0,
                            comparisons=[benchmark_official.OfficialComparison(checkout)])
    assert results["official_steps"] == 2
    assert results["official_over_jax"] == pytest.approx(
        results["official_step_s"] / results["official_jax_step_s"])
    assert math.isfinite(results["official_loss_first_step"])
    assert results["official_repo"] == str(checkout.resolve())
    assert results["official_yaml"] == "configs/dynamic/transformer_clevr_change.yaml"
    lines = benchmark_official.official_lines(results)
    assert any(line.startswith("official step (tuyunbin/DIRL at ") for line in lines)
    assert sys.modules["configs"] is configs  # the project's, not the checkout's


def test_one_step_is_the_official_loss_then_an_update(checkout):
    config = tiny_config()
    setup = benchmark.synthetic_setup(config, SHAPES)
    step = benchmark_official.prepare(config, setup, checkout)
    assert all(m.training for m in step.model.modules.values())  # dropout on
    encoder = step.model.modules["change_detector"]
    before = {k: v.detach().clone() for k, v in encoder.state_dict().items()}

    torch.manual_seed(0)  # the same dropout masks for both computations
    with torch.no_grad(), official.cuda_is_identity():
        batch = run.torch_batch(step.batch, step.streams, step.model.spatial_info)
        by_hand = float(step.adapter.losses(step.model, batch)["total"])
    torch.manual_seed(0)
    assert step() == pytest.approx(by_hand, rel=1e-6)
    after = encoder.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the optimiser stepped


def test_errors(checkout, tmp_path):
    from configs import subtraction

    setup_config = tiny_config()
    setup = benchmark.synthetic_setup(setup_config, SHAPES)
    with pytest.raises(benchmark_official.OfficialError, match="not 'subtraction'"):
        benchmark_official.prepare(subtraction.get_config("clevr_change"), setup, checkout)
    wide = tiny_config()
    wide.model.mlp_hidden_dim = 32
    with pytest.raises(benchmark_official.OfficialError, match="model.mlp_hidden_dim 32 -> 64"):
        benchmark_official.prepare(wide, setup, checkout)
    with pytest.raises(benchmark_official.OfficialError,
                       match="not the expected official checkout: .* models/DIRL.py"):
        benchmark_official.prepare(setup_config, setup, tmp_path)


@pytest.mark.parametrize("model", ["dirl", "scorer"])
def test_real_official_checkout(model):
    """Against a real checkout: DIRL at tiny sizes; SCORER at the widths its CBR hard-codes
    (512 channels, 8 heads, 14x14 grid) with few feature channels."""
    checkout = official_layout.real_checkout(model)
    config, shapes = tiny_config(model), SHAPES
    if model == "scorer":
        config.model.update(hidden_dim=512, num_heads=8, word_dim=300)
        shapes = si.InputShapes((14, 14, 8), 12, 7)
    results = benchmark.run(config, steps=1, decode_batches=0, synthetic_inputs=True,
                            shapes=shapes, matmul_size=0,
                            comparisons=[benchmark_official.OfficialComparison(checkout)])
    assert results["official_step_s"] > 0 and math.isfinite(results["official_loss_first_step"])
