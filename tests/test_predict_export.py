"""Export (changecap_jax/commands/export.py), --mode=eval --model=DIR, and predict on raw image
pairs.

A tiny DIRL+CCR is trained briefly on the tiny synthetic dataset; its export must caption the
saved test images through ``predict`` exactly as ``--mode=eval`` captions the same pairs (the
feature path is the same), and loading must name what is wrong with a damaged export.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import flax
import numpy as np
import pytest
from PIL import Image
from train_helpers import tiny_config

from changecap_jax import exported_model, parallel
from changecap_jax.commands import export, localize, predict, report
from changecap_jax.data import datasets, image_files
from changecap_jax.io import metric_writer
from changecap_jax.trainers import captioning

ROOT = Path(__file__).resolve().parents[1]
STEPS = 300
# An 8 x 8 grid and enough data and steps that the model localizes (test_localization) and
# tells pairs apart (with 32 channels, a lossy projection of the grid extractor's 31
# statistics, it captioned every test pair alike); the tiny shared dataset's 4 x 4 grid is too
# coarse for that.
OPTIONS = {"num_train": 400, "num_val": 8, "num_test": 120, "feature_shape": (8, 8, 64)}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("predict")
    data_dir = tmp / "data"
    dataset = datasets.prepare("synthetic", data_dir, "moderate", OPTIONS)
    config = tiny_config(str(data_dir), num_train_steps=STEPS, batch_size=32,
                         final_eval_splits=("test",), spice="off", eval_batch_size=40,
                         log_every_steps=25)
    config.dataset.options = dict(OPTIONS)
    config.optim.learning_rate = 2e-3
    workdir = tmp / "workdir"
    # One device: several times faster a step than 8 simulated ones; sharding is not the point.
    captioning.Trainer(config, workdir, mesh=parallel.make_mesh(1)).train()
    model_dir = export.export_model(workdir, tmp / "exported")
    return dataset, config, workdir, model_dir


def _eval_captions(workdir: Path) -> dict[str, str]:
    entries = json.loads((workdir / "captions" / f"test_{STEPS}.json").read_text())
    return {e["image_id"]: e["caption"] for e in entries}


def test_export_contents(trained):
    dataset, config, workdir, model_dir = trained
    assert sorted(p.name for p in model_dir.iterdir()) == ["model.json", "params.msgpack",
                                                           "vocab.json"]
    loaded = exported_model.load_exported(model_dir)
    assert loaded.step == STEPS and loaded.vocab == dataset.vocab
    assert loaded.extractor == {"name": "synthetic_grid", "version": 2,
                                "feature_shape": list(dataset.meta.feature_shape),
                                "image_size": list(dataset.meta.image_size)}
    test_metrics = json.loads((workdir / "metrics" / f"test_{STEPS}.json").read_text())
    assert loaded.metrics["test"]["CIDEr"] == test_metrics["CIDEr"]
    # The parameters are the checkpoint's, bit for bit.
    trainer = captioning.Trainer(config, workdir, mesh=parallel.make_mesh(1))
    state = trainer.restore(trainer.checkpoint_manager(), trainer.init_state())
    ours = flax.traverse_util.flatten_dict(loaded.params)
    theirs = flax.traverse_util.flatten_dict(state.params)
    assert ours.keys() == theirs.keys()
    for k in ours:
        np.testing.assert_array_equal(ours[k], np.asarray(theirs[k]), err_msg=str(k))


def test_export_refuses_and_load_names_problems(trained, tmp_path):
    _, _, workdir, model_dir = trained
    with pytest.raises(exported_model.ExportError, match="is not empty"):
        export.export_model(workdir, model_dir)
    with pytest.raises(exported_model.ExportError, match="no checkpoint of step 7"):
        export.export_model(workdir, tmp_path / "x", step=7)
    # No training run there: the error says so and nothing is created.
    (tmp_path / "empty").mkdir()
    for name, message in (("absent", "does not exist"), ("empty", "holds no checkpoint")):
        with pytest.raises(exported_model.ExportError, match=message):
            export.export_model(tmp_path / name, tmp_path / "y")
        assert not (tmp_path / name / "checkpoints").exists() and not (tmp_path / "y").exists()

    def damaged(name: str, edit) -> Path:
        copy = tmp_path / name
        copy.mkdir()
        for f in model_dir.iterdir():
            (copy / f.name).write_bytes(f.read_bytes())
        edit(copy)
        return copy

    def newer(d: Path) -> None:
        desc = json.loads((d / "model.json").read_text())
        desc["format_version"] = exported_model.FORMAT_VERSION + 1
        (d / "model.json").write_text(json.dumps(desc))

    with pytest.raises(exported_model.ExportError, match="newer changecap_jax"):
        exported_model.load_exported(damaged("newer", newer))
    with pytest.raises(exported_model.ExportError, match="vocab.json is missing"):
        exported_model.load_exported(damaged("novocab", lambda d: (d / "vocab.json").unlink()))

    def reshape_param(d: Path) -> None:
        params = flax.serialization.msgpack_restore((d / "params.msgpack").read_bytes())
        flat = flax.traverse_util.flatten_dict(params)
        key = ("decoder", "logit", "bias")
        flat[key] = flat[key][:-1]
        del flat[("decoder", "logit", "kernel")]
        (d / "params.msgpack").write_bytes(flax.serialization.msgpack_serialize(
            flax.traverse_util.unflatten_dict(flat)))

    with pytest.raises(exported_model.ExportError) as info:
        exported_model.load_exported(damaged("reshaped", reshape_param))
    message = str(info.value)
    assert "missing parameter decoder/logit/kernel" in message
    assert "parameter decoder/logit/bias has shape" in message

    def other_model(d: Path) -> None:
        desc = json.loads((d / "model.json").read_text())
        desc["config"]["model"]["hidden_dim"] = 64
        (d / "model.json").write_text(json.dumps(desc))

    with pytest.raises(exported_model.ExportError, match="other parameters than the exported one"):
        exported_model.load_exported(damaged("other", other_model))


def _test_pairs(dataset) -> tuple[list, list[str]]:
    source = dataset.split("test")
    pairs, ids = [], []
    for i in range(len(source)):
        record = source[i]
        paths = image_files.image_paths(dataset, record)
        image_id = record["image_id"].decode()
        pairs += [(paths["before"], paths["after_semantic"]),
                  (paths["before"], paths["after_distractor"])]
        ids += [image_id, image_id + "_n"]
    return pairs, ids


def test_predict_equals_eval_and_features_match(trained, tmp_path):
    dataset, _, workdir, model_dir = trained
    pairs, ids = _test_pairs(dataset)
    # The extractor gives the stored features exactly.
    extractor = predict.FeatureExtractor(exported_model.load_exported(model_dir).extractor)
    record = dataset.split("test")[0]
    feats = extractor([pairs[0][0], pairs[0][1], pairs[1][1]])
    for got, key in zip(feats, ("before", "after_semantic", "after_distractor"), strict=True):
        np.testing.assert_array_equal(got, record[key].astype(np.float32))

    results = predict.predict_pairs(model_dir, pairs, tmp_path / "out", batch_size=40,
                                    progress=False)
    expected = _eval_captions(workdir)
    got = {image_id: r.caption for image_id, r in zip(ids, results, strict=True)}
    assert got == expected
    assert len(set(got.values())) >= 2, "degenerate model: the comparison would be vacuous"
    first = json.loads((tmp_path / "out" / "pair_0000.json").read_text())
    h, w, _ = dataset.meta.feature_shape
    assert first["grid"] == [h, w] and np.isclose(np.sum(first["heatmap_after"]), 1.0, atol=1e-4)
    assert [t["token"] for t in first["tokens"]][:-1] == first["caption"].split()
    assert all(t["log_prob"] <= 0 for t in first["tokens"])
    with Image.open(tmp_path / "out" / "pair_0000.png") as im:
        assert im.size[0] > im.size[1] > 256


def test_eval_of_exported_model(trained, tmp_path):
    _, _, workdir, model_dir = trained
    results = captioning.evaluate_exported(model_dir, tmp_path / "eval")
    original = json.loads((workdir / "metrics" / f"test_{STEPS}.json").read_text())
    assert results["test"]["CIDEr"] == pytest.approx(original["CIDEr"], abs=1e-9)
    assert _eval_captions(tmp_path / "eval") == _eval_captions(workdir)


def test_predict_command_line(trained, tmp_path):
    dataset, _, _, model_dir = trained
    pairs, _ = _test_pairs(dataset)
    before, after = pairs[0]
    # Another format and size than the training renders: read and resized by the extractor.
    jpeg = tmp_path / "after.jpg"
    with Image.open(after) as im:
        im.resize((173, 131)).save(jpeg, quality=90)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    args = [sys.executable, "-m", "changecap_jax.commands.predict", f"--model={model_dir}",
            f"--before={before}", f"--after={jpeg}", f"--out={tmp_path / 'cli'}",
            "--beam_size=3"]
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((tmp_path / "cli" / "pair_0000.json").read_text())
    assert record["beam_size"] == 3 and f"-> {jpeg}: {record['caption']}" in done.stdout
    assert "the pair's images differ in size" in done.stderr and "173x131" in done.stderr

    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not an image")
    args[5] = f"--after={broken}"
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and f"cannot read image {broken}" in done.stderr


def test_pairs_file_errors(tmp_path):
    bad = tmp_path / "pairs.csv"
    bad.write_text("before,after\na.png,b.png,c.png\n")
    with pytest.raises(predict.PredictError, match="line 2: expected 2 columns"):
        predict.read_pairs(bad)
    good = tmp_path / "good.csv"
    good.write_text("before,after\nx/a.png,/abs/b.png\n")
    assert predict.read_pairs(good) == [(tmp_path / "x/a.png", Path("/abs/b.png"))]
    with pytest.raises(predict.PredictError, match="does not exist"):
        predict.read_image(tmp_path / "missing.png")


def test_report_of_the_run_in_a_browser(trained, tmp_path):
    import test_report_html as page

    dataset, _, workdir, _ = trained
    # The line that ends a run names this report's command (the test split is its default).
    from changecap_jax import main as entry

    assert entry.closing_line(workdir) == (
        f"done: metrics {workdir}/metrics, captions {workdir}/captions, checkpoints "
        f"{workdir}/checkpoints; HTML report: python -m changecap_jax report --workdir={workdir}")
    out = report.build_report(workdir, "test", out=tmp_path / "report.html")
    html = out.read_text()
    root = page.parse(html)
    metrics = json.loads((workdir / "metrics" / f"test_{STEPS}.json").read_text())
    _, cells = page.metric_table(root)
    assert cells["total"]["C"] == f"{metrics['CIDEr']:.1f}"
    cards = page.cards(root)
    assert len(cards) == 2 * len(dataset.split("test"))  # semantic + distractor pairs
    ciders = [float(c.attrs["data-cider"]) for c in cards]
    assert ciders == sorted(ciders)
    # Per-pair CIDEr within the whole set averages to the table's total.
    assert np.mean(ciders) == pytest.approx(metrics["CIDEr"], abs=0.05 + 1e-6 * len(ciders))
    assert all(len(c.find_all("img")) == 2 for c in cards)
    assert "http://" not in html and "https://" not in html
    curves = report.read_curves(workdir / metric_writer.SCALARS_FILE)
    assert [s for s, _ in curves["loss"]] == list(range(25, STEPS + 1, 25))

    browser = page._browser()
    dom = page.parse(page._chromium(browser, tmp_path, "--dump-dom", out.as_uri()).stdout
                     .decode("utf-8"))
    _, rendered = page.metric_table(dom)
    assert rendered["total"]["C"] == cells["total"]["C"]
    assert any(s.find_all("polyline") for s in dom.iter("svg"))
    shown = page.cards(dom)
    assert shown and shown[0].find_all("img")
    shot = tmp_path / "report.png"
    page._chromium(browser, tmp_path, f"--screenshot={shot}", "--window-size=1200,1600",
                   out.as_uri())
    assert shot.stat().st_size > 10_000


def test_localization_beats_a_uniform_peak(trained):
    """The heatmap's peak falls inside the changed object's box far more often than a peak
    drawn uniformly over the grid would (test split, semantic pairs)."""
    _, _, _, model_dir = trained
    result = localize.measure(model_dir, "test", batch_size=40)["all"]
    hits = round(result.hit_rate * result.num_pairs)
    # Chance of at least this many hits from uniform peaks (binomial at the mean cell share).
    p = result.uniform_rate
    tail = sum(math.comb(result.num_pairs, k) * p**k * (1 - p) ** (result.num_pairs - k)
               for k in range(hits, result.num_pairs + 1))
    assert result.hit_rate >= 2 * result.uniform_rate and tail < 1e-3, (result, tail)
