"""The captioning loss and update step, and a fresh train state: what a training step needs,
without the dataset, the evaluators or the loop.

``captioning.py`` (the trainer) builds on these; the tools that time or run the step on inputs
they make themselves (the benchmark's synthetic inputs, the GPU check) import this module
alone, so they run where the dataset and evaluation libraries (TFDS, grain, pycocoevalcap) are
not installed.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from changecap_jax import parallel
from changecap_jax.models import contract, precision
from changecap_jax.models.base import INPUTS_FOLD
from changecap_jax.models.losses import caption_cross_entropy
from changecap_jax.trainers.update import TrainState, make_update_step

INIT_FOLD = 0x1A17  # parameters are initialised from fold_in(seed key, INIT_FOLD)


# ---------------------------------------------------------------------------------------------
# Loss and update step
# ---------------------------------------------------------------------------------------------


def make_loss_fn(model: Any, loss_weights: dict[str, float], mesh: Any,
                 compute_dtype: Any = jnp.float32) -> Any:
    """(params, batch, rng) -> (total loss, metrics), formed over the GLOBAL batch.

    The model runs inside ``shard_map`` on each device's share; its batch-wide losses gather
    what they need over the ``data`` axis, and the caption cross-entropy divides by the global
    count of real tokens, so the result equals a single-device computation. The parameters and
    the floating inputs are cast to ``compute_dtype`` inside the differentiated function, so
    gradients come back in the parameters' float32 (changecap_jax/models/precision.py).
    """
    axis = parallel.DATA_AXIS

    def per_device(params: Any, batch: dict, rng: jax.Array) -> tuple[jax.Array, dict]:
        params, batch = precision.cast_floating((params, batch), compute_dtype)
        # Each device draws its own dropout masks; "inputs" is the same key everywhere, so
        # per-example input corruption can fold in the global example index (models/base.py).
        dropout_rng = jax.random.fold_in(rng, jax.lax.axis_index(axis))
        out = model.apply({"params": params}, batch, train=True, axis_name=axis,
                          rngs={"dropout": dropout_rng,
                                "inputs": jax.random.fold_in(rng, INPUTS_FOLD)})
        unknown = set(out.aux_losses) ^ set(loss_weights)
        if unknown:
            raise ValueError(
                f"config.loss_weights {sorted(loss_weights)} must name exactly the model's "
                f"auxiliary losses {sorted(out.aux_losses)}"
            )
        reduction = out.caption_reduction
        ce = {s: caption_cross_entropy(out.caption_logits[s], out.caption_targets[s],
                                       axis_name=axis, reduction=reduction)
              for s in out.caption_logits}
        caption = sum(ce.values()) / (len(ce) if reduction == "mean" else 1)
        total = caption + sum(loss_weights[k] * v for k, v in out.aux_losses.items())
        metrics = {"loss": total, "loss/caption": caption,
                   **{f"loss/caption_{s}": v for s, v in ce.items()},
                   **{f"loss/{k}": v for k, v in out.aux_losses.items()}}
        return total, metrics

    sharded = jax.shard_map(
        per_device, mesh=mesh, in_specs=(P(), P(axis), P()), out_specs=(P(), P()),
        check_vma=False,
    )
    return sharded


def make_train_step(
    model: Any, optimizer: Any, loss_weights: dict[str, float], mesh: Any,
    zero_grad_rows: dict[str, int], schedule: Any, *, with_grads: bool = False,
    compute_dtype: Any = jnp.float32, skip_nonfinite: bool = False,
) -> Any:
    """The jitted update (state, global batch) -> (state, metrics) of captioning
    (``update.make_update_step`` over :func:`make_loss_fn`); with ``with_grads`` the gradients
    come back as a third output (for tests: one compile gives both)."""
    return make_update_step(
        make_loss_fn(model, loss_weights, mesh, compute_dtype), optimizer, mesh, schedule,
        zero_grad_rows=zero_grad_rows, post_update=contract.post_update_fn(model),
        with_grads=with_grads, skip_nonfinite=skip_nonfinite)


def init_train_state(model: Any, optimizer: Any, example: dict[str, Any], mesh: Any,
                     rng: jax.Array) -> TrainState:
    """Fresh parameters and optimiser state, replicated over ``mesh``. Only the shapes and
    dtypes of ``example`` (one example's fields) matter: the batch is made of zeros inside the
    jitted function, which also works when the mesh spans several processes."""
    shapes = {k: ((1, *np.shape(v)[1:]), v.dtype) for k, v in example.items()}
    init_rng = jax.random.fold_in(rng, INIT_FOLD)

    @functools.partial(jax.jit, out_shardings=parallel.replicated(mesh))
    def init() -> TrainState:
        batch = {k: jnp.zeros(shape, dtype) for k, (shape, dtype) in shapes.items()}
        params = model.init({"params": init_rng}, batch, train=False)["params"]
        return TrainState(step=jnp.int32(0), params=params, opt_state=optimizer.init(params),
                          rng=rng)

    return init()
