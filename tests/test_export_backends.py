"""The train step lowers for GPU and TPU from this CPU machine (``jax.export`` with
``platforms=("cuda", "tpu")``): every model's, in float32 and bfloat16. A CPU-only construct
in it (a host callback, a CPU-only custom call, a platform branch without a default) fails
here. So do the programs that run a trained model: greedy decoding and beam search as
``decode_ids`` runs them (float32 and bfloat16), and the attention maps ``predict`` draws
(their CPU compile options, changecap_jax/cpu/inference_options.py, stay out of an export)."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import ml_collections
import pytest

from changecap_jax import models, parallel
from changecap_jax.commands import synthetic_inputs
from changecap_jax.decoding import attention_maps, search
from changecap_jax.trainers import caption_step, optimizers
from tests.train_helpers import SMALL

PLATFORMS = ("cuda", "tpu")
MODELS = [("dirl", "synthetic"), ("scorer", "synthetic"), ("subtraction", "synthetic"),
          ("cheers", "synthetic"), ("idc_pcl", "finetune")]
CAPTION_LEN, VOCAB = 12, 30


def _setup(name: str, preset: str):
    config = importlib.import_module(f"configs.{name}").get_config(preset)
    model = models.build(config.model, vocab_size=VOCAB, max_len=CAPTION_LEN)
    feature_shape = tuple(config.dataset.options.get("feature_shape", SMALL["feature_shape"]))
    batch = synthetic_inputs.make_batch(model, 8, feature_shape, caption_len=CAPTION_LEN,
                                        vocab_size=VOCAB)
    return config, model, batch


def _export(fn, *args) -> jax.export.Exported:
    exported = jax.export.export(fn, platforms=PLATFORMS)(*args)
    assert exported.platforms == PLATFORMS
    return exported


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name, preset", MODELS)
def test_the_train_step_lowers_for_gpu_and_tpu(name, preset, dtype):
    config, model, batch = _setup(name, preset)
    mesh = parallel.make_mesh(1)
    optimizer, schedule = optimizers.make_optimizer(config.optim, 10)
    step = caption_step.make_train_step(model, optimizer, dict(config.loss_weights), mesh,
                                      dict(config.optim.zero_grad_rows), schedule,
                                      compute_dtype=jnp.dtype(dtype))
    state = jax.eval_shape(lambda: caption_step.init_train_state(
        model, optimizer, batch, mesh, jax.random.PRNGKey(0)))
    exported = _export(step, state, jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch))
    # The update's outputs: the state and the metrics, the non-finite flag among them.
    out_state, metrics = jax.tree.unflatten(exported.out_tree, exported.out_avals)
    assert "nonfinite" in metrics and "loss" in metrics
    assert jax.tree.structure(out_state) == jax.tree.structure(state)


def _params(model, batch):
    return jax.eval_shape(lambda: model.init(jax.random.key(0), batch, train=False)["params"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name, preset", MODELS)
def test_decoding_and_the_predict_program_lower_for_gpu_and_tpu(name, preset, dtype):
    config, model, batch = _setup(name, preset)
    params = _params(model, batch)
    conditioning = {k: batch[f"{k}_semantic"] for k in model.conditioning_shapes}
    spec = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    for decode in (ml_collections.ConfigDict({"sample": False, "beam_size": 1}),
                   ml_collections.ConfigDict({"sample": False, "beam_size": 2,
                                              "length_penalty": 0.6})):
        exported = _export(jax.jit(lambda p, b, a, c, decode=decode: search.decode_ids(
            model, p, b, a, decode_config=decode, max_len=CAPTION_LEN, key=jax.random.key(0),
            conditioning=c, compute_dtype=jnp.dtype(dtype))),
            spec(params), spec(batch["before"]), spec(batch["after_semantic"]), spec(conditioning))
        (ids,) = jax.tree.leaves(exported.out_avals)
        assert ids.shape[0] == batch["before"].shape[0]
    if conditioning:  # predict serves only models that read the two images alone
        return
    ids = jax.ShapeDtypeStruct((batch["before"].shape[0], CAPTION_LEN), jnp.int32)
    exported = _export(jax.jit(lambda p, b, a, i: attention_maps._word_attention(
        model, {"params": p}, b, a, i, {})),
        spec(params), spec(batch["before"]), spec(batch["after_semantic"]), ids)
    (weights,) = exported.out_avals
    assert weights.shape[0] == batch["before"].shape[0]
