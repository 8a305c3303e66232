"""Getting a model without a trainer (changecap_jax/experiment.py, checkpoints.restore_params /
restore_state, the step listing, search.decode_ids): the same dataset, model, lengths,
parameters and captions as ``captioning.Trainer`` gives."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from train_helpers import tiny_config

from changecap_jax import experiment, exported_model
from changecap_jax.data import datasets
from changecap_jax.decoding import search
from changecap_jax.io import checkpoints
from changecap_jax.trainers import captioning


@pytest.fixture(scope="module")
def built(small_synthetic, tmp_path_factory) -> dict:
    config = tiny_config(str(small_synthetic.directory.parents[2]))
    workdir = tmp_path_factory.mktemp("experiment") / "run"
    trainer = captioning.Trainer(config, workdir)
    return {"config": config, "workdir": workdir, "trainer": trainer,
            "experiment": experiment.build(config, mesh=trainer.mesh)}


def test_build_gives_what_the_trainer_builds(built):
    exp, trainer = built["experiment"], built["trainer"]
    assert exp.model == trainer.model
    assert exp.dataset.name == trainer.dataset.name
    assert exp.dataset.directory == trainer.dataset.directory
    assert exp.dataset.vocab == trainer.dataset.vocab
    assert exp.dataset.pair_fields == trainer.dataset.pair_fields
    assert (exp.max_len, exp.conditioning, exp.extra_tokens, exp.steps_per_epoch,
            exp.compute_dtype) == (trainer.max_len, trainer.conditioning,
                                   trainer.extra_tokens, trainer.steps_per_epoch,
                                   trainer.compute_dtype)
    assert exp.streams == trainer.model_streams()
    with pytest.raises(AttributeError):  # frozen
        exp.max_len = 3


def test_build_refuses_distractor_training_without_distractors(built, monkeypatch):
    assert "distractor" in built["experiment"].streams  # the dirl preset trains on both
    prepare = datasets.prepare

    def without_distractors(*args, **kwargs):
        dataset = prepare(*args, **kwargs)
        meta = dataclasses.replace(dataset.meta, has_distractor=False)
        return dataclasses.replace(dataset, meta=meta)

    monkeypatch.setattr(datasets, "prepare", without_distractors)
    with pytest.raises(datasets.DatasetError, match="trains on distractor pairs"):
        experiment.build(built["config"])


def _save(workdir, step: int, state) -> None:
    manager = checkpoints.make_checkpoint_manager(workdir / "checkpoints", 5)
    manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
    manager.wait_until_finished()


@pytest.fixture(scope="module")
def saved(built) -> dict:
    """Two checkpoints (steps 3 and 7) of distinct parameters; val CIDEr prefers step 3."""
    trainer, workdir = built["trainer"], built["workdir"]
    fresh = trainer.init_state()
    states = {}
    for step, shift in ((3, 1.0), (7, 2.0)):
        states[step] = fresh.replace(
            step=jnp.int32(step), params=jax.tree.map(lambda p, s=shift: p + s, fresh.params))
        _save(workdir, step, states[step])
    (workdir / "metrics").mkdir(parents=True, exist_ok=True)
    for step, cider in ((3, 0.9), (7, 0.5)):
        (workdir / "metrics" / f"val_{step}.json").write_text(json.dumps({"CIDEr": cider}))
    return {"fresh": fresh, "states": states}


def _equal(a, b) -> None:
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_restore_params_and_state_equal_the_trainer_restore(built, saved):
    exp, trainer, workdir = built["experiment"], built["trainer"], built["workdir"]
    like = exported_model.abstract_params(exp.model, exp.dataset.meta, exp.max_len)
    manager = trainer.checkpoint_manager()
    for step, expected in ((None, 7), (3, 3), ("best", 3)):
        got_step, params = checkpoints.restore_params(workdir, like, step=step)
        assert got_step == expected
        by_trainer = trainer.restore(manager, trainer.init_state(), step=expected)
        _equal(params, by_trainer.params)
    got_step, state = checkpoints.restore_state(workdir, saved["fresh"], step=7)
    assert got_step == 7
    _equal(state, saved["states"][7])


def test_restore_params_names_a_model_mismatch(built, saved):
    like = {"not_a_layer": jax.ShapeDtypeStruct((2,), jnp.float32)}
    with pytest.raises(ValueError, match="do not fit the model"):
        checkpoints.restore_params(built["workdir"], like)


def test_no_checkpoint_is_a_checkpoint_error(tmp_path):
    with pytest.raises(checkpoints.CheckpointError, match="no checkpoint"):
        checkpoints.restore_params(tmp_path, {})
    assert not (tmp_path / "checkpoints").exists()  # nothing created


def test_step_listing(tmp_path):
    directory = tmp_path / "checkpoints"
    assert checkpoints.steps(directory) == [] and not checkpoints.has_steps(directory)
    assert checkpoints.latest_step(directory) is None
    for name in ("3", "10", "12.damaged", "14.orbax-checkpoint-tmp-1"):
        (directory / name).mkdir(parents=True)
    (directory / "20").write_text("a file, not a step")
    assert checkpoints.steps(directory) == [3, 10]
    assert checkpoints.latest_step(directory) == 10 and checkpoints.has_steps(directory)


@pytest.mark.parametrize("decode", [{}, {"beam_size": 3, "length_penalty": 0.6},
                                    {"sample": True}])
def test_decode_ids_equals_the_trainer_decode(built, saved, decode):
    trainer = built["trainer"]
    trainer.config.unlock()
    saved_decode = trainer.config.decode.to_dict()
    trainer.config.decode.update(decode)
    try:
        exp = built["experiment"]
        batch = next(trainer.eval_batches(exp.dataset.split("val")))
        before, after = np.asarray(batch["before"]), np.asarray(batch["after_semantic"])
        params, key = saved["states"][3].params, jax.random.key(5)
        expected = trainer.decode_fn(params, before, after, key)
        got = search.decode_ids(exp.model, params, before, after,
                                  decode_config=trainer.config.decode, max_len=exp.max_len,
                                  key=key, compute_dtype=exp.compute_dtype)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    finally:
        trainer.config.decode.update(saved_decode)
        trainer.config.lock()
