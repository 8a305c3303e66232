"""Tiny configs and runs shared by the trainer tests."""

from __future__ import annotations

import sys

import ml_collections

SMALL = {"num_train": 40, "num_val": 12, "num_test": 10, "feature_shape": (4, 4, 16)}


def tiny_run(config: ml_collections.ConfigDict, data_dir: str,
             **overrides) -> ml_collections.ConfigDict:
    """A synthetic preset shrunk for tests: the SMALL dataset in ``data_dir``, batch 16,
    3 steps, no evaluation; ``overrides`` last."""
    config.dataset.data_dir = data_dir
    config.dataset.options = dict(SMALL)
    config.batch_size = 16
    config.eval_batch_size = 8
    config.num_train_steps = 3
    config.log_every_steps = 1
    config.eval_every_steps = 1000
    config.checkpoint_every_steps = 1000
    config.eval_splits = ()
    config.final_eval_splits = ()
    # The binned evaluation has its own tests (test_difficulty.py); the others skip its scoring.
    config.difficulty_bins = 0
    config.update(overrides)
    return config


def tiny_config(data_dir: str, **overrides) -> ml_collections.ConfigDict:
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    from configs import dirl

    config = dirl.get_config("synthetic")
    config.model.update(hidden_dim=32, num_heads=4, word_dim=16, ffn_dim=64, mlp_hidden_dim=64)
    return tiny_run(config, data_dir, **overrides)


def _one_step(config, workdir, num_devices, batch):
    import jax

    from changecap_jax import parallel
    from changecap_jax.data import pipeline
    from changecap_jax.trainers import caption_step, captioning

    trainer = captioning.Trainer(config, workdir, mesh=parallel.make_mesh(num_devices))
    state = trainer.init_state()
    arrays = pipeline.to_global(batch, trainer.data_sharding)
    # The trainer's own update, also returning the gradients (one compile for both).
    step = caption_step.make_train_step(
        trainer.model, trainer.optimizer, dict(config.loss_weights), trainer.mesh,
        dict(config.optim.zero_grad_rows), trainer.schedule, with_grads=True)
    state, metrics, grads = step(state, arrays)
    return jax.device_get((state.params, grads, metrics))


def assert_eight_devices_equal_one(config, tmp_path) -> dict:
    """One train step on 1 and on 8 devices from the same batch: every logged loss within 1e-5
    relative, gradients within 1e-5 of each tensor's largest, updated parameters within 1e-5.
    Returns the 1-device metrics."""
    import jax
    import numpy as np

    from changecap_jax import parallel
    from changecap_jax.trainers import captioning

    assert jax.device_count() >= 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    loader = captioning.Trainer(config, tmp_path / "x", mesh=parallel.make_mesh(1)).train_loader()
    batch = next(iter(loader))
    params1, grads1, metrics1 = _one_step(config, tmp_path / "a", 1, batch)
    params8, grads8, metrics8 = _one_step(config, tmp_path / "b", 8, batch)
    for key in metrics1:
        np.testing.assert_allclose(metrics8[key], metrics1[key], rtol=1e-5, err_msg=key)
    leaves = lambda t: jax.tree_util.tree_leaves_with_path(t)  # noqa: E731
    largest = max(np.abs(g).max() for g in jax.tree_util.tree_leaves(grads1))
    for (path, g1), g8, p1, p8 in zip(leaves(grads1), jax.tree_util.tree_leaves(grads8),
                                      jax.tree_util.tree_leaves(params1),
                                      jax.tree_util.tree_leaves(params8), strict=True):
        name = jax.tree_util.keystr(path)
        tensor_max = np.abs(g1).max()
        if tensor_max < 1e-6 * largest:
            # Analytically zero gradient (a bias before a z-score, an attention key bias
            # under softmax): both runs must agree that it is float noise.
            assert np.abs(g8).max() < 1e-6 * largest, name
            continue
        np.testing.assert_allclose(g8, g1, atol=1e-5 * tensor_max, err_msg=name)
        # Adam's first step maps every gradient to about +-lr, float noise included, so the
        # updated parameters are compared where the gradient is real.
        real = np.abs(g1) > 1e-5 * largest
        np.testing.assert_allclose(p8[real], p1[real], atol=1e-5, err_msg=name)
    return metrics1


def toy_loss_fn(mesh):
    """(params, batch, rng) -> (sum(w * the batch's x summed over the GLOBAL batch), metrics):
    the smallest loss of the trunk's shape, for tests of the update step."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from changecap_jax import parallel

    def per_device(params, batch, rng):
        loss = jnp.sum(params["w"] * jax.lax.psum(jnp.sum(batch["x"], 0), parallel.DATA_AXIS))
        return loss, {"loss": loss}

    return jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(parallel.DATA_AXIS), P()),
                         out_specs=(P(), P()), check_vma=False)
