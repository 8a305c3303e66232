"""IDC-PCL pretraining with a cross-task source (paper §2.4, appendix A.3;
changecap_jax/trainers/pretraining.py, changecap_jax/data/extra_source.py): the supervised
contrastive
loss against its definition in float64 NumPy, CUB pseudo pairs (a zero second image, never
masked by MVCL), the batch ratio, 8 devices = 1 for a step with a NABirds-layout source,
exact resume with an extra source, stage 1 -> stage 2 -> fine-tuning parameter transfer and
clear errors. Tiny sources come from test_cross_task_sources' official-layout fixtures with
seeded random grids (no ResNet).

Section numbers (§) and quirk ids (S-Q, D-Q, I-Q) refer to docs/official/ (see its README.md).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import jax
import ml_collections
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_cross_task_sources import COLOURS, CUB_IMAGES, cub_relative, write_cub, write_nabirds
from test_idc_pcl_pretrain import INTERRUPT, SEED, STEPS  # every task drawn in both halves
from train_helpers import SMALL, tiny_run

from changecap_jax import parallel
from changecap_jax.data import datasets, extra_source, negatives, pipeline
from changecap_jax.io import checkpoints, metric_writer
from changecap_jax.models import idc_pcl, idc_pcl_pretraining
from changecap_jax.models.base import INPUTS_FOLD
from changecap_jax.trainers import pretraining
from data_prep import cross_task as ct
from data_prep.methods import negative_mining

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from configs import idc_pcl as idc_config  # noqa: E402

GRID = SMALL["feature_shape"]  # (4, 4, 16): the IDC dataset's grids
TASKS = pretraining.TASKS


def random_grids(shape):
    """A feature function: a seeded normal grid per image file name."""
    def features(paths):
        return np.stack([np.random.default_rng(zlib.crc32(p.name.encode())).normal(
            size=shape).astype(np.float32) for p in paths])
    return features


def write_cub_one_colour_per_image(root: Path) -> Path:
    """The CUB fixture with one crown colour per image, so a Replace negative (another colour)
    is never one of the image's own captions (the shared fixture cycles every colour through
    every image's captions)."""
    raw = write_cub(root)
    for n in CUB_IMAGES:
        colour = COLOURS[n % len(COLOURS)]
        (raw / "text_c10" / Path(cub_relative(n)).with_suffix(".txt")).write_text("".join(
            f"image{n} bird has a {colour} crown, pose{k}.\n" for k in range(10)))
    return raw


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The SMALL synthetic IDC set, a CUB source (its grids and vocabulary) and a NABirds
    source ((2, 2, 16) grids: only the channels must match the model)."""
    root = tmp_path_factory.mktemp("cross_task")
    dataset = datasets.prepare("synthetic", root / "idc", "moderate", SMALL)
    made = negative_mining.generate(dataset, seed=0, pos="lexicon", splits=("train",))
    negative_mining.write_negatives(made.records["train"],
                                   negatives.negatives_path(dataset.directory, "train"))
    length = dataset.split("train")[0]["change_caption_ids"].shape[-1]
    cub = ct.build_source(ct.read_cub(write_cub_one_colour_per_image(root)), random_grids(GRID),
                          root / "sources" / "cub", vocab=dataset.vocab, max_len=length,
                          feature_dtype="float32", progress=False, negatives=True)
    nabirds = ct.build_source(ct.read_nabirds(write_nabirds(root)),
                              random_grids((2, 2, GRID[-1])), root / "sources" / "nabirds",
                              feature_dtype="float32", progress=False)
    return {"idc": str(root / "idc"), "cub": str(cub), "nabirds": str(nabirds),
            "vocab": dataset.vocab}


def tiny_config(data: dict, source: str, batch_size: int, **extra) -> ml_collections.ConfigDict:
    config = idc_config.get_config("pretrain")
    config.model.update(hidden_dim=16, num_heads=2, ffn_dim=32, cross_layers=1,
                        image_dim=GRID[-1])
    config = tiny_run(config, data["idc"], batch_size=batch_size, num_train_steps=STEPS,
                      checkpoint_every_steps=INTERRUPT, eval_every_steps=1000, seed=SEED)
    config.pretrain.update(tasks=TASKS if source == "cub" else ("mlm",),
                           fda_batch_size=8, val_batches=0)
    config.pretrain.extra_source.update(dir=data[source], **extra)
    return config


@pytest.fixture(scope="module")
def caption_trainer(data, tmp_path_factory):
    # 8 examples = 16 pairs per MLM/MVCL step and 4 pseudo pairs (of CUB's 6 train images) at
    # 4:1; FDA steps 8 pairs and 2 pseudo pairs, each with 6 negatives.
    return pretraining.PretrainTrainer(tiny_config(data, "cub", 8),
                                    tmp_path_factory.mktemp("cub_run"),
                                    mesh=parallel.make_mesh(1))


@pytest.fixture(scope="module")
def classify_trainer(data, tmp_path_factory):
    # 16 examples = 32 pairs per step and 8 NABirds pairs (a multiple of 8 devices) at 4:1.
    return pretraining.PretrainTrainer(tiny_config(data, "nabirds", 16, num_pairs=16),
                                    tmp_path_factory.mktemp("nabirds_run"),
                                    mesh=parallel.make_mesh(1))


def _on(mesh, state, step: int):
    return jax.device_put(state.replace(step=np.int32(step)), parallel.replicated(mesh))


# ---- the supervised contrastive loss ---------------------------------------------------------


def supcon_numpy(z: np.ndarray, labels: np.ndarray, temperature: float) -> float:
    """Khosla et al.'s L_out in float64, written from the definition: the mean over the anchors
    with a positive of -1/|P(i)| sum_p log(exp(s_ip / t) / sum_{a != i} exp(s_ia / t))."""
    z = z.astype(np.float64)
    z = z / np.linalg.norm(z, axis=1, keepdims=True)
    losses = []
    for i in range(len(z)):
        positives = [p for p in range(len(z)) if p != i and labels[p] == labels[i]]
        if not positives:
            continue
        denominator = sum(np.exp(z[i] @ z[a] / temperature) for a in range(len(z)) if a != i)
        losses.append(-np.mean([np.log(np.exp(z[i] @ z[p] / temperature) / denominator)
                                for p in positives]))
    return float(np.mean(losses))


def test_supervised_contrastive_loss_matches_its_definition():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(12, 5)).astype(np.float32)
    labels = np.array([0, 1, 0, 2, 1, 0, 3, 2, 1, 4, 0, 2])  # classes 3 and 4: no positive
    for temperature in (1.0, 0.3):
        rows, has = idc_pcl.supcon_row_losses(z, labels, np.arange(12), z, labels, temperature)
        got = float(np.sum(rows) / np.sum(has))
        assert np.sum(has) == 10
        assert got == pytest.approx(supcon_numpy(z, labels, temperature), rel=1e-6)
    # Anchors as a slice of the columns (one device's rows of a gathered batch).
    rows, has = idc_pcl.supcon_row_losses(z[4:8], labels[4:8], np.arange(4, 8), z, labels, 0.3)
    full, _ = idc_pcl.supcon_row_losses(z, labels, np.arange(12), z, labels, 0.3)
    np.testing.assert_allclose(rows, np.asarray(full)[4:8], rtol=1e-6)


def transfg_numpy(z: np.ndarray, labels: np.ndarray, margin: float) -> float:
    """TransFG's contrastive loss in float64 from its definition: 1/N^2 sum_i sum_j of
    1 - cos_ij for the same label, max(cos_ij - margin, 0) otherwise."""
    z = z.astype(np.float64)
    z = z / np.linalg.norm(z, axis=1, keepdims=True)
    total = 0.0
    for i in range(len(z)):
        for j in range(len(z)):
            cos = z[i] @ z[j]
            total += 1.0 - cos if labels[i] == labels[j] else max(cos - margin, 0.0)
    return total / len(z) ** 2


@pytest.mark.parametrize("kind", idc_pcl_pretraining.CONTRASTIVE_LOSSES)
def test_contrastive_loss_spans_the_global_batch(kind):
    """The loss (and its gradient) over 8 devices' shards = over one device = the definition."""
    rng = np.random.default_rng(1)
    z = rng.normal(size=(16, 6)).astype(np.float32)
    labels = rng.integers(0, 5, 16).astype(np.int32)
    settings = idc_pcl_pretraining.ClassifyLosses(contrastive=kind, temperature=0.5, margin=0.1)
    want = (supcon_numpy(z, labels, 0.5) if kind == "supcon" else transfg_numpy(z, labels, 0.1))
    axis = parallel.DATA_AXIS
    grads = []
    for devices in (1, 8):
        loss = jax.shard_map(functools.partial(idc_pcl_pretraining.global_contrastive, axis=axis,
                                               settings=settings),
                             mesh=parallel.make_mesh(devices), in_specs=(P(axis), P(axis)),
                             out_specs=P(), check_vma=False)
        value, grad = jax.jit(jax.value_and_grad(loss))(z, labels)
        assert float(value) == pytest.approx(want, rel=1e-6), devices
        grads.append(np.asarray(grad))
    assert np.abs(grads[0]).max() > 0
    np.testing.assert_allclose(grads[1], grads[0], atol=1e-6 * np.abs(grads[0]).max())


# ---- caption source: pseudo pairs ------------------------------------------------------------


def test_pseudo_pairs_have_a_zero_second_image_that_mvcl_never_masks(caption_trainer, data):
    source = extra_source.open_source(data["cub"])
    samples = caption_trainer.extra.samples
    grids = np.load(Path(data["cub"]) / "train.features.npy")
    for i in range(len(samples)):
        sample = samples[i]
        np.testing.assert_array_equal(sample["img1"], grids[i])
        assert sample["img2"].shape == GRID and not np.any(sample["img2"])
        assert len(sample["captions"]) == source.num_captions[i] == 10
    n, rows = GRID[0] * GRID[1], 4000
    keys = jax.random.split(jax.random.key(1), rows)
    draw = jax.jit(jax.vmap(functools.partial(idc_pcl_pretraining.region_mask, num_regions=n)))
    pseudo = np.arange(rows) % 2 == 0
    mask = np.asarray(draw(keys, real_only=pseudo))
    assert not mask[pseudo, n:].any() and mask[pseudo, :n].any(1).all()
    assert mask[~pseudo, n:].any(1).mean() == pytest.approx(0.5, abs=0.04)  # IDC rows as before
    np.testing.assert_array_equal(mask[~pseudo], np.asarray(draw(keys))[~pseudo])


def test_batches_follow_the_ratio(caption_trainer, classify_trainer):
    its = caption_trainer.iterators()
    for task, (pairs, extra) in (("mlm", (16, 4)), ("mvcl", (16, 4)), ("fda", (8, 2))):
        batch = caption_trainer.host_batch(task, its)
        assert batch["pseudo"].tolist() == [False] * pairs + [True] * extra, task
        assert batch["ids"].shape[0] == pairs + extra
        assert not np.any(batch["img2"][pairs:])
        assert np.all(np.any(batch["img2"][:pairs], (1, 2, 3)))
    assert batch["negatives"].shape == (10, 6, batch["ids"].shape[1])
    its = classify_trainer.iterators()
    batch = classify_trainer.host_batch("mlm", its)
    assert batch["ids"].shape[0] == 32
    assert {k: v.shape[0] for k, v in batch.items() if k.startswith("extra_")} == {
        f"extra_{k}": 8 for k in extra_source.CLASSIFY_FIELDS}
    assert batch["extra_img1"].shape[1:] == (2, 2, GRID[-1])
    np.testing.assert_array_equal(batch["extra_same"],
                                  batch["extra_label1"] == batch["extra_label2"])
    # The pairs: half of them from one class (A.3).
    assert classify_trainer.extra.samples.pairs[:, 2].tolist() == [1] * 8 + [0] * 8


def test_caption_source_fda_negatives_are_retrieve_and_replace(caption_trainer, data):
    """A.3: 6 negatives per CUB image, Retrieve and Replace only, none a caption of the image,
    joined to each pseudo pair and encoded as the IDC pairs' negatives."""
    path = negatives.negatives_path(data["cub"], "train")
    records = [json.loads(line) for line in path.read_text().splitlines()]
    source = extra_source.open_source(data["cub"])
    assert [r["image_id"] for r in records] == source.image_ids.tolist()
    kinds = [k for r in records for k in r["neg_kinds"]]
    assert {k.split("-")[0] for k in kinds} <= {"retrieve", "replace", "repeat"}
    assert "replace" in kinds and "retrieve" in kinds and not any("confuse" == k for k in kinds)
    for r in records:
        assert len(r["neg_samples"]) == 6 and not set(r["neg_samples"]) & set(r["sentences"])
    meta = json.loads((Path(data["cub"]) / "meta.json").read_text())
    assert meta["negatives"]["kinds"] == ["retrieve", "replace"]
    fda = caption_trainer.extra.fda_samples
    length = caption_trainer.samples("mlm", "train")[0]["captions"].shape[-1]
    for i in (0, 5):
        want = [data["vocab"].encode(t, length, allow_unk=True, truncate=True)
                for t in records[i]["neg_samples"]]
        np.testing.assert_array_equal(fda[i]["negatives"], np.stack(want))


def test_cli_writes_the_negatives(data, tmp_path):
    """The build command of docs/models.md: ``--negatives`` for CUB, refused for NABirds."""
    raw = write_cub_one_colour_per_image(tmp_path)
    source = ct.read_cub(raw)
    features = tmp_path / "features"
    grids = random_grids(GRID)([e.image_path for e in source.examples])
    for e, grid in zip(source.examples, grids, strict=True):
        path = features / f"{e.image_path.relative_to(raw / 'images')}.npy"
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, grid.transpose(2, 0, 1))
    data["vocab"].save(tmp_path / "vocab.json")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "data_prep.cross_task", f"--features_dir={features}",
               "--negatives"]
    done = subprocess.run([*command, "--source=cub", f"--raw_dir={raw}",
                           f"--vocab={tmp_path / 'vocab.json'}", f"--out={tmp_path / 'cub'}"],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    for split, images in (("train", 6), ("test", 2)):
        lines = negatives.load_negatives(negatives.negatives_path(tmp_path / "cub", split))
        assert len(lines) == images and {n.semantic for n in lines} == {True}
    assert json.loads((tmp_path / "cub" / "meta.json").read_text())["negatives"] == {
        "kinds": ["retrieve", "replace"], "per_kind": 3, "seed": 0}
    failed = subprocess.run([*command, "--source=nabirds", f"--raw_dir={write_nabirds(tmp_path)}",
                             f"--out={tmp_path / 'nab'}"], capture_output=True, text=True,
                            env=env, cwd=ROOT)
    assert failed.returncode != 0
    assert "error: FDA negatives are made for caption sources only" in failed.stderr
    assert not (tmp_path / "nab").exists()


# ---- classification source: 8 devices = 1 ----------------------------------------------------


@pytest.fixture(scope="module")
def classify_update(classify_trainer):
    """The 1-device MLM step with a classification source, returning the gradients too;
    compiled once for the 8 = 1 check and the runs below."""
    trainer = classify_trainer
    return pretraining.make_task_step(trainer.model, "mlm", trainer.optimizer, trainer.mesh,
                                   trainer.schedule, classify=trainer.extra.classify,
                                   with_grads=True)


def test_eight_devices_equal_one_with_a_classification_source(classify_trainer,
                                                               classify_update):
    trainer = classify_trainer
    assert jax.device_count() >= 8 and trainer.config.model.dropout_rate == 0.0
    assert trainer.model.fgvc_classes == 4  # NABirds fixture: 4 classes used
    initial = jax.device_get(trainer.init_state())
    host = trainer.host_batch("mlm", trainer.iterators())
    step = trainer.config.optim.warmup_steps
    eight = parallel.make_mesh(8)
    updates = {1: (trainer.mesh, classify_update),
               8: (eight, pretraining.make_task_step(
                   trainer.model, "mlm", trainer.optimizer, eight, trainer.schedule,
                   classify=trainer.extra.classify, with_grads=True))}
    results = []
    for mesh, update in updates.values():
        new, metrics, grads = update(_on(mesh, initial, step), pipeline.to_global(
            host, parallel.batch_sharding(mesh)))
        results.append(jax.device_get((new.params, grads, metrics)))
    (p1, g1, m1), (p8, g8, m8) = results
    for name in ("loss", "task_loss", "fgvc_classify", "fgvc_contrastive", "fgvc_match"):
        assert m1[name] > 0, name
        np.testing.assert_allclose(m8[name], m1[name], rtol=1e-5, err_msg=name)
    weights = trainer.extra.classify
    assert m1["loss"] == pytest.approx(m1["task_loss"] + weights.classify_weight
                                       * m1["fgvc_classify"] + weights.contrastive_weight
                                       * m1["fgvc_contrastive"] + weights.match_weight
                                       * m1["fgvc_match"], rel=1e-6)
    # The contrastive term (the default: TransFG's, A.3's citation) spans every image of the
    # global batch.
    assert weights.contrastive == "transfg"
    out = trainer.model.apply({"params": initial.params}, host["extra_img1"],  # eager: no
                              host["extra_img2"], method="cross_task_classify")  # compile
    labels = np.stack([host["extra_label1"], host["extra_label2"]], 1).reshape(-1)
    want = transfg_numpy(np.asarray(out.single).reshape(len(labels), -1), labels,
                         weights.margin)
    assert m8["fgvc_contrastive"] == pytest.approx(want, rel=1e-5)
    largest = max(np.abs(g).max() for g in jax.tree_util.tree_leaves(g1))
    compared = set()
    for (path, a1), a8, q1, q8 in zip(jax.tree_util.tree_leaves_with_path(g1),
                                      *(jax.tree_util.tree_leaves(t) for t in (g8, p1, p8)),
                                      strict=True):
        name = jax.tree_util.keystr(path)
        if np.abs(a1).max() < 1e-6 * largest:
            assert np.abs(a8).max() < 1e-6 * largest, name
            continue
        np.testing.assert_allclose(a8, a1, atol=1e-5 * np.abs(a1).max(), err_msg=name)
        real = np.abs(a1) > 1e-5 * largest
        np.testing.assert_allclose(q8[real], q1[real], atol=1e-5, err_msg=name)
        compared.add(path[0].key)
    assert {"fgvc_classifier", "fgvc_matcher", "single_img_encoder",
            "double_img_encoder", "encoder"} <= compared


# ---- caption source: an MVCL step with pseudo pairs ------------------------------------------


def mvcl_numpy(regressed, mask, true, empty) -> float:
    """§5.3 MVCL in float64 with A.3's pseudo pairs: each masked region's regression against
    the true features of every masked region and the regressions at every unmasked region
    that is not an empty image's; CE to its own target, mean over the masked regions."""
    def unit(x):  # as F.normalize: an empty image's zero features stay zero
        x = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
        return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    pred, true = unit(regressed), unit(true)
    mask, empty = np.asarray(mask).reshape(-1), np.asarray(empty).reshape(-1)
    losses = []
    for r in np.flatnonzero(mask):
        logits = np.concatenate([true[mask] @ pred[r], pred[~mask & ~empty] @ pred[r]])
        top = logits.max()
        losses.append(top + np.log(np.exp(logits - top).sum()) - pred[r] @ true[r])
    return float(np.mean(losses))


def test_mvcl_step_with_pseudo_pairs(caption_trainer):
    trainer, step = caption_trainer, 5
    host = trainer.host_batch("mvcl", trainer.iterators())
    initial = jax.device_get(trainer.init_state())
    _, metrics = trainer.task_steps["mvcl"](_on(trainer.mesh, initial, step),
                                            pipeline.to_global(host, trainer.data_sharding))
    samples, n = len(host["ids"]), GRID[0] * GRID[1]
    keys = idc_pcl_pretraining.sample_keys(jax.random.fold_in(jax.random.fold_in(initial.rng, step),
                                                   INPUTS_FOLD), np.arange(samples))
    mask = np.asarray(jax.vmap(functools.partial(idc_pcl_pretraining.region_mask, num_regions=n))(
        keys, real_only=host["pseudo"]))
    assert not mask[host["pseudo"], n:].any()
    t1, t2 = (host[k].reshape(samples, n, -1).astype(np.float32) for k in ("img1", "img2"))
    out = trainer.model.apply({"params": initial.params},  # eager: no compile
                              np.where(mask[:, :n, None], 0.0, t1).reshape(host["img1"].shape),
                              np.where(mask[:, n:, None], 0.0, t2).reshape(host["img2"].shape),
                              host["ids"], method="pretrain")
    empty = np.zeros_like(mask)
    empty[host["pseudo"], n:] = True
    true = np.concatenate([t1, t2], 1)
    want = mvcl_numpy(out.regressed, mask, true, empty)
    assert float(metrics["loss"]) == pytest.approx(want, rel=1e-5)
    # The empty images' regressions are left out: with them the loss differs.
    assert want != pytest.approx(mvcl_numpy(out.regressed, mask, true, np.zeros_like(mask)),
                                 rel=1e-4)


# ---- resume, stages --------------------------------------------------------------------------


def _sibling(trainer, workdir, steps: dict | None = None, **overrides):
    config = ml_collections.ConfigDict(trainer.config.to_dict())
    config.update(overrides)
    other = pretraining.PretrainTrainer(config, workdir, mesh=trainer.mesh)
    other.task_steps = steps or trainer.task_steps
    other.init_state = trainer.init_state
    return other


@pytest.fixture(scope="module")
def classify_run(classify_trainer, classify_update, tmp_path_factory):
    """An uninterrupted run with the classification source (the compiled step reused)."""
    steps = {"mlm": lambda state, batch: classify_update(state, batch)[:2]}
    run = _sibling(classify_trainer, tmp_path_factory.mktemp("full"), steps)
    run.train()
    return run, steps


def test_resume_continues_the_extra_stream_exactly(classify_trainer, classify_run, tmp_path):
    full, steps = classify_run
    _sibling(classify_trainer, tmp_path, steps, num_train_steps=INTERRUPT).train()
    saved = tmp_path / "checkpoints" / str(INTERRUPT)
    assert {"state", "data_mlm", "data_extra"} <= {p.name for p in saved.iterdir()}
    second = _sibling(classify_trainer, tmp_path, steps)
    second.train()
    assert [s for s, _ in second.history] == list(range(INTERRUPT + 1, STEPS + 1))
    for (step, got), (_, want) in zip(second.history, full.history[INTERRUPT:], strict=True):
        for timing in metric_writer.TIMING_SCALARS:
            got.pop(timing), want.pop(timing)
        assert "mlm/fgvc_contrastive" in got
        assert got == want, step  # bit-identical
    # Another seed gives other pairs: the comparison above can tell the streams apart.
    other = _sibling(classify_trainer, tmp_path / "other", steps,
                     seed=classify_trainer.config.seed + 1)
    assert not np.array_equal(next(other.iterators()["extra"])["img1"],
                              next(full.iterators()["extra"])["img1"])


def test_every_caption_stream_is_checkpointed(caption_trainer, tmp_path):
    """data_extra and data_extra_fda (the FDA pseudo pairs) restore where they were."""
    trainer = _sibling(caption_trainer, tmp_path)
    state = trainer.init_state()
    iterators = trainer.iterators()
    assert set(iterators) == {*TASKS, "extra", "extra_fda"}
    for task in ("mlm", "fda", "mvcl", "fda"):
        trainer.host_batch(task, iterators)
    manager = trainer.checkpoint_manager()
    trainer.save(manager, 4, state, iterators)
    manager.wait_until_finished()
    assert {"data_extra", "data_extra_fda"} <= {p.name for p in (tmp_path / "checkpoints" /
                                                                 "4").iterdir()}
    order = ("fda", "mlm", "fda", "mvcl")
    want = [trainer.host_batch(task, iterators) for task in order]
    restored = trainer.iterators()
    trainer.restore_all(manager, state, restored)
    for task, expected in zip(order, want, strict=True):
        got = trainer.host_batch(task, restored)
        assert got.keys() == expected.keys()
        for key in got:
            np.testing.assert_array_equal(got[key], expected[key], err_msg=f"{task} {key}")
    fresh = trainer.host_batch("fda", trainer.iterators())
    assert not np.array_equal(fresh["ids"], want[0]["ids"])  # a restart would differ


def test_stages_carry_parameters_over(caption_trainer, classify_trainer, classify_run,
                                      tmp_path):
    """init_from between pretraining runs copies every shared parameter, the pretraining
    heads included; heads the source lacks stay fresh; fine-tuning leaves the fgvc_ heads."""
    full, _ = classify_run
    trained = checkpoints.init_params_from(classify_trainer.init_state().params, full.workdir)
    fresh = caption_trainer.init_state().params
    carried = checkpoints.init_params_from(fresh, full.workdir,
                                     tuple(caption_trainer.config.init_exclude))
    assert tuple(caption_trainer.config.init_exclude) == ()
    for part in ("feat_regress", "pooler_0", "word_embedding", "encoder", "img_project_0"):
        for a, b in zip(jax.tree_util.tree_leaves(carried[part]),
                        jax.tree_util.tree_leaves(trained[part]), strict=True):
            np.testing.assert_array_equal(a, b)
    assert not np.array_equal(trained["encoder"]["norm"]["a_2"],
                              fresh["encoder"]["norm"]["a_2"])  # trained, not the init
    # A caption-source checkpoint (no fgvc_ heads) into a classification-source model.
    stage1 = _sibling(caption_trainer, tmp_path)
    manager = stage1.checkpoint_manager()
    stage1.save(manager, 1, caption_trainer.init_state(), stage1.iterators())
    manager.wait_until_finished()
    target = jax.tree.map(lambda x: x + 1.0, classify_trainer.init_state().params)
    stage2 = checkpoints.init_params_from(target, tmp_path)
    for part in ("fgvc_classifier", "fgvc_matcher", "encoder"):
        same = [np.array_equal(a, b) for a, b in zip(
            jax.tree_util.tree_leaves(stage2[part]), jax.tree_util.tree_leaves(target[part]),
            strict=True)]
        assert all(same) if part.startswith("fgvc_") else not any(same), part
    finetune = idc_config.get_config("finetune")
    assert "fgvc_" in finetune.init_exclude and "pooler" in finetune.init_exclude


# ---- errors ----------------------------------------------------------------------------------


def _error(config, tmp_path, mesh=None) -> str:
    with pytest.raises(pretraining.PretrainError) as err:
        pretraining.PretrainTrainer(config, tmp_path, mesh=mesh or parallel.make_mesh(1))
    return str(err.value)


def test_errors_name_the_file_and_key(data, tmp_path):
    missing = tmp_path / "nowhere"
    config = tiny_config(data, "cub", 8)
    config.pretrain.extra_source.dir = str(missing)
    assert f"{missing}: config.pretrain.extra_source.dir is not a directory" in _error(
        config, tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    config.pretrain.extra_source.dir = str(broken)
    assert f"{broken / 'meta.json'}: missing" in _error(config, tmp_path)
    meta = json.loads((Path(data["cub"]) / "meta.json").read_text())
    (broken / "meta.json").write_text(json.dumps({**meta, "task": "detect"}))
    assert "key 'task' is 'detect'" in _error(config, tmp_path)
    (broken / "meta.json").write_text(json.dumps(meta))
    assert f"{broken / 'train.features.npy'}: missing" in _error(config, tmp_path)
    config = tiny_config(data, "cub", 8, split="val")
    assert "key 'splits' has no split 'val'" in _error(config, tmp_path)
    no_negatives = tmp_path / "no_negatives"
    no_negatives.mkdir()
    for f in Path(data["cub"]).iterdir():
        if not f.name.endswith("_neg_tfidf6.json"):
            (no_negatives / f.name).write_bytes(f.read_bytes())
    config = tiny_config(data, "cub", 8)
    config.pretrain.extra_source.dir = str(no_negatives)
    message = _error(config, tmp_path)
    assert f"{no_negatives / 'train_neg_tfidf6.json'} does not exist" in message
    assert "--negatives" in message
    config.pretrain.tasks = ("mlm", "mvcl")  # without FDA no negatives are needed
    trainer = pretraining.PretrainTrainer(config, tmp_path, mesh=parallel.make_mesh(1))
    assert trainer.extra.fda_rows == 0 and trainer.extra_streams() == ("extra",)
    config = tiny_config(data, "cub", 8)
    config.pretrain.fda_batch_size = 6  # 6 / 4 pseudo pairs
    assert "give 1.5 extra rows" in _error(config, tmp_path)
    config = tiny_config(data, "cub", 8, ratio=(3, 1))  # 16 pairs -> 16/3 rows
    assert "ratio = (3, 1)" in _error(config, tmp_path)
    config = tiny_config(data, "nabirds", 8)  # 16 pairs -> 4 rows: not a multiple of 8
    assert "multiple of the 8 devices" in _error(config, tmp_path, parallel.make_mesh(8))
    config = tiny_config(data, "nabirds", 8, pooling="max")
    assert "extra_source.pooling = 'max'" in _error(config, tmp_path)
    nab_meta = json.loads((Path(data["nabirds"]) / "meta.json").read_text())
    wrong = tmp_path / "wrong_vocab"
    wrong.mkdir()
    for f in Path(data["cub"]).iterdir():
        (wrong / f.name).write_bytes(f.read_bytes())
    (wrong / "meta.json").write_text(json.dumps({**meta, "vocab_size": meta["vocab_size"] + 1}))
    config = tiny_config(data, "cub", 8)
    config.pretrain.extra_source.dir = str(wrong)
    assert f"{wrong / 'meta.json'}: key 'vocab_size'" in _error(config, tmp_path)
    assert nab_meta["task"] == "classify"
