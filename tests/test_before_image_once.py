"""The "before" image's per-image layers run once per example, not once per pair.

Both pairs of a two-pair example (semantic, distractor) share the before image; DIRL+CCR,
SCORER+CBR, the Subtraction baseline and CHEERS embed it once and both pairs read the result
(docs/models.md, "The before image once per example"). Counted here at trace time: the 1x1
projection (and DIRL's MLP head and first-cross-layer projections) is called three times for
the two pairs (before, after_semantic, after_distractor), in training as in evaluation.
"""

from __future__ import annotations

import functools
import importlib

import flax.linen as nn
import jax
import pytest

from changecap_jax import models
from changecap_jax.commands import synthetic_inputs as si

# config module -> the per-image modules (paths) that must run once per image.
PER_IMAGE = {
    # and the first cross layer's projections of X0: the before image's query (one
    # direction) and keys and values (the other) are the same in both pairs.
    "dirl": ("encoder/img", "encoder/mlp_0", "encoder/mlp_3",
             "encoder/transformer_0/attention/q_proj", "encoder/transformer_0/attention/k_proj",
             "encoder/transformer_0/attention/v_proj"),
    "scorer": ("encoder/img_0",),
    "subtraction": ("encoder/img_0",),
    "cheers": ("img",),
}


@pytest.mark.parametrize("name", sorted(PER_IMAGE))
def test_per_image_layers_run_once_per_image(name):
    config = importlib.import_module(f"configs.{name}").get_config("synthetic")
    config.model.dropout_rate = 0.1  # the synthetic presets train without dropout
    model = models.build(config.model, vocab_size=20, max_len=8)
    batch = si.make_batch(model, 2, (4, 4, 8), 8, 20, seed=0)
    rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    variables = jax.eval_shape(functools.partial(model.init, train=False), rngs, batch)
    calls: dict[str, int] = {}

    def count(next_fun, args, kwargs, context):
        if context.method_name == "__call__":
            path = "/".join(context.module.path)
            calls[path] = calls.get(path, 0) + 1
        return next_fun(*args, **kwargs)

    assert set(model.streams) == {"semantic", "distractor"}
    for train in (True, False):
        calls.clear()
        with nn.intercept_methods(count):
            jax.eval_shape(functools.partial(model.apply, train=train, rngs=rngs),
                           variables, batch)
        got = {path: calls.get(path, 0) for path in PER_IMAGE[name]}
        assert got == {path: 3 for path in PER_IMAGE[name]}, (train, got)
