"""The optimiser of every task: Adam (torch's, with its L2 weight decay), optional global-norm
clipping, frozen parameter groups, and the learning-rate schedules of the official recipes.

Section numbers (§) refer to docs/official/ (see its README.md).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax

SCHEDULES = ("step_lr", "piecewise", "noam")


def learning_rate_schedule(optim: ml_collections.ConfigDict, steps_per_epoch: int) -> Any:
    """The learning rate of update ``count`` (the number of updates already made).

    ``optim.schedule``:

    * "step_lr" (default): StepLR stepped once per epoch, lr * factor ** floor(epoch /
      decay_every_epochs); update t+1 (1-based) is in epoch floor(t / steps_per_epoch), as the
      official loop (reference §7 item 8). ``decay_every_epochs = 0`` keeps lr constant.
    * "piecewise": lr * factor ** (number of ``optim.boundaries`` <= count), e.g. IDC-PCL's
      fine-tuning 3e-5 / 1.5e-5 / 7.5e-6 at 10k / 20k steps (§5.6).
    * "noam": lr * min(t / warmup, sqrt(warmup / t)) with t = count, and 1e-8 at t = 0, as
      IDC-PCL's pretraining sets it before each step (§5.6).
    """
    kind = optim.get("schedule", "step_lr")
    if kind not in SCHEDULES:
        raise ValueError(f"optim.schedule must be one of {SCHEDULES}, got {kind!r}")
    base = optim.learning_rate
    if kind == "noam":
        warmup = float(optim.warmup_steps)
        if warmup <= 0:
            raise ValueError(f"optim.warmup_steps must be > 0 for the noam schedule, got {warmup}")

        def noam(count: jax.Array) -> jax.Array:
            t = jnp.asarray(count, float)  # the default float: float32, float64 in x64
            lr = base * jnp.minimum(t / warmup, jnp.sqrt(warmup / jnp.maximum(t, 1.0)))
            return jnp.where(t > 0, lr, 1e-8)

        return noam
    if kind == "piecewise":
        boundaries = jnp.asarray(sorted(optim.boundaries), jnp.int32)

        def piecewise(count: jax.Array) -> jax.Array:
            passed = jnp.sum(jnp.asarray(count, jnp.int32) >= boundaries)
            return base * optim.decay_factor ** passed.astype(float)

        return piecewise
    if not optim.decay_every_epochs:
        return optax.constant_schedule(base)
    step_lr = optax.exponential_decay(
        base,
        transition_steps=optim.decay_every_epochs * steps_per_epoch,
        decay_rate=optim.decay_factor,
        staircase=True,
    )
    # The count as the default int (int32; int64 in x64), so that optax's count / steps is
    # float64 in an x64 run (docs/reproduce.md) instead of int32 / steps = float32.
    return lambda count: step_lr(jnp.asarray(count, int))


def frozen_labels(params: Any, frozen: tuple[str, ...] | list[str]) -> Any:
    """"frozen" for every parameter under one of the ``frozen`` top-level names, else
    "trained" (e.g. a module the official code keeps outside its optimiser)."""
    tops = set(params)
    unknown = sorted(set(frozen) - tops)
    if unknown:
        raise KeyError(f"optim.frozen names {unknown}, which are not top-level parameter "
                       f"groups; groups: {sorted(tops)}")
    return {k: jax.tree.map(lambda _, k=k: "frozen" if k in frozen else "trained", v)
            for k, v in params.items()}


def make_optimizer(optim: ml_collections.ConfigDict, steps_per_epoch: int) -> Any:
    """Adam with the StepLR schedule; ``optim.frozen`` top-level groups are never updated
    (and hold no Adam moments)."""
    schedule = learning_rate_schedule(optim, steps_per_epoch)
    chain = []
    if optim.grad_clip_norm:
        chain.append(optax.clip_by_global_norm(optim.grad_clip_norm))
    if optim.get("weight_decay", 0.0):
        # torch Adam's weight_decay: an L2 term added to the gradient before the moments.
        chain.append(optax.add_decayed_weights(optim.weight_decay))
    chain.append(optax.adam(schedule, b1=optim.b1, b2=optim.b2, eps=optim.eps))
    optimizer = optax.chain(*chain)
    frozen = tuple(optim.get("frozen", ()))
    if frozen:
        optimizer = optax.multi_transform(
            {"trained": optimizer, "frozen": optax.set_to_zero()},
            lambda params: frozen_labels(params, frozen))
    return optimizer, schedule
