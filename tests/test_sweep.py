"""``python -m changecap_jax sweep`` (changecap_jax/commands/sweep.py): a two-value sweep of a tiny
Subtraction model on the small synthetic set (one training step, the 10-pair test split),
its table, JSON and plot, a rerun that skips both values, and the one-line errors.

The commands run as subprocesses: the sweep's flags and changecap_jax.main's share names.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SMALL

from changecap_jax import cli
from changecap_jax.commands import sweep
from configs import subtraction

REPO = Path(__file__).resolve().parents[1]
PARAM = "model.decoder_layers"


def tiny_overrides(data_dir: Path) -> list[str]:
    """The SMALL dataset, a tiny model, one step, only the test split scored."""
    options = {k: v for k, v in SMALL.items() if k != "feature_shape"}
    return [f"--config.dataset.data_dir={data_dir}",
            *(f"--config.dataset.options.{k}={v}" for k, v in options.items()),
            "--config.dataset.options.feature_shape=({},{},{})".format(*SMALL["feature_shape"]),
            "--config.num_train_steps=1", "--config.batch_size=8", "--config.eval_batch_size=10",
            "--config.eval_splits=()", "--config.final_eval_splits=('test',)",
            "--config.spice=off", "--config.model.hidden_dim=16", "--config.model.num_heads=2",
            "--config.model.word_dim=8"]


def run_sweep(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # One device (the tiny batches need not split 8 ways); the -O0 flags of conftest kept.
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "device_count" not in f)
    env.update(JAX_PLATFORMS="cpu", CHANGECAP_COMPILATION_CACHE="0", PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "changecap_jax", "sweep", "--config=configs/subtraction.py", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_two_value_sweep_tables_plots_and_resumes(small_synthetic, tmp_path):
    out = tmp_path / "sweep"
    args = [f"--param={PARAM}", "--values=1,2", f"--workdir={out}",
            *tiny_overrides(small_synthetic.directory.parents[2])]
    done = run_sweep(args)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = _lines(done.stdout)
    assert [line.split()[0] for line in lines] == ["starting", "done", "starting", "done",
                                                    "wrote"], lines
    workdirs = [out / f"{PARAM}=1", out / f"{PARAM}=2"]
    summary = json.loads((out / "sweep.json").read_text())
    assert [row["value"] for row in summary["rows"]] == [1, 2]
    table = (out / "sweep.md").read_text()
    for workdir, row in zip(workdirs, summary["rows"], strict=True):
        metrics = json.loads((workdir / "metrics" / "test_1.json").read_text())
        assert row["metrics"] == {"CIDEr": metrics["CIDEr"]}  # the synthetic main metric
        assert row["workdir"] == str(workdir) and row["step"] == 1
        value = row["value"]
        assert f"| {value} | {metrics['CIDEr']:.2f} | 1 | {workdir} |" in table, table
        assert f"done {PARAM}={value} (" in done.stdout
        assert f"CIDEr {metrics['CIDEr']:.2f}" in done.stdout
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    logs = [(w / sweep.LOG_FILE).read_text() for w in workdirs]
    start = time.perf_counter()
    again = run_sweep(args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert time.perf_counter() - start < 30  # no JAX import, no training
    lines = _lines(again.stdout)
    assert [line.split()[:2] for line in lines[:2]] == [["skipped", f"{PARAM}=1"],
                                                        ["skipped", f"{PARAM}=2"]], lines
    assert lines[2].startswith("wrote ") and len(lines) == 3
    assert [(w / sweep.LOG_FILE).read_text() for w in workdirs] == logs  # nothing ran
    assert json.loads((out / "sweep.json").read_text()) == summary


@pytest.mark.parametrize("args, names", [
    ([f"--param={PARAM}", "--values=1,two"], ["'two'", PARAM, "int"]),
    (["--param=model.nope", "--values=1,2"], ["model.nope"]),
    (["--param=model.dropout_rate", "--values=0.1,high"], ["'high'", "model.dropout_rate",
                                                           "float"]),
    ([f"--param={PARAM}", "--values=1,2", "--split=train"], ["--split=train"]),
])
def test_bad_field_or_value_is_one_line_and_status_2(tmp_path, args, names):
    done = run_sweep([*args, f"--workdir={tmp_path}/sweep"])
    lines = _lines(done.stderr)
    assert done.returncode == cli.EXIT_USER_ERROR, done.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr[-3000:]
    for name in names:
        assert name in lines[0], lines[0]
    assert not (tmp_path / "sweep").exists()


def test_values_take_the_fields_type(tmp_path):
    config = subtraction.get_config("synthetic")
    variants = sweep.plan(config, "model.dropout_rate", ["0", "0.5", "1e-3"], tmp_path)
    assert [v.value for v in variants] == [0.0, 0.5, 0.001]
    assert [v.workdir.name for v in variants] == [
        "model.dropout_rate=0.0", "model.dropout_rate=0.5", "model.dropout_rate=0.001"]
    flags = sweep.plan(config, "model.use_coordinates", ["false", "True"], tmp_path)
    assert [v.value for v in flags] == [False, True]
    assert [v.text for v in sweep.plan(config, "model.fusion", ["concat"], tmp_path)] == [
        "concat"]
    with pytest.raises(sweep.SweepError, match="given twice"):
        sweep.plan(config, "model.dropout_rate", ["0.5", ".5"], tmp_path)
    with pytest.raises(sweep.SweepError, match="is a tuple"):
        sweep.plan(config, "final_eval_splits", ["test"], tmp_path)


@pytest.mark.parametrize("ended", [False, True])
def test_a_run_with_other_arguments_is_an_error(tmp_path, ended):
    variant = sweep.Variant(1, "1", tmp_path / f"{PARAM}=1")
    (variant.workdir / "metrics").mkdir(parents=True)
    (variant.workdir / "metrics" / "test_3.json").write_text('{"CIDEr": 1.0}')
    metrics_file = "metrics/test_3.json" if ended else None
    (variant.workdir / sweep.RECORD_FILE).write_text(json.dumps(
        {"args": ["--config=a.py"], "metrics_file": metrics_file}))
    # Started and not ended: run again (the trainer resumes); ended: skipped.
    assert sweep.finished(variant, ["--config=a.py"]) == (
        variant.workdir / "metrics/test_3.json" if ended else None)
    with pytest.raises(sweep.SweepError, match="other arguments"):
        sweep.finished(variant, ["--config=b.py"])


def test_a_group_metric_is_read_by_its_slash_path(tmp_path):
    path = tmp_path / "test_5.json"
    path.write_text(json.dumps({"CIDEr": 90.0, "router": {"change_accuracy": 75.0}}))
    assert sweep.metric_value(path, "router/change_accuracy") == 75.0
    assert sweep.metric_value(path, "CIDEr") == 90.0
    with pytest.raises(sweep.SweepError, match="it has CIDEr, router/..."):
        sweep.metric_value(path, "router/type_accuracy")
