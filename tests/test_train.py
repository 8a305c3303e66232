"""Trainer: N devices equal one, exact resume, preemption, schedule (hosts: test_multihost.py).

Section numbers (§) and quirk ids (S-Q, D-Q, I-Q) refer to docs/official/ (see its README.md).
"""

import json
import os
import shutil
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from train_helpers import SMALL, assert_eight_devices_equal_one, tiny_config

from changecap_jax import parallel
from changecap_jax.data import datasets, pipeline
from changecap_jax.io import checkpoints, metric_writer
from changecap_jax.trainers import captioning, optimizers


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_data")
    datasets.prepare("synthetic", root, "moderate", SMALL)
    return str(root)


def test_eight_devices_equal_one(data_dir, tmp_path):
    # Dropout off: per-device dropout masks cannot equal one device's (distributionally equal).
    config = tiny_config(data_dir, **{"batch_size": 16})
    config.model.dropout_rate = 0.0
    metrics = assert_eight_devices_equal_one(config, tmp_path)
    assert set(metrics) >= {"loss", "loss/caption", "loss/dirl", "loss/ccr"}


def test_update_changes_params_and_masks_padding_row(data_dir, tmp_path):
    config = tiny_config(data_dir)
    trainer = captioning.Trainer(config, tmp_path, mesh=parallel.make_mesh(1))
    state = trainer.init_state()
    before = jax.device_get(state.params)
    batch = pipeline.to_global(next(iter(trainer.train_loader())), trainer.data_sharding)
    state, _ = trainer.train_step(state, batch)
    after = jax.device_get(state.params)
    emb0, emb1 = (p["decoder"]["embed"]["embedding"] for p in (before, after))
    np.testing.assert_array_equal(emb1[0], emb0[0])  # padding row: zero gradient
    assert np.abs(emb1[2] - emb0[2]).max() > 0  # <START> row is trained
    assert int(state.step) == 1


def _with_workers(config, workers):
    config.data.workers = workers
    return config


def _logged_steps(workdir: Path) -> list[int]:
    lines = (workdir / metric_writer.SCALARS_FILE).read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


def test_resume_continues_exactly(data_dir, tmp_path):
    # The reading workers change neither the batches nor the checkpointed data position:
    # 0 workers uninterrupted == 2 workers, interrupted, resumed with 1.
    one = parallel.make_mesh(1)  # resuming is the point, not sharding (test_multihost.py)
    full = captioning.Trainer(tiny_config(data_dir, num_train_steps=6), tmp_path / "full",
                              mesh=one)
    full.train()
    first = captioning.Trainer(_with_workers(tiny_config(data_dir, num_train_steps=3), 2),
                               tmp_path / "resumed", mesh=one)
    first.train()  # "interrupted" after 3 steps: its final checkpoint is step 3
    # A crash after logging steps the checkpoint does not hold (and mid-line): the resume
    # replays them, and scalars.jsonl keeps one line per step.
    with (tmp_path / "resumed" / metric_writer.SCALARS_FILE).open("a") as fh:
        fh.write('{"step": 4, "loss": 9.0}\n{"step": 5, "loss": 9.0}\n{"step": 6, "lo')
    second = captioning.Trainer(_with_workers(tiny_config(data_dir, num_train_steps=6), 1),
                                tmp_path / "resumed", mesh=one)
    second.train()
    assert [s for s, _ in second.history] == [4, 5, 6]
    for (step, resumed), (_, uninterrupted) in zip(second.history, full.history[3:], strict=True):
        assert resumed["loss"] == uninterrupted["loss"], step
        assert resumed["loss/dirl"] == uninterrupted["loss/dirl"], step
    assert _logged_steps(tmp_path / "resumed") == [1, 2, 3, 4, 5, 6]
    logged = (tmp_path / "resumed" / metric_writer.SCALARS_FILE).read_text().splitlines()
    assert 9.0 not in [json.loads(line)["loss"] for line in logged]


def test_sigterm_saves_at_the_next_step_and_the_rerun_resumes(data_dir, tmp_path):
    """A preemption notice on one process (trainers/preemption.py): the step after SIGTERM is
    saved, the loop stops with Preempted, the signal's former handler is back, and a rerun
    continues from that step as if nothing had happened."""
    import signal

    from changecap_jax.trainers.preemption import Preempted

    one = parallel.make_mesh(1)
    full = captioning.Trainer(tiny_config(data_dir, num_train_steps=4), tmp_path / "full",
                              mesh=one)
    full.train()
    before = signal.getsignal(signal.SIGTERM)
    preempted = captioning.Trainer(tiny_config(data_dir, num_train_steps=4), tmp_path / "run",
                                   mesh=one)
    run_step = preempted.run_step

    def noticed_at_step_2(state, step, streams):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return run_step(state, step, streams)

    preempted.run_step = noticed_at_step_2
    with pytest.raises(Preempted, match="saved the checkpoint of step 2"):
        preempted.train()
    assert signal.getsignal(signal.SIGTERM) is before
    manager = checkpoints.make_checkpoint_manager(tmp_path / "run" / "checkpoints", keep=3)
    assert manager.all_steps() == [2]
    rerun = captioning.Trainer(tiny_config(data_dir, num_train_steps=4), tmp_path / "run",
                               mesh=one)
    rerun.train()
    assert [s for s, _ in rerun.history] == [3, 4]
    for (step, resumed), (_, uninterrupted) in zip(rerun.history, full.history[2:], strict=True):
        assert resumed["loss"] == uninterrupted["loss"], step


def test_failing_evaluation_keeps_the_training_since_the_last_save(data_dir, tmp_path):
    """A damaged val shard fails the evaluation at step 2: the state of step 2 is saved
    before the error surfaces, so a rerun resumes there instead of at step 0."""
    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    (shard,) = data.rglob("*-val.array_record-*")
    raw = bytearray(shard.read_bytes())
    raw[64:-256] = b"\xff" * len(raw[64:-256])  # records garbage, file footer intact
    shard.write_bytes(bytes(raw))
    config = tiny_config(str(data), num_train_steps=4, eval_every_steps=2, eval_splits=("val",))
    with pytest.raises(Exception):  # noqa: B017 - whatever the reader raises for the damage
        captioning.Trainer(config, tmp_path / "run").train()
    manager = checkpoints.make_checkpoint_manager(tmp_path / "run" / "checkpoints", keep=3)
    assert manager.all_steps() == [2]


# A training run whose async save of step 4 has written its files but is held before its
# commit (the rename into place): the loop goes on meanwhile, then the parent kills it -9.
KILLED_MID_SAVE = """
import asyncio, os, sys, threading
sys.path.insert(0, "tests")
from orbax.checkpoint._src.path import atomicity
from train_helpers import tiny_config
from changecap_jax import parallel
from changecap_jax.trainers import captioning

data_dir, workdir = sys.argv[1], sys.argv[2]
commit = atomicity.AtomicRenameTemporaryPath.finalize

async def held(self):
    if self._final_path.name == "4":
        print("IN FLIGHT", threading.current_thread() is not threading.main_thread(), flush=True)
        await asyncio.sleep(3600)
    return await commit(self)

atomicity.AtomicRenameTemporaryPath.finalize = held
trainer = captioning.Trainer(tiny_config(data_dir, num_train_steps=8, checkpoint_every_steps=2,
                                         async_checkpoints=True), workdir,
                             mesh=parallel.make_mesh(1))
run_step = trainer.run_step

def noted(state, step, streams):
    print("STEP", step, flush=True)
    return run_step(state, step, streams)

trainer.run_step = noted
trainer.train()
"""


def test_a_run_killed_during_an_async_save_resumes_from_the_previous_step(data_dir, tmp_path):
    """kill -9 while the asynchronous save of step 4 is in flight (its files written, not yet
    renamed into place; the steps after it already running): step 4 is a temporary folder no
    reader lists, and the rerun resumes from step 2, removes that folder, and trains on."""
    import signal
    import subprocess
    import sys

    workdir = tmp_path / "run"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(Path(__file__).parents[1]))
    proc = subprocess.Popen([sys.executable, "-c", KILLED_MID_SAVE, data_dir, str(workdir)],
                            cwd=Path(__file__).parents[1], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    seen = []
    try:
        for line in proc.stdout:  # the save in flight, and the loop past it
            seen.append(line.strip())
            if "IN FLIGHT True" in seen and "STEP 5" in seen:
                break
        else:
            pytest.fail(f"the run ended before the kill: {seen}")
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    directory = workdir / "checkpoints"
    assert checkpoints.steps(directory) == [2]
    assert any(p.name.startswith("4.orbax-checkpoint-tmp") for p in directory.iterdir())
    rerun = captioning.Trainer(tiny_config(data_dir, num_train_steps=8,
                                           checkpoint_every_steps=2), workdir,
                               mesh=parallel.make_mesh(1))
    rerun.train()
    assert [s for s, _ in rerun.history] == [3, 4, 5, 6, 7, 8]  # from step 2
    assert checkpoints.steps(directory)[-1] == 8
    assert not [p.name for p in directory.iterdir() if "tmp" in p.name]


def test_learning_rate_steps_per_epoch():
    import ml_collections
    optim = ml_collections.ConfigDict(dict(learning_rate=2e-4, decay_factor=0.1,
                                           decay_every_epochs=15))
    schedule = optimizers.learning_rate_schedule(optim, steps_per_epoch=265)
    # Updates 1..3975 at 2e-4, 3976..7950 at 2e-5 (reference §3.8); count = updates made.
    assert schedule(0) == pytest.approx(2e-4) and schedule(3974) == pytest.approx(2e-4)
    assert schedule(3975) == pytest.approx(2e-5) and schedule(7949) == pytest.approx(2e-5)
    assert schedule(7950) == pytest.approx(2e-6)


def test_noam_and_piecewise_schedules_match_the_idc_recipe():
    import ml_collections
    # Pretraining (§5.6): 1e-4 * min(t / 8000, sqrt(8000 / t)), 1e-8 at t = 0.
    noam = optimizers.learning_rate_schedule(ml_collections.ConfigDict(dict(
        learning_rate=1e-4, schedule="noam", warmup_steps=8000)), steps_per_epoch=1)
    for t, want in [(0, 1e-8), (1, 1e-4 / 8000), (4000, 5e-5), (8000, 1e-4),
                    (32_000, 5e-5), (250_000, 1e-4 * (8000 / 250_000) ** 0.5)]:
        assert float(noam(t)) == pytest.approx(want, rel=1e-6), t
    # Fine-tuning: 3e-5 below 10k updates, 1.5e-5 below 20k, 7.5e-6 after.
    piecewise = optimizers.learning_rate_schedule(ml_collections.ConfigDict(dict(
        learning_rate=3e-5, schedule="piecewise", decay_factor=0.5,
        boundaries=(20_000, 10_000))), steps_per_epoch=1)
    for t, want in [(0, 3e-5), (9_999, 3e-5), (10_000, 1.5e-5), (19_999, 1.5e-5),
                    (20_000, 7.5e-6), (100_000, 7.5e-6)]:
        assert float(piecewise(t)) == pytest.approx(want, rel=1e-6), t
    with pytest.raises(ValueError, match="optim.schedule"):
        optimizers.learning_rate_schedule(ml_collections.ConfigDict(dict(
            learning_rate=1.0, schedule="cosine")), steps_per_epoch=1)


def test_weight_decay_is_torch_adams_l2_term():
    import ml_collections
    optim = ml_collections.ConfigDict(dict(
        learning_rate=1e-3, b1=0.9, b2=0.999, eps=1e-8, decay_factor=0.1,
        decay_every_epochs=0, grad_clip_norm=0.0, weight_decay=0.1))
    opt, _ = optimizers.make_optimizer(optim, steps_per_epoch=1)
    p = np.array([2.0, -1.0], np.float32); g = np.array([0.0, 0.3], np.float32)  # noqa: E702
    updates, _ = opt.update(g, opt.init(p), p)
    # torch: grad += wd * p before the moments, so a zero gradient still moves the weight.
    g_total = g + 0.1 * p
    expected = -1e-3 * g_total / (np.abs(g_total) + 1e-8)
    np.testing.assert_allclose(updates, expected, rtol=1e-5)


def test_adam_matches_torch_formula():
    # One optax Adam step equals torch's m_hat / (sqrt(v_hat) + eps) (reference §1.2).
    opt = optax.adam(2e-4, b1=0.9, b2=0.999, eps=1e-8)
    p = np.array([1.0, -2.0], np.float32); g = np.array([0.5, -3e-6], np.float32)  # noqa: E702
    updates, _ = opt.update(g, opt.init(p), p)
    m_hat = (1 - 0.9) * g / (1 - 0.9)
    v_hat = (1 - 0.999) * g.astype(np.float64) ** 2 / (1 - 0.999)
    expected = -2e-4 * m_hat / (np.sqrt(v_hat) + 1e-8)
    np.testing.assert_allclose(updates, expected, rtol=1e-5)  # float32 arithmetic
    assert abs(updates[1]) < 2e-4 * 0.999  # eps matters for a tiny gradient


def test_finish_last_epoch_rounds_up_to_whole_epochs(data_dir, tmp_path):
    # 40 train examples, batch 16 -> 3 steps per epoch (the last one partial, as torch's
    # DataLoader without drop_last); 4 iterations -> the official loop runs 6.
    trainer = captioning.Trainer(tiny_config(data_dir, num_train_steps=4), tmp_path)
    assert trainer.steps_per_epoch == 3 and trainer.total_train_steps == 4
    config = tiny_config(data_dir, num_train_steps=4, finish_last_epoch=True)
    assert captioning.Trainer(config, tmp_path).total_train_steps == 6
    config = tiny_config(data_dir, num_train_steps=6, finish_last_epoch=True)
    assert captioning.Trainer(config, tmp_path).total_train_steps == 6


def test_frozen_groups_are_never_updated():
    import ml_collections
    optim = ml_collections.ConfigDict(dict(
        learning_rate=1e-2, b1=0.9, b2=0.999, eps=1e-8, decay_factor=0.1,
        decay_every_epochs=0, grad_clip_norm=0.0, frozen=("cbr",)))
    opt, _ = optimizers.make_optimizer(optim, steps_per_epoch=10)
    params = {"encoder": {"w": np.ones(3, np.float32)},
              "cbr": {"w": np.ones(3, np.float32), "b": np.zeros(2, np.float32)}}
    grads = jax.tree.map(lambda x: np.full_like(x, 0.5), params)
    state = opt.init(params)
    for _ in range(2):
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(params["cbr"]["w"], 1.0)
    np.testing.assert_array_equal(params["cbr"]["b"], 0.0)
    assert np.all(params["encoder"]["w"] < 1.0 - 1e-2)  # two Adam steps of ~lr each
    optim.frozen = ("speaker",)
    opt, _ = optimizers.make_optimizer(optim, steps_per_epoch=10)
    with pytest.raises(KeyError, match="speaker"):
        opt.init(params)


def test_loss_weights_must_match_aux_losses(data_dir, tmp_path):
    config = tiny_config(data_dir)
    config.loss_weights = {"dirl": 0.5}
    trainer = captioning.Trainer(config, tmp_path, mesh=parallel.make_mesh(1))
    state = trainer.init_state()
    batch = pipeline.to_global(next(iter(trainer.train_loader())), trainer.data_sharding)
    with pytest.raises(ValueError, match="must name exactly the model's auxiliary losses"):
        trainer.train_step(state, batch)


def test_checkpoints_keep_latest_and_best(tmp_path):
    import grain
    import orbax.checkpoint as ocp

    manager = checkpoints.make_checkpoint_manager(tmp_path / "ckpt", keep=1)
    loader = grain.DataLoader(
        data_source=list(range(10)), sampler=grain.samplers.IndexSampler(
            num_records=10, shuffle=True, seed=0, num_epochs=None))
    iterator = iter(loader)
    for step, cider in [(1, 50.0), (2, 70.0), (3, 60.0), (4, 10.0)]:
        next(iterator)
        manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave({"w": np.full((2,), step, np.float32)}),
            data=grain.checkpoint.CheckpointSave(iterator)), metrics={"val_CIDEr": cider})
    manager.wait_until_finished()
    assert manager.all_steps() == [2, 4]  # best by val CIDEr, and the latest
    restored = manager.restore(2, args=ocp.args.Composite(
        state=ocp.args.StandardRestore({"w": np.zeros((2,), np.float32)})))
    np.testing.assert_array_equal(restored["state"]["w"], [2.0, 2.0])
