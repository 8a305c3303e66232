"""IDC-PCL pretraining with a cross-task source (paper §2.4, appendix A.3;
changecap_jax/pretrain.py, changecap_jax/data/extra_source.py): the supervised contrastive
loss against its definition in float64 NumPy, CUB pseudo pairs (a zero second image, never
masked by MVCL), the batch ratio, 8 devices = 1 for a step with a NABirds-layout source,
exact resume with an extra source, stage 1 -> stage 2 -> fine-tuning parameter transfer and
clear errors. Tiny sources come from test_cross_task_sources' official-layout fixtures with
seeded random grids (no ResNet)."""

from __future__ import annotations

import functools
import json
import sys
import zlib
from pathlib import Path

import jax
import ml_collections
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_cross_task_sources import write_cub, write_nabirds
from train_helpers import SMALL, tiny_run

from changecap_jax import parallel, pretrain, train
from changecap_jax.data import datasets, extra_source, pipeline
from changecap_jax.models import idc_pcl
from data_prep import cross_task as ct

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from configs import idc_pcl as idc_config  # noqa: E402

GRID = SMALL["feature_shape"]  # (4, 4, 16): the IDC dataset's grids
TASKS = ("mlm", "mvcl")
STEPS, INTERRUPT = 4, 2


def random_grids(shape):
    """A feature function: a seeded normal grid per image file name."""
    def features(paths):
        return np.stack([np.random.default_rng(zlib.crc32(p.name.encode())).normal(
            size=shape).astype(np.float32) for p in paths])
    return features


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The SMALL synthetic IDC set, a CUB source (its grids and vocabulary) and a NABirds
    source ((2, 2, 16) grids: only the channels must match the model)."""
    root = tmp_path_factory.mktemp("cross_task")
    dataset = datasets.prepare("synthetic", root / "idc", "moderate", SMALL)
    length = dataset.split("train")[0]["change_caption_ids"].shape[-1]
    cub = ct.build_source(ct.read_cub(write_cub(root)), random_grids(GRID),
                          root / "sources" / "cub",
                          vocab=dataset.vocab, max_len=length, feature_dtype="float32",
                          progress=False)
    nabirds = ct.build_source(ct.read_nabirds(write_nabirds(root)),
                              random_grids((2, 2, GRID[-1])), root / "sources" / "nabirds",
                              feature_dtype="float32", progress=False)
    return {"idc": str(root / "idc"), "cub": str(cub), "nabirds": str(nabirds)}


def tiny_config(data: dict, source: str, batch_size: int, **extra) -> ml_collections.ConfigDict:
    config = idc_config.get_config("pretrain")
    config.model.update(hidden_dim=16, num_heads=2, ffn_dim=32, cross_layers=1,
                        image_dim=GRID[-1])
    config = tiny_run(config, data["idc"], batch_size=batch_size, num_train_steps=STEPS,
                      checkpoint_every_steps=INTERRUPT, eval_every_steps=1000)
    config.pretrain.update(tasks=TASKS, val_batches=0)
    config.pretrain.extra_source.update(dir=data[source], **extra)
    return config


@pytest.fixture(scope="module")
def caption_trainer(data, tmp_path_factory):
    # 8 examples = 16 pairs per step and 4 pseudo pairs (of CUB's 6 train images) at 4:1.
    return pretrain.PretrainTrainer(tiny_config(data, "cub", 8),
                                    tmp_path_factory.mktemp("cub_run"),
                                    mesh=parallel.make_mesh(1))


@pytest.fixture(scope="module")
def classify_trainer(data, tmp_path_factory):
    # 16 examples = 32 pairs per step and 8 NABirds pairs (a multiple of 8 devices) at 4:1.
    return pretrain.PretrainTrainer(tiny_config(data, "nabirds", 16, num_pairs=16),
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


@pytest.mark.parametrize("kind", pretrain.CONTRASTIVE_LOSSES)
def test_contrastive_loss_spans_the_global_batch(kind):
    """The loss (and its gradient) over 8 devices' shards = over one device = the definition."""
    rng = np.random.default_rng(1)
    z = rng.normal(size=(16, 6)).astype(np.float32)
    labels = rng.integers(0, 5, 16).astype(np.int32)
    settings = pretrain.ClassifyLosses(contrastive=kind, temperature=0.5, margin=0.1)
    want = (supcon_numpy(z, labels, 0.5) if kind == "supcon" else transfg_numpy(z, labels, 0.1))
    axis = parallel.DATA_AXIS
    grads = []
    for devices in (1, 8):
        loss = jax.shard_map(functools.partial(pretrain.global_contrastive, axis=axis,
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
    draw = jax.jit(jax.vmap(functools.partial(pretrain.region_mask, num_regions=n)))
    pseudo = np.arange(rows) % 2 == 0
    mask = np.asarray(draw(keys, real_only=pseudo))
    assert not mask[pseudo, n:].any() and mask[pseudo, :n].any(1).all()
    assert mask[~pseudo, n:].any(1).mean() == pytest.approx(0.5, abs=0.04)  # IDC rows as before
    np.testing.assert_array_equal(mask[~pseudo], np.asarray(draw(keys))[~pseudo])


def test_batches_follow_the_ratio(caption_trainer, classify_trainer):
    its = caption_trainer.iterators()
    for task in TASKS:
        batch = caption_trainer.host_batch(task, its)
        assert batch["ids"].shape[0] == 20 and batch["pseudo"].tolist() == [False] * 16 + [True] * 4
        assert not np.any(batch["img2"][16:]) and np.all(np.any(batch["img2"][:16], (1, 2, 3)))
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


# ---- classification source: 8 devices = 1 ----------------------------------------------------


def test_eight_devices_equal_one_with_a_classification_source(classify_trainer):
    trainer = classify_trainer
    assert jax.device_count() >= 8 and trainer.config.model.dropout_rate == 0.0
    assert trainer.model.fgvc_classes == 4  # NABirds fixture: 4 classes used
    initial = jax.device_get(trainer.init_state())
    host = trainer.host_batch("mlm", trainer.iterators())
    step = trainer.config.optim.warmup_steps
    results = []
    for devices in (1, 8):
        mesh = parallel.make_mesh(devices)
        update = pretrain.make_task_step(trainer.model, "mlm", trainer.optimizer, mesh,
                                         trainer.schedule, classify=trainer.extra.classify,
                                         with_grads=True)
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
    # The contrastive term is SupCon over every image of the global batch.
    out = trainer.model.apply({"params": initial.params}, host["extra_img1"],  # eager: no
                              host["extra_img2"], method="cross_task_classify")  # compile
    labels = np.stack([host["extra_label1"], host["extra_label2"]], 1).reshape(-1)
    want = supcon_numpy(np.asarray(out.single).reshape(len(labels), -1), labels, 1.0)
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


# ---- a run: resume, stages -------------------------------------------------------------------


def _sibling(trainer, workdir, **overrides):
    config = ml_collections.ConfigDict(trainer.config.to_dict())
    config.update(overrides)
    other = pretrain.PretrainTrainer(config, workdir, mesh=trainer.mesh)
    other.task_steps, other.task_losses = trainer.task_steps, trainer.task_losses
    other.init_state = trainer.init_state
    return other


def test_resume_continues_the_extra_stream_exactly(caption_trainer, classify_trainer,
                                                    tmp_path):
    full = _sibling(caption_trainer, tmp_path / "full")
    full.train()
    _sibling(caption_trainer, tmp_path / "resumed", num_train_steps=INTERRUPT).train()
    saved = tmp_path / "resumed" / "checkpoints" / str(INTERRUPT)
    assert {"state", "data_mlm", "data_mvcl", "data_extra"} <= {p.name for p in saved.iterdir()}
    second = _sibling(caption_trainer, tmp_path / "resumed")
    second.train()
    assert [s for s, _ in second.history] == list(range(INTERRUPT + 1, STEPS + 1))
    for (step, got), (_, want) in zip(second.history, full.history[INTERRUPT:], strict=True):
        got.pop("steps_per_second"), want.pop("steps_per_second")
        assert got == want, step  # bit-identical
    # A different extra stream would change the losses: the resumed stream is the real one.
    other = _sibling(caption_trainer, tmp_path / "other", seed=caption_trainer.config.seed + 1)
    its, want_its = other.iterators(), full.iterators()
    assert not np.array_equal(next(its["extra"])["img1"], next(want_its["extra"])["img1"])
    # Stage 2 from stage 1 (pretraining -> pretraining): everything carries over, the
    # pretraining heads included; the classification heads start fresh.
    fresh = classify_trainer.init_state().params
    stage2 = train.init_params_from(fresh, tmp_path / "full",
                                    tuple(classify_trainer.config.init_exclude))
    stage1 = full.init_state()  # the same init function: compare against the checkpoint
    restored = train.init_params_from(stage1.params, tmp_path / "full")
    for part in ("feat_regress", "pooler_0", "word_embedding", "encoder"):
        for a, b in zip(jax.tree_util.tree_leaves(stage2[part]),
                        jax.tree_util.tree_leaves(restored[part]), strict=True):
            np.testing.assert_array_equal(a, b)
    for part in ("fgvc_classifier", "fgvc_matcher"):
        for a, b in zip(jax.tree_util.tree_leaves(stage2[part]),
                        jax.tree_util.tree_leaves(fresh[part]), strict=True):
            np.testing.assert_array_equal(a, b)
    assert not np.array_equal(restored["encoder"]["norm"]["a_2"],
                              stage1.params["encoder"]["norm"]["a_2"])  # trained: not init
    finetune = idc_config.get_config("finetune")
    assert "fgvc_" in finetune.init_exclude and "pooler" in finetune.init_exclude


# ---- errors ----------------------------------------------------------------------------------


def _error(config, tmp_path, mesh=None) -> str:
    with pytest.raises(pretrain.PretrainError) as err:
        pretrain.PretrainTrainer(config, tmp_path, mesh=mesh or parallel.make_mesh(1))
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
    config = tiny_config(data, "cub", 8)
    config.pretrain.tasks = ("mlm", "fda")
    assert "caption source (task 'caption') in FDA is not supported yet" in _error(
        config, tmp_path)
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
