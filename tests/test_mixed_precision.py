"""config.compute_dtype = "bfloat16" (changecap_jax/models/precision.py): every model's forward pass
runs in bfloat16 and its losses stay within a stated distance of float32; parameters,
optimizer state and gradients stay float32."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from changecap_jax import models, parallel
from changecap_jax.commands import synthetic_inputs
from changecap_jax.data import pipeline
from changecap_jax.models import precision
from changecap_jax.trainers import caption_step, optimizers, update
from tests.train_helpers import SMALL

# Relative distance of bfloat16 from float32 allowed for each loss of a freshly initialised
# model. bfloat16 keeps 8 significant bits (relative rounding 2**-9 = 0.2%); a forward pass of
# a few layers accumulates a few such errors, so 3% catches a loss computed in the wrong
# dtype or on the wrong values, not rounding.
LOSS_RTOL = 0.03
MODELS = [("dirl", "synthetic"), ("scorer", "synthetic"), ("subtraction", "synthetic"),
          ("cheers", "synthetic"), ("idc_pcl", "finetune")]


def _small_model(name: str, preset: str):
    config = importlib.import_module(f"configs.{name}").get_config(preset)
    model = models.build(config.model, vocab_size=30, max_len=12)
    return config, model


def _batch(model, feature_shape):
    return synthetic_inputs.make_batch(model, 8, feature_shape, caption_len=12, vocab_size=30)


@pytest.mark.parametrize("name, preset", MODELS)
def test_bfloat16_forward_and_losses_near_float32(name, preset):
    config, model = _small_model(name, preset)
    feature_shape = tuple(config.dataset.options.get("feature_shape", SMALL["feature_shape"]))
    batch = _batch(model, feature_shape)
    params = model.init({"params": jax.random.key(0)}, batch, train=False)["params"]
    mesh = parallel.make_mesh(1)
    rng = jax.random.key(1)
    out = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        fn = jax.jit(caption_step.make_loss_fn(model, dict(config.loss_weights), mesh, dtype))
        out[dtype] = jax.device_get(fn(params, batch, rng)[1])
        # The forward itself ran in the compute dtype: the logits come out in it.
        cast_params, cast_batch = precision.cast_floating((params, batch), dtype)
        logits = jax.eval_shape(lambda p, b: model.apply({"params": p}, b, train=False),
                                cast_params, cast_batch).caption_logits
        assert {v.dtype for v in logits.values()} == {jnp.dtype(dtype)}, name
    f32, bf16 = out[jnp.float32], out[jnp.bfloat16]
    assert set(f32) == set(bf16)
    for key, value in f32.items():
        assert np.asarray(bf16[key]).dtype == np.float32, key  # losses reduce in float32
        np.testing.assert_allclose(bf16[key], value, rtol=LOSS_RTOL, atol=1e-3, err_msg=key)


def test_train_step_keeps_float32_state_and_gradients():
    config, model = _small_model("dirl", "synthetic")
    batch = _batch(model, SMALL["feature_shape"])
    params = model.init({"params": jax.random.key(0)}, batch, train=False)["params"]
    optimizer, schedule = optimizers.make_optimizer(config.optim, 10)
    mesh = parallel.make_mesh(1)
    state0 = update.TrainState(step=jnp.int32(0), params=params,
                              opt_state=optimizer.init(params), rng=jax.random.key(2))
    steps = {d: caption_step.make_train_step(model, optimizer, dict(config.loss_weights), mesh, {},
                                      schedule, with_grads=True, compute_dtype=d)
             for d in (jnp.float32, jnp.bfloat16)}
    arrays = pipeline.to_global(batch, parallel.batch_sharding(mesh))
    copy = lambda: jax.tree_util.tree_map(jnp.array, state0)  # steps donate their state
    results = {d: jax.device_get(step(copy(), arrays)) for d, step in steps.items()}
    state_bf16, _, grads_bf16 = results[jnp.bfloat16]
    for tree in (state_bf16.params, state_bf16.opt_state, grads_bf16):
        dtypes = {x.dtype for x in jax.tree_util.tree_leaves(tree) if x.dtype.kind == "f"}
        assert dtypes == {np.dtype(np.float32)}
    # The bfloat16 gradients point the same way as float32's.
    g32 = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(results[jnp.float32][2])])
    g16 = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(grads_bf16)])
    assert np.dot(g32, g16) / (np.linalg.norm(g32) * np.linalg.norm(g16)) > 0.99


def test_compute_dtype_names():
    assert precision.compute_dtype("bfloat16") == jnp.bfloat16
    with pytest.raises(ValueError, match="loss scaling"):
        precision.compute_dtype("float16")
    with pytest.raises(ValueError, match="float32"):
        precision.compute_dtype("fp8")
    tree = {"w": np.ones(2, np.float32), "ids": np.ones(2, np.int32), "m": np.ones(2, bool)}
    cast = precision.cast_floating(tree, jnp.bfloat16)
    assert (cast["w"].dtype, cast["ids"].dtype, cast["m"].dtype) == (
        jnp.bfloat16, np.int32, np.bool_)
