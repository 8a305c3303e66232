"""``python -m changecap_jax reproduce`` (changecap_jax/commands/reproduce/) against a stand-in for
the official checkouts: the project's torch reference (tools/torch_reference) laid out as
tuyunbin/DIRL and tuyunbin/SCORER (tests/torch_helpers/official_layout.py), at tiny sizes.
With CHANGECAP_OFFICIAL_DIRL / CHANGECAP_OFFICIAL_SCORER pointing at real checkouts, the same
comparison runs against them; with CHANGECAP_OFFICIAL_MEDIC, DIRL+MEDIC (VisualAIKHU/MEDIC) in
float64.

Checked: the losses, learning rates, gradient norms and parameters of both sides agree step by
step (DIRL from the built-in synthetic dataset through the input pipeline, with a decaying
StepLR; SCORER+CBR and DIRL's CLEVR-DC variant on random inputs), the outputs are written, our
``configs`` package survives the import of the official one, a learning rate changed on the
official side shows in the table, ``--precision=float64`` agrees to rounding with float64 on
both sides (and refuses a float32 part), and the command without a checkout exits 2 with one
line.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from conftest import SMALL  # noqa: E402
from torch_helpers import official_layout  # noqa: E402

from changecap_jax.commands.reproduce import official, report, run  # noqa: E402

pytestmark = pytest.mark.torch

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(hidden_dim=16, num_heads=2, word_dim=8, encoder_layers=1, decoder_layers=1)
RANDOM = dict(inputs="random", feature_shape=(4, 4, 6), vocab_size=12, caption_len=7)
EXACT = 2e-5  # float32 on both sides: measured <= 4e-6 relative


def tiny_config(model: str, preset: str):
    from configs import dirl, scorer

    config = {"dirl": dirl, "scorer": scorer}[model].get_config(preset)
    config.model.update(TINY)
    return config


@pytest.fixture(scope="module")
def checkouts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("official")
    return {m: official_layout.write_checkout(root / m, m) for m in ("dirl", "scorer")}


def check_agreement(result: run.Result, steps: int) -> None:
    assert [r["step"] for r in result.rows] == list(range(1, steps + 1))
    for name, value in result.summary["max_rel_diff"].items():
        assert value <= EXACT, (name, value, result.rows)
    assert result.summary["losses_within_tolerance"] and result.summary["lr_equal"]
    for row in result.rows:
        # Entries whose gradient is float noise (e.g. the DIRL MLP's first bias at a unit
        # active on every token: the z-score makes it analytically zero) step by +-lr at
        # random on each side; the rest agree closely (a 1.5x lr gives ~0.3 here).
        assert row["param_rel_l2_diff"] < 0.05, row
        assert row["param_max_abs_diff"] <= 2 * 2e-4 * row["step"], row
        assert row["total_official"] > 0 and row["grad_norm_official"] > 0


def test_dirl_dataset_inputs_and_step_lr(checkouts, small_synthetic, tmp_path):
    """DIRL (CLEVR-Change recipe) on the built-in synthetic set, a StepLR decaying every
    step on both sides; writes the table and the plot; our configs package stays ours."""
    import configs

    config = tiny_config("dirl", "clevr_change")
    config.dataset = tiny_config("dirl", "synthetic").dataset
    config.dataset.update(data_dir=str(small_synthetic.directory.parents[2]), options=SMALL)
    config.optim.decay_every_epochs = 1
    options = run.Options(checkouts["dirl"], steps=3, batch_size=2, steps_per_epoch=1,
                          official_cfg=("train.optim.step_size=1",))
    path_before = list(sys.path)
    result = run.compare(config, options)
    check_agreement(result, 3)
    assert [r["lr_official"] for r in result.rows] == pytest.approx([2e-4, 2e-5, 2e-6])
    assert result.settings["float_noise_params"]  # mlp_3 bias, key biases
    assert sys.modules["configs"] is configs and sys.path == path_before
    assert "config_transformer" not in dir(configs)

    paths = report.write_outputs(tmp_path / "out", result)
    with open(paths["csv"]) as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 3 and {"caption_official", "dirl_ours", "ccr_rel_diff",
                               "grad_norm_official", "param_max_abs_diff"} <= set(rows[0])
    saved = json.loads(paths["json"].read_text())
    assert saved["summary"]["losses_within_tolerance"] and saved["settings"]["model"] == "dirl"
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "every loss term agrees" in report.format_summary(result.summary)


def test_scorer_random_inputs(checkouts):
    """SCORER+CBR: sim and cbr terms, CBR frozen on both sides, logit scales clamped."""
    config = tiny_config("scorer", "clevr_change")
    config.model.encoder_layers = 2  # only the last layer's logit scale is trained and clamped
    result = run.compare(config, run.Options(checkouts["scorer"], steps=3, batch_size=2,
                                             **RANDOM))
    check_agreement(result, 3)
    assert {"sim_official", "cbr_ours", "caption_rel_diff"} <= set(result.rows[0])
    assert result.notes == ["model.dropout_rate 0.1 -> 0 (dropout off on both sides)"]


def test_a_different_learning_rate_shows(checkouts):
    """The CLEVR-DC variant with the official lr changed: step 1 (same weights, same batch)
    agrees, every later step differs, and the difference is named."""
    options = run.Options(checkouts["dirl"], steps=3, batch_size=2,
                          official_cfg=("train.optim.lr=0.0003",), **RANDOM)
    result = run.compare(tiny_config("dirl", "clevr_dc"), options)
    first, *later = result.rows
    assert first["total_rel_diff"] <= EXACT and first["lr_official"] == pytest.approx(3e-4)
    assert all(r["total_rel_diff"] > 1e-4 for r in later)
    assert not result.summary["losses_within_tolerance"] and not result.summary["lr_equal"]
    assert all(r["param_rel_l2_diff"] > 0.2 for r in result.rows), result.rows
    assert result.summary["first_step_outside_tolerance"] == 2
    terms = ("caption", "ccr", "dirl", "total")
    assert run.summarize(result.rows, terms, 1e-4, atol=100.0)["losses_within_tolerance"]
    assert any("learning_rate" in n and "0.0003" in n for n in result.notes), result.notes


def record_dtypes(monkeypatch) -> dict[str, set]:
    """Wraps both sides' step functions to record the dtypes each step really sees."""
    import jax

    seen: dict[str, set] = {"official": set(), "ours": set(), "default": set(), "x64": set()}
    official_step, ours_step = run.official_step, run.ours_step

    def official(side, batch):
        seen["official"].update(p.dtype for m in side.model.modules.values()
                                for p in m.parameters())
        seen["official"].update(t.dtype for pair in batch.pairs.values()
                                for t in (pair.after, pair.masks))
        seen["official"].add(batch.before.dtype)
        seen["default"].add(torch.get_default_dtype())
        return official_step(side, batch)

    def ours(side, batch):
        seen["ours"].update(str(x.dtype) for x in jax.tree.leaves((side.state.params, batch))
                            if x.dtype.kind == "f")
        seen["ours"].update(str(x.dtype) for x in jax.tree.leaves(side.state.opt_state)
                            if x.dtype.kind == "f")
        seen["x64"].add(bool(jax.config.jax_enable_x64))
        return ours_step(side, batch)

    monkeypatch.setattr(run, "official_step", official)
    monkeypatch.setattr(run, "ours_step", ours)
    return seen


@pytest.fixture
def x64_restored():
    """Whatever a failing float64 test leaves behind, the next test runs without x64 and with
    torch's float32 default (the flag is process-wide)."""
    import jax

    saved = jax.config.jax_enable_x64, torch.get_default_dtype()
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", saved[0])
        torch.set_default_dtype(saved[1])


def test_float64_agrees_to_rounding(checkouts, monkeypatch, x64_restored):
    """--precision=float64: the SCORER+CBR terms agree to 1e-9 (float32: up to 4e-6), every
    parameter, Adam moment, grid and mask is float64 on both sides, the lr is 2e-4 itself
    (float32: 2e-4 rounded), and neither x64 nor torch's default dtype outlives the run."""
    import jax

    seen = record_dtypes(monkeypatch)
    result = run.compare(tiny_config("scorer", "clevr_change"),
                         run.Options(checkouts["scorer"], steps=3, batch_size=2,
                                     precision="float64", **RANDOM))
    for name, value in result.summary["max_rel_diff"].items():
        assert value <= 1e-9, (name, value)
    assert all(r["param_max_abs_diff"] <= 1e-12 for r in result.rows), result.rows
    assert result.rows[0]["lr_ours"] == result.rows[0]["lr_official"] == 2e-4
    assert seen == {"official": {torch.float64}, "ours": {"float64"},
                    "default": {torch.float64}, "x64": {True}}, seen
    assert result.settings["precision"] == result.summary["precision"] == "float64"
    assert any("position_enc.pe" in n and "float64" in n for n in result.notes), result.notes
    assert not jax.config.jax_enable_x64 and torch.get_default_dtype() == torch.float32


def test_float64_refuses_float32_on_either_side(x64_restored):
    """A float64 tensor cast down on the official side, or a float64 value cast down in our
    step, is an error naming it; float32 runs are not checked; other precisions refused."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from changecap_jax.commands.reproduce import float64

    with pytest.raises(run.ReproduceError, match="float64: the official code computes float"):
        with float64.official_guard("float64"):
            torch.ones(2, dtype=torch.float64).float()
    with float64.official_guard("float32"):
        torch.ones(2, dtype=torch.float64).float()
    with jax.enable_x64(True):
        narrow = float64.jax_float32_values(lambda x: (x * 2).astype(jnp.float32) + 1,
                                            np.ones(3))
        assert narrow == ["convert_element_type -> float32[3]"]
        assert float64.jax_float32_values(lambda x: jnp.exp(x) + 1, np.ones(3)) == []
        table = np.linspace(0.0, 1.0, 3).astype(np.float32)  # a float32 constant in a jit
        assert float64.jax_float32_values(jax.jit(lambda x: x + table), np.ones(3)) == [
            "constant (3,) float32"]
    with pytest.raises(run.ReproduceError, match="--precision must be one of"):
        run.compare(tiny_config("dirl", "clevr_change"),
                    run.Options(Path("."), steps=1, precision="float16", **RANDOM))


def test_config_the_official_code_cannot_build(checkouts):
    config = tiny_config("scorer", "clevr_change")
    config.model.use_cbr = False
    with pytest.raises(run.ReproduceError, match="use_cbr"):
        run.compare(config, run.Options(checkouts["scorer"], steps=1, batch_size=2, **RANDOM))
    with pytest.raises(official.OfficialCheckoutError, match="lacks models/DIRL.py"):
        run.compare(tiny_config("dirl", "clevr_change"),
                    run.Options(checkouts["scorer"], steps=1, batch_size=2, **RANDOM))
    with pytest.raises(official.OfficialCheckoutError, match="is not a folder"):
        run.compare(tiny_config("dirl", "clevr_change"),
                    run.Options(checkouts["dirl"] / "absent", steps=1, **RANDOM))


def test_without_a_checkout_exits_2_with_one_line():
    done = subprocess.run(
        [sys.executable, "-m", "changecap_jax.commands.reproduce", "--config=configs/dirl.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--official_repo=PATH" in lines[0], lines
    assert done.stdout == ""


@pytest.mark.parametrize("model", ["dirl", "scorer"])
def test_real_official_checkout(model, tmp_path):
    """Against a real checkout: DIRL at tiny sizes; SCORER at the widths its CBR hard-codes
    (512 channels, 8 heads, 14x14 grid) with few feature channels."""
    checkout = official_layout.real_checkout(model)
    config = tiny_config(model, "clevr_change")
    shape = (4, 4, 6)
    if model == "scorer":
        config.model.update(hidden_dim=512, num_heads=8, word_dim=300)
        shape = (14, 14, 8)
    options = run.Options(Path(checkout), steps=2, batch_size=2,
                          **{**RANDOM, "feature_shape": shape})
    check_agreement(run.compare(config, options), 2)


@pytest.mark.parametrize(("preset", "steps"), [("clevr_change/medic", 5), ("clevr_dc/medic", 2)])
def test_dirl_medic_against_the_real_checkout(preset, steps, x64_restored):
    """DIRL+MEDIC (VisualAIKHU/MEDIC train/train_chg_final.py with both pairs and coordinates,
    train_dc_std_final.py with one pair) in float64 at tiny sizes (MEDIC's fixed 100 slots and
    512-channel classifiers): every term, MEDIC's four included, to 1e-9 and the parameters
    to 1e-12; on CLEVR-Change past step 4, where the router first sends pairs to the change
    experts (the type loss turns on: the step that parts the sides with torch 2's
    set-to-None zero_grad, docs/reproduce.md)."""
    checkout = official_layout.real_checkout("medic")
    config = tiny_config("dirl", preset)
    result = run.compare(config, run.Options(Path(checkout), steps=steps, batch_size=8,
                                             precision="float64", **RANDOM))
    for name, value in result.summary["max_rel_diff"].items():
        assert value <= 1e-9, (name, value)
    assert all(r["param_max_abs_diff"] <= 1e-12 for r in result.rows), result.rows
    assert result.summary["lr_equal"]
    if preset.startswith("clevr_change"):
        assert any(r["change_type_cls_official"] > 0 for r in result.rows), result.rows
    assert any("PolyLR" in n for n in result.notes), result.notes


# ---------------------------------------------------------------------------------------------
# IDC-PCL (yaolinli/IDC clver/finetune.py)
# ---------------------------------------------------------------------------------------------

IDC_TINY = dict(hidden_dim=16, num_heads=2, ffn_dim=32, cross_layers=1)


def idc_config(image_dim: int = 6):
    """The synthetic fine-tuning preset (CPU embedding balance included) at tiny widths."""
    from configs import idc_pcl

    config = idc_pcl.get_config("finetune")
    config.model.update(IDC_TINY, image_dim=image_dim)
    return config


@pytest.fixture(scope="module")
def idc_checkout(tmp_path_factory) -> Path:
    return official_layout.write_idc_checkout(tmp_path_factory.mktemp("idc"))


@pytest.mark.parametrize("precision, tolerance", [("float32", EXACT), ("float64", 1e-11)])
def test_idc_pcl_finetuning_step_by_step(idc_checkout, precision, tolerance):
    """Both sides see the masks our step draws (a wrong mask or a missed pair changes the
    summed MLM loss at step 1), the preset's feature scale and type-embedding std reach the
    official modules, and the official lr comes from --official_cfg through para.py."""
    options = run.Options(idc_checkout, steps=3, batch_size=2, official_cfg=("lr=0.0005",),
                          precision=precision, **RANDOM)
    result = run.compare(idc_config(), options)
    assert [r["step"] for r in result.rows] == [1, 2, 3]
    for name, value in result.summary["max_rel_diff"].items():
        assert value <= tolerance, (name, value)
    assert result.summary["lr_equal"] and result.rows[0]["lr_official"] == pytest.approx(5e-4)
    assert {"caption_official", "distractor_ours"} <= set(result.rows[0])
    assert all(r["param_rel_l2_diff"] < (0.05 if precision == "float32" else 1e-8)
               for r in result.rows), result.rows
    assert any("image_feature_scale = 16.0" in n for n in result.notes), result.notes
    if precision == "float64":
        return
    # --sides=official: the official modules alone see the same batches and masks (their
    # losses are the comparison's official column, to the bit).
    alone = run.compare(idc_config(), dataclasses.replace(options, sides="official"))
    assert [r["total_official"] for r in alone.rows] == [
        r["total_official"] for r in result.rows]
    assert "total_ours" not in alone.rows[0] and alone.summary["sides"] == "official"
    # The default (paper) lr of the json differs from the config's 5e-4: said, and shown.
    differing = run.compare(idc_config(), dataclasses.replace(options, official_cfg=(),
                                                              steps=2))
    assert differing.rows[0]["lr_official"] == pytest.approx(3e-5)
    assert any("learning_rate = 0.0005, official lr = 3e-05" in n for n in differing.notes)
    assert not differing.summary["losses_within_tolerance"]


def test_idc_pcl_refuses_what_the_official_script_cannot_train(idc_checkout):
    config = idc_config()
    config.model.distractor_judging = False
    with pytest.raises(run.ReproduceError, match="distractor_judging"):
        run.compare(config, run.Options(idc_checkout, steps=1, batch_size=2, **RANDOM))
    with pytest.raises(run.ReproduceError, match="para.py refused"):
        run.compare(idc_config(), run.Options(idc_checkout, steps=1, batch_size=2,
                                              official_cfg=("no_such_flag=1",), **RANDOM))


# IDC-PCL pretraining (yaolinli/IDC clver/pretrain.py)

PRETRAIN_CFG = ("lr=0.0005", "warmup_steps=100")  # the synthetic preset's lr and noam warm-up


def idc_pretrain_config(tasks: tuple[str, ...]):
    """The synthetic pretraining preset at tiny widths, training ``tasks``."""
    from configs import idc_pcl

    config = idc_pcl.get_config("pretrain")
    config.model.update(IDC_TINY, image_dim=6)
    config.pretrain.tasks = tasks
    config.pretrain.fda_batch_size = 4  # the 4 pairs of 2 examples
    return config


def test_idc_pcl_pretraining_step_by_step(idc_checkout, monkeypatch):
    """The three tasks in turn (seed 7 draws mvcl, mlm, fda), float64: both sides read our
    masks (MLM words, MVCL regions) and the same negatives (FDA), the noam lr from
    pretrain.py's json through para.py. Zeroing the official gradients in place (torch 1.9,
    the authors') is what keeps the heads a step's task does not reach equal; torch 2's
    set-to-None makes its Adam skip them, and the sides part at the first task switch."""
    from changecap_jax.commands.reproduce import idc_pretrain

    config = idc_pretrain_config(("mlm", "mvcl", "fda"))
    config.seed = 7
    options = run.Options(idc_checkout, steps=3, batch_size=2, official_cfg=PRETRAIN_CFG,
                          precision="float64", **RANDOM)
    result = run.compare(config, options)
    assert [r["task"] for r in result.rows] == ["mvcl", "mlm", "fda"]
    for task in ("mvcl", "mlm", "fda"):
        assert result.summary["by_task"][task]["max_rel_diff"] <= 1e-11, result.summary
    assert result.summary["max_rel_diff"]["grad_norm"] <= 1e-11, result.summary
    assert result.summary["lr_equal"] and result.rows[0]["lr_official"] == 1e-8
    assert all(r["param_max_abs_diff"] < 1e-13 for r in result.rows), result.rows

    monkeypatch.setattr(idc_pretrain.IdcPclPretrainAdapter, "zero_grads_in_place", False)
    torch2 = run.compare(config, dataclasses.replace(options, steps=2))
    assert torch2.rows[0]["param_max_abs_diff"] < 1e-13
    assert torch2.rows[1]["param_max_abs_diff"] > 1e-9, torch2.rows


def test_idc_pcl_pretraining_catches_a_wrong_official_loss(idc_checkout, monkeypatch):
    """A stand-in MVCL whose regions are one place off our mask shows at step 1."""
    from tools.torch_reference import idc_pcl as reference

    right = reference.mvcl_loss
    monkeypatch.setattr(reference, "mvcl_loss", lambda r, m, y: right(r, m.roll(1, 1), y))
    options = run.Options(idc_checkout, steps=1, batch_size=2, official_cfg=PRETRAIN_CFG,
                          **RANDOM)
    result = run.compare(idc_pretrain_config(("mvcl",)), options)
    assert not result.summary["losses_within_tolerance"], result.summary


def test_idc_pcl_pretraining_refuses_what_pretrain_py_cannot_train(idc_checkout):
    config = idc_pretrain_config(("mlm",))
    config.pretrain.extra_source.dir = "/nowhere"
    with pytest.raises(run.ReproduceError, match="cross-task source"):
        run.compare(config, run.Options(idc_checkout, steps=1, batch_size=2, **RANDOM))


def test_caption_spread_counts_a_collapse(tmp_path):
    from changecap_jax.commands.reproduce import evaluate

    path = tmp_path / "captions.json"
    path.write_text(json.dumps([{"caption": c} for c in ["a", "a", "a", "b"]]))
    spread = evaluate.caption_spread(path)
    assert spread == {"distinct_captions": 2, "top_caption": "a", "top_caption_share": 0.75}


def test_real_idc_checkout():
    """Against a real yaolinli/IDC checkout (its clver/ code), tiny sizes, float64."""
    checkout = official_layout.real_checkout("idc")
    options = run.Options(Path(checkout), steps=2, batch_size=2, official_cfg=("lr=0.0005",),
                          precision="float64", **RANDOM)
    result = run.compare(idc_config(), options)
    assert max(result.summary["max_rel_diff"].values()) <= 1e-11, result.summary
    assert result.summary["lr_equal"]
