"""IDC-PCL pretraining (changecap_jax/trainers/pretraining.py; reference §5.1, §5.3, §5.6): each
task's
step loss equals the single-device loss functions of models/idc_pcl.py (checked against torch
in test_idc_pcl_model.py) on the same masked inputs, 8 devices equal 1 for an MVCL step, the
seeded task draw, exact resume of every task's stream, the FDA batch layout, the presets,
clear errors and the entry point. One 1-device trainer (module fixture) compiles each task's
step once for the whole file.

Section numbers (§) and quirk ids (S-Q, D-Q, I-Q) refer to docs/official/ (see its README.md).
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest
from train_helpers import SMALL, tiny_run

from changecap_jax import models, parallel
from changecap_jax.data import datasets, negatives, pipeline
from changecap_jax.data.pretrain_samples import PairSamples
from changecap_jax.io import checkpoints, metric_writer
from changecap_jax.models import base, idc_pcl, idc_pcl_pretraining
from changecap_jax.trainers import pretraining
from data_prep.methods import negative_mining

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from configs import idc_pcl as idc_config  # noqa: E402

TASKS = pretraining.TASKS
OFFICIAL_RATIO = (8, 1, 2)
STEPS, INTERRUPT = 6, 3  # the resume test: 6 steps straight, or 3 + a restart


def _seed_with_every_task_in_both_halves() -> int:
    """A seed whose draws for steps 1-3 and 4-6 each hold all three tasks (at 8:1:2), so the
    resume test restores every task's stream in mid-run."""
    p = pretraining.task_probabilities(TASKS, OFFICIAL_RATIO)
    for seed in range(10_000):
        draws = [pretraining.draw_task(seed, t, TASKS, p) for t in range(1, STEPS + 1)]
        if set(draws[:INTERRUPT]) == set(draws[INTERRUPT:]) == set(TASKS):
            return seed
    raise AssertionError("no such seed")


SEED = _seed_with_every_task_in_both_halves()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """The SMALL synthetic set with hard negatives for train and val (not test)."""
    root = tmp_path_factory.mktemp("pretrain_data")
    dataset = datasets.prepare("synthetic", root, "moderate", SMALL)
    made = negative_mining.generate(dataset, seed=0, pos="lexicon", splits=("train", "val"))
    for split, records in made.records.items():
        negative_mining.write_negatives(records, negatives.negatives_path(dataset.directory,
                                                                         split))
    return str(root)


def tiny_pretrain(data_dir: str, **overrides) -> ml_collections.ConfigDict:
    config = idc_config.get_config("pretrain")
    config.model.update(hidden_dim=16, num_heads=2, ffn_dim=32, cross_layers=1,
                        image_dim=SMALL["feature_shape"][-1])
    config = tiny_run(config, data_dir, batch_size=8, num_train_steps=STEPS, seed=SEED,
                      checkpoint_every_steps=INTERRUPT, eval_every_steps=INTERRUPT)
    config.pretrain.update(fda_batch_size=8, val_batches=1)
    config.update(overrides)
    return config


@pytest.fixture(scope="module")
def trainer(data_dir, tmp_path_factory):
    return pretraining.PretrainTrainer(tiny_pretrain(data_dir), tmp_path_factory.mktemp("one"),
                                    mesh=parallel.make_mesh(1))


@pytest.fixture(scope="module")
def initial(trainer):
    """The initial state on the host (each use puts a fresh copy on the devices: steps
    donate their input state)."""
    return jax.device_get(trainer.init_state())


def _on(mesh, state, step: int):
    return jax.device_put(state.replace(step=np.int32(step)), parallel.replicated(mesh))


def _sibling(trainer, workdir, **overrides):
    """Another trainer of the same run (fresh data streams and state) that reuses
    ``trainer``'s compiled steps."""
    config = ml_collections.ConfigDict(trainer.config.to_dict())
    config.update(overrides)
    other = pretraining.PretrainTrainer(config, workdir, mesh=trainer.mesh)
    other.task_steps, other.task_losses = trainer.task_steps, trainer.task_losses
    other.init_state = trainer.init_state
    return other


@pytest.fixture(scope="module")
def forward(trainer):
    """The model's pretraining forward, jitted once (a compile per batch shape)."""
    return jax.jit(functools.partial(trainer.model.apply, method="pretrain"))


# ---- §5.1 inputs -----------------------------------------------------------------------------


def test_region_mask_follows_section_5_1():
    n, rows = 49, 20_000
    keys = jax.random.split(jax.random.key(0), rows)
    mask = np.asarray(jax.jit(jax.vmap(functools.partial(idc_pcl_pretraining.region_mask,
                                                         num_regions=n)))(keys))
    on1, on2 = mask[:, :n].any(1), mask[:, n:].any(1)
    assert np.all(on1 ^ on2)  # at least one region, on one image only
    assert on1.mean() == pytest.approx(0.5, abs=0.015)
    region = np.where(on1[:, None], mask[:, :n], mask[:, n:])
    assert region.mean() == pytest.approx(0.15 + 0.85 ** n / n, abs=0.003)


def test_samples_are_the_pairs_of_each_record(trainer):
    source = trainer.dataset.split("train")
    both = PairSamples(source, ("semantic", "distractor"))
    assert len(both) == 2 * len(source)
    record = source[3]
    semantic, distractor = both[6], both[7]
    np.testing.assert_array_equal(semantic["img1"], record["before"])
    np.testing.assert_array_equal(semantic["img2"], record["after_semantic"])
    np.testing.assert_array_equal(semantic["captions"], record["change_caption_ids"])
    np.testing.assert_array_equal(distractor["img1"], record["before"])
    np.testing.assert_array_equal(distractor["img2"], record["after_distractor"])
    np.testing.assert_array_equal(distractor["captions"], record["no_change_caption_ids"])
    only = PairSamples(source, ("semantic",))  # e.g. Birds-to-Words
    assert len(only) == len(source)
    np.testing.assert_array_equal(only[3]["img2"], record["after_semantic"])


# ---- each task's step loss against the single-device functions --------------------------------


@pytest.mark.parametrize("task", TASKS)
def test_step_loss_equals_the_single_device_function(trainer, initial, forward, task):
    step = 5  # the step number seeds the masks: fold_in(rng, step), then INPUTS_FOLD
    host = next(iter(trainer.task_loader(task)))
    _, metrics = trainer.task_steps[task](_on(trainer.mesh, initial, step),
                                          pipeline.to_global(host, trainer.data_sharding))
    model, params = trainer.model, {"params": initial.params}
    samples = len(host["ids"])
    assert samples == trainer.batch_sizes[task]
    keys = idc_pcl_pretraining.sample_keys(jax.random.fold_in(jax.random.fold_in(initial.rng, step),
                                                   base.INPUTS_FOLD), jnp.arange(samples))
    img1, img2 = host["img1"].astype(np.float32), host["img2"].astype(np.float32)
    ids = host["ids"]
    if task == "mlm":
        masked, labels = jax.vmap(functools.partial(
            idc_pcl.mask_caption, eos_id=model.eos_id, mask_id=model.mask_token,
            num_tokens=model.num_tokens))(keys, jnp.asarray(ids))
        assert np.any(np.asarray(masked) != ids)
        out = forward(params, img1, img2, masked)
        want = idc_pcl_pretraining.on_one_device(idc_pcl_pretraining.mlm_metrics,
                                                  out.mlm_logits, labels)["loss"]
    elif task == "mvcl":
        t1, t2 = img1.reshape(samples, -1, 16), img2.reshape(samples, -1, 16)
        n = t1.shape[1]
        region_mask = functools.partial(idc_pcl_pretraining.region_mask, num_regions=n)
        mask = np.asarray(jax.vmap(region_mask)(keys))
        out = forward(params, np.where(mask[:, :n, None], 0.0, t1).reshape(img1.shape),
                      np.where(mask[:, n:, None], 0.0, t2).reshape(img2.shape), ids)
        want = idc_pcl_pretraining.on_one_device(idc_pcl_pretraining.mvcl_metrics, out.regressed,
                                                  mask, np.concatenate([t1, t2], 1))["loss"]
    else:
        negs = host["negatives"]
        assert negs.shape == (samples, negatives.NUM_NEGATIVES, ids.shape[1])
        captions = np.concatenate([ids[:, None], negs], 1).reshape(-1, ids.shape[1])
        out = forward(params, np.repeat(img1, 7, 0), np.repeat(img2, 7, 0), captions)
        want = idc_pcl_pretraining.on_one_device(idc_pcl_pretraining.fda_metrics, out.visual,
                                                  out.text_cls, samples=samples)["loss"]
    assert float(metrics["loss"]) == pytest.approx(float(want), rel=1e-5), task
    assert float(want) > 0


# ---- devices ---------------------------------------------------------------------------------


def test_eight_devices_equal_one_for_an_mvcl_step(trainer, initial):
    assert jax.device_count() >= 8
    assert trainer.config.model.dropout_rate == 0.0  # per-device dropout cannot equal one
    host = next(iter(trainer.task_loader("mvcl")))
    step = trainer.config.optim.warmup_steps  # the noam peak: lr 5e-4, not lr(0) = 1e-8
    results = []
    for devices in (1, 8):
        mesh = parallel.make_mesh(devices)
        update = pretraining.make_task_step(trainer.model, "mvcl", trainer.optimizer, mesh,
                                         trainer.schedule, with_grads=True)
        new, metrics, grads = update(_on(mesh, initial, step), pipeline.to_global(
            host, parallel.batch_sharding(mesh)))
        results.append(jax.device_get((new.params, grads, metrics)))
    (p1, g1, m1), (p8, g8, m8) = results
    assert m1["loss"] > 0 and m1["learning_rate"] == pytest.approx(5e-4)
    np.testing.assert_allclose(m8["loss"], m1["loss"], rtol=1e-5)
    # As train_helpers.assert_eight_devices_equal_one: gradients within 1e-5 of each tensor's
    # largest, updated parameters within 1e-5 where the gradient is real.
    largest = max(np.abs(g).max() for g in jax.tree_util.tree_leaves(g1))
    compared = 0
    for (path, a1), a8, q1, q8 in zip(jax.tree_util.tree_leaves_with_path(g1),
                                      *(jax.tree_util.tree_leaves(t) for t in (g8, p1, p8)),
                                      strict=True):
        name = jax.tree_util.keystr(path)
        if np.abs(a1).max() < 1e-6 * largest:  # analytically zero: float noise on both
            assert np.abs(a8).max() < 1e-6 * largest, name
            continue
        np.testing.assert_allclose(a8, a1, atol=1e-5 * np.abs(a1).max(), err_msg=name)
        # Adam's first step moves a parameter by about +-lr even on a float-noise gradient.
        real = np.abs(a1) > 1e-5 * largest
        np.testing.assert_allclose(q8[real], q1[real], atol=1e-5, err_msg=name)
        compared += 1
    assert compared > 10  # feat_regress, the encoders and the tied img_project among them


# ---- task draw -------------------------------------------------------------------------------


def test_task_draw_is_seeded_and_follows_the_ratio():
    p = pretraining.task_probabilities(TASKS, OFFICIAL_RATIO)
    steps = range(1, 11_001)
    draws = [pretraining.draw_task(1234, t, TASKS, p) for t in steps]
    assert draws == [pretraining.draw_task(1234, t, TASKS, p) for t in steps]
    assert draws != [pretraining.draw_task(1, t, TASKS, p) for t in steps]
    share = {t: draws.count(t) / len(draws) for t in TASKS}
    assert share["mlm"] == pytest.approx(8 / 11, abs=0.015)
    assert share["mvcl"] == pytest.approx(1 / 11, abs=0.01)
    assert share["fda"] == pytest.approx(2 / 11, abs=0.012)
    # Birds-to-Words' 9:1:2, and the Table 4 subsets: the ratio of the enabled tasks.
    np.testing.assert_allclose(pretraining.task_probabilities(TASKS, (9, 1, 2)),
                               [9 / 12, 1 / 12, 2 / 12])
    two = ("mlm", "mvcl")
    q = pretraining.task_probabilities(two, OFFICIAL_RATIO)
    np.testing.assert_allclose(q, [8 / 9, 1 / 9])
    drawn = [pretraining.draw_task(0, t, two, q) for t in range(2000)]
    assert set(drawn) == set(two) and drawn.count("mvcl") / 2000 == pytest.approx(1 / 9,
                                                                                  abs=0.02)
    assert {pretraining.draw_task(0, t, ("mlm",), np.ones(1)) for t in range(50)} == {"mlm"}


# ---- a run: resume, validation, checkpoints, init_from ---------------------------------------


def test_resume_continues_every_task_stream_exactly(trainer, tmp_path):
    full = _sibling(trainer, tmp_path / "full")
    full_val = full.train()
    first = _sibling(trainer, tmp_path / "resumed", num_train_steps=INTERRUPT)
    first.train()
    # The interrupted run's checkpoint: the state and every task's data stream.
    saved = tmp_path / "resumed" / "checkpoints" / str(INTERRUPT)
    assert {"state", "data_mlm", "data_mvcl", "data_fda"} <= {p.name for p in saved.iterdir()}
    second = _sibling(trainer, tmp_path / "resumed")
    resumed_val = second.train()
    assert [s for s, _ in second.history] == list(range(INTERRUPT + 1, STEPS + 1))
    p = trainer.probabilities
    for (step, got), (want_step, want) in zip(second.history, full.history[INTERRUPT:],
                                              strict=True):
        assert step == want_step
        task = pretraining.draw_task(SEED, step, TASKS, p)
        assert f"{task}/loss" in got and not {f"{t}/loss" for t in TASKS if t != task} & set(got)
        for timing in metric_writer.TIMING_SCALARS:
            got.pop(timing), want.pop(timing)
        assert got == want, step  # bit-identical
    assert set(draw for draw in (pretraining.draw_task(SEED, t, TASKS, p)
                                 for t in range(INTERRUPT + 1, STEPS + 1))) == set(TASKS)
    # Validation: every task's val metrics, logged and written, equal after the resume.
    assert resumed_val == full_val
    assert set(full_val) == {"val/mlm_loss", "val/mlm_accuracy", "val/mvcl_loss",
                             "val/fda_loss", "val/fda_accuracy", "val/fda_positive_similarity",
                             "val/fda_negative_similarity"}
    written = json.loads((tmp_path / "full" / "metrics" / f"pretrain_val_{STEPS}.json")
                         .read_text())
    assert written == full_val
    scalars = [json.loads(line) for line in (tmp_path / "full" / metric_writer.SCALARS_FILE)
               .read_text().splitlines()]
    assert any("val/mvcl_loss" in s for s in scalars)
    # Fine-tuning starts from it (checkpoints.init_params_from): every parameter but the pooler;
    # feat_regress has no place in the fine-tuning model.
    fine_config = idc_config.get_config("finetune")
    fine_config.model.update({k: trainer.config.model[k] for k in
                              ("hidden_dim", "num_heads", "ffn_dim", "cross_layers",
                               "image_dim")})
    fine_model = models.build(fine_config.model, vocab_size=len(trainer.dataset.vocab),
                              max_len=trainer.max_len)
    host = trainer.samples("mlm", "train")[0]
    img, ids = host["img1"][None].astype(np.float32), host["captions"][:1]
    batch = {"before": img, "after_semantic": img, "after_distractor": img,
             "change_caption": ids, "no_change_caption": ids}
    shapes = jax.eval_shape(lambda: fine_model.init(jax.random.key(0), batch, train=False))
    fresh = jax.tree.map(lambda x: jnp.full(x.shape, 0.5, x.dtype), shapes["params"])
    params = checkpoints.init_params_from(fresh, tmp_path / "full", ("pooler",))
    pretrained = checkpoints.make_checkpoint_manager(tmp_path / "full" / "checkpoints", 1).restore(
        STEPS, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]["params"]
    assert "feat_regress" not in params
    np.testing.assert_array_equal(params["word_embedding"]["embedding"],
                                  pretrained["word_embedding"]["embedding"])
    np.testing.assert_array_equal(params["encoder"]["layers_0"]["attn"]["q_linear"]["kernel"],
                                  pretrained["encoder"]["layers_0"]["attn"]["q_linear"]["kernel"])
    np.testing.assert_array_equal(params["pooler_0"]["kernel"], fresh["pooler_0"]["kernel"])


# ---- FDA batch layout ------------------------------------------------------------------------


def test_fda_batch_is_the_positive_then_its_six_negatives(trainer):
    source = trainer.samples("fda", "train")
    path = negatives.negatives_path(trainer.dataset.directory, "train")
    by_pair = negatives.negatives_by_pair(negatives.load_negatives(path))
    vocab = trainer.dataset.vocab
    for index in (6, 7):  # a semantic and a distractor pair
        sample = source[index]
        length = sample["captions"].shape[-1]
        want = [vocab.encode(c, length, allow_unk=True, truncate=True)
                for c in by_pair[(sample["image_id"], index % 2 == 0)]]
        np.testing.assert_array_equal(sample["negatives"], np.stack(want))
        # The positive is never among its negatives.
        assert not {tuple(c) for c in sample["captions"]} & {tuple(c) for c in want}
    batch = next(iter(trainer.task_loader("fda")))
    s, k = batch["ids"].shape[0], negatives.NUM_NEGATIVES
    assert batch["negatives"].shape == (s, k, batch["ids"].shape[1])
    img1, img2, rows = (np.asarray(x) for x in idc_pcl_pretraining.fda_rows(
        batch["img1"], batch["img2"], batch["ids"], batch["negatives"]))
    assert rows.shape == (s * (1 + k), batch["ids"].shape[1])
    for i in range(s):
        group = slice(i * (1 + k), (i + 1) * (1 + k))
        np.testing.assert_array_equal(rows[group][0], batch["ids"][i])  # the positive first
        np.testing.assert_array_equal(rows[group][1:], batch["negatives"][i])  # file order
        assert np.all(img1[group] == batch["img1"][i]) and np.all(img2[group] == batch["img2"][i])


# ---- presets, errors, entry point ------------------------------------------------------------


def test_pretraining_presets():
    clevr = idc_config.get_config("pretrain/clevr_change")
    assert clevr.model.stage == "pretrain" and clevr.optim.schedule == "noam"
    assert (clevr.optim.learning_rate, clevr.optim.warmup_steps, clevr.num_train_steps) == (
        1e-4, 8000, 250_000)
    assert (clevr.batch_size, clevr.model.pairs) == (100, "both")  # 200 pairs
    assert (clevr.eval_every_steps, clevr.pretrain.fda_batch_size) == (1000, 28)
    assert tuple(clevr.pretrain.task_ratio) == OFFICIAL_RATIO
    assert tuple(clevr.pretrain.tasks) == TASKS and clevr.model.dropout_rate == 0.2
    birds = idc_config.get_config("pretrain/birds_to_words")
    assert (birds.optim.warmup_steps, birds.num_train_steps, birds.model.cross_layers) == (
        4000, 50_000, 2)
    assert (birds.decode.max_len, tuple(birds.pretrain.task_ratio)) == (80, (9, 1, 2))
    assert birds.model.pairs == "semantic_only" and birds.batch_size == 200
    for preset in ("pretrain", "pretrain/synthetic", "pretrain/synthetic_extreme"):
        cpu = idc_config.get_config(preset)
        assert (cpu.model.hidden_dim, cpu.model.num_heads, cpu.model.ffn_dim,
                cpu.model.cross_layers, cpu.model.dropout_rate) == (128, 4, 256, 2, 0.0)
        assert (cpu.batch_size, cpu.optim.learning_rate, cpu.optim.warmup_steps,
                cpu.num_train_steps) == (64, 5e-4, 100, 1000)
    assert idc_config.get_config("pretrain/synthetic_extreme").dataset.variant == "extreme"
    assert "pretrain" not in idc_config.get_config("finetune")


def test_errors_name_the_problem(data_dir, tmp_path):
    config = tiny_pretrain(data_dir)
    config.pretrain.tasks = ("mlm", "jigsaw")
    with pytest.raises(pretraining.PretrainError, match="jigsaw.*distinct tasks among"):
        pretraining.PretrainTrainer(config, tmp_path)
    config = tiny_pretrain(data_dir)
    config.pretrain.task_ratio = (8, 1)
    with pytest.raises(pretraining.PretrainError, match=r"one weight per task.*got 2"):
        pretraining.PretrainTrainer(config, tmp_path)
    config.pretrain.task_ratio = (8, 0, 2)
    with pytest.raises(pretraining.PretrainError, match="positive weight"):
        pretraining.PretrainTrainer(config, tmp_path)
    # A missing negatives file (without first-use preparation, as for the real datasets):
    # named, with the command that makes it.
    dataset = datasets.prepare("synthetic", data_dir, "moderate", SMALL)
    path = negatives.negatives_path(dataset.directory, "val")
    aside = path.with_suffix(".aside")
    path.rename(aside)
    config = tiny_pretrain(data_dir)
    config.dataset.build_if_missing = False
    try:
        with pytest.raises(pretraining.PretrainError) as err:
            pretraining.PretrainTrainer(config, tmp_path)
    finally:
        aside.rename(path)
    message = str(err.value)
    assert str(path) in message
    assert (f"python -m data_prep.hard_negatives --dataset=synthetic --data_dir={data_dir} "
            "--variant=moderate --option=") in message
    assert "--option=num_train=40 " in message and "--option=feature_shape=4,4,16 " in message
    # Without fda no negatives are needed.
    config = tiny_pretrain(data_dir)
    config.pretrain.tasks = ("mlm",)
    config.pretrain.fda_batch_size = 3  # not a multiple of the devices, but unused
    assert pretraining.PretrainTrainer(config, tmp_path, mesh=parallel.make_mesh(1)).negatives == {}
    config.pretrain.tasks = ("mlm", "fda")
    with pytest.raises(pretraining.PretrainError, match="fda_batch_size = 3.*8 devices"):
        pretraining.PretrainTrainer(config, tmp_path, mesh=parallel.make_mesh(8))


def test_main_runs_pretraining_for_a_config_with_a_pretrain_block(monkeypatch, tmp_path):
    from absl import app, flags

    from changecap_jax import main as entry

    calls = []

    class Recorder:
        def __init__(self, config, workdir):
            calls.append((config, workdir))

        def train(self):
            calls.append("train")

    monkeypatch.setattr(pretraining, "PretrainTrainer", Recorder)
    argv = ["main", f"--config={ROOT / 'configs' / 'idc_pcl.py'}:pretrain",
            f"--workdir={tmp_path}", "--config.pretrain.tasks=('mlm', 'mvcl')"]
    monkeypatch.setattr(sys, "argv", argv)  # config_flags finds its overrides in sys.argv
    flags.FLAGS(argv)
    try:
        entry.main(["main"])
        (config, workdir), done = calls
        assert done == "train" and workdir == str(tmp_path)
        assert config.model.stage == "pretrain" and tuple(config.pretrain.tasks) == (
            "mlm", "mvcl")
        flags.FLAGS.mode = "eval"
        with pytest.raises(app.UsageError, match="pretraining config"):
            entry.main(["main"])
    finally:
        flags.FLAGS.unparse_flags()
