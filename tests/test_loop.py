"""The one loop and the one update builder: captioning and pretraining both run through
``loop.run``, and both tasks' updates come from ``update.make_update_step`` (so pretraining gets
the gradient row mask and the model's ``post_update``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from train_helpers import toy_loss_fn

from changecap_jax import parallel
from changecap_jax.trainers import caption_step, captioning, loop, pretraining, update


def test_captioning_and_pretraining_run_the_same_loop(monkeypatch):
    ran = []
    monkeypatch.setattr(loop, "run", lambda task: ran.append(task) or {"ran": True})
    captioning_task, pretraining_task = object(), object()
    assert captioning.Trainer.train(captioning_task) == {"ran": True}
    assert pretraining.PretrainTrainer.train(pretraining_task) == {"ran": True}
    assert ran == [captioning_task, pretraining_task]


def test_both_tasks_build_their_update_with_the_shared_builder(monkeypatch):
    built = []
    monkeypatch.setattr(pretraining, "make_update_step",
                        lambda loss_fn, *args, **kw: built.append(kw) or "step")
    monkeypatch.setattr(caption_step, "make_update_step",
                        lambda loss_fn, *args, **kw: built.append(kw) or "step")

    class Model:
        capabilities = frozenset({"post_update"})  # declared, as the model contract asks

        def post_update(self, params):
            return params

    model, mesh = Model(), parallel.make_mesh(1)
    rows = {"word_embedding/embedding": 0}
    assert pretraining.make_task_step(model, "mlm", None, mesh, None,
                                      zero_grad_rows=rows) == "step"
    assert caption_step.make_train_step(model, None, {}, mesh, rows, None) == "step"
    for kw in built:
        assert kw["zero_grad_rows"] == rows
        assert kw["post_update"] == model.post_update


def _toy_step(rows, post_update):
    mesh = parallel.make_mesh(1)
    loss_fn = toy_loss_fn(mesh)
    optimizer = optax.sgd(0.5)
    step = update.make_update_step(loss_fn, optimizer, mesh, optax.constant_schedule(0.5),
                                   zero_grad_rows=rows, post_update=post_update)
    params = {"w": jnp.ones((3, 2))}
    state = update.TrainState(step=jnp.int32(0), params=params,
                              opt_state=optimizer.init(params), rng=jax.random.PRNGKey(0))
    batch = {"x": jax.device_put(np.full((2, 3, 2), 1.0, np.float32),
                                 parallel.batch_sharding(mesh))}
    return step(state, batch)


def test_the_shared_update_masks_rows_and_applies_post_update():
    plain, metrics = _toy_step({}, None)
    np.testing.assert_allclose(plain.params["w"], np.full((3, 2), 0.0))  # 1 - 0.5 * 2
    assert int(plain.step) == 1 and float(metrics["learning_rate"]) == 0.5
    masked, _ = _toy_step({"w": 1}, lambda p: {"w": jnp.maximum(p["w"], -0.25) + 0.125})
    want = np.full((3, 2), 0.125)
    want[1] = 1.125  # the masked row keeps its value; post_update runs after the optimiser
    np.testing.assert_allclose(masked.params["w"], want)


def test_host_memory_is_released_after_each_evaluation(monkeypatch):
    """Fragmentation the kept host memory gathered is given back once per evaluation
    (changecap_jax/cpu/allocator.py)."""
    calls = []
    monkeypatch.setattr(loop.allocator, "release", lambda: calls.append("release"))

    class Task:
        def evaluate_at(self, state, step, writer, final):
            calls.append(f"evaluate {step}")
            return {"val": {"CIDEr": 1.0}}

    results = loop._evaluate(Task(), None, None, 7, {}, None, False)
    assert results == {"val": {"CIDEr": 1.0}}
    assert calls == ["evaluate 7", "release"]


def test_a_start_that_fails_still_closes_the_writer_and_the_manager(monkeypatch, tmp_path):
    """An unclosed tensorboardX writer prints a traceback at exit on Python 3.12, after the
    one-line error of, say, a restore that fails."""
    closed = []

    class Writer:
        def __init__(self, *args, **kwargs):
            pass

        def close(self):
            closed.append("writer")

    class Manager:
        def close(self):
            closed.append("manager")

    class Task:
        workdir, is_main, config = tmp_path, True, {}

        def checkpoint_manager(self):
            return Manager()

        def data_streams(self):
            return {}

    def fail(*args):
        raise RuntimeError("restore failed")

    monkeypatch.setattr(loop, "MetricWriter", Writer)
    monkeypatch.setattr(loop.run_config, "save_config", lambda *args: None)
    monkeypatch.setattr(loop, "start", fail)
    with pytest.raises(RuntimeError, match="restore failed"):
        loop.run(Task())
    assert closed == ["manager", "writer"]
