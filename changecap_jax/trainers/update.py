"""The one update step of every task: the train state, the jitted (state, batch) -> (state,
metrics) update built from a task's loss, and the gradient row mask it may apply.

Captioning (``trainers/caption_step.py``) and pretraining (``models/idc_pcl_pretraining.py``) both
build their steps with :func:`make_update_step`; only the loss differs.

Section numbers (§) refer to docs/official/ (see its README.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.struct
import flax.traverse_util
import jax
import jax.numpy as jnp
import optax

from changecap_jax import parallel

# The metric of every update that says whether it left the state non-finite (1) or, when
# non-finite updates are skipped, whether it was skipped (1); the loop reads it before every
# save (loop.FiniteGuard).
NONFINITE_METRIC = "nonfinite"
LossFn = Callable[[Any, dict, jax.Array], tuple[jax.Array, dict]]  # (params, batch, rng)


@flax.struct.dataclass
class TrainState:
    """Everything a step changes; checkpointed with the data iterators' state.

    ``rng`` is the run's base key (raw uint32): step t draws its dropout keys from
    ``fold_in(rng, t)``, so a resumed run repeats an uninterrupted run's keys exactly.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array


def zero_gradient_rows(grads: Any, rows: dict[str, int]) -> Any:
    """Zeroes given rows of parameters (torch's padding_idx gradient mask, reference §1.2)."""
    if not rows:
        return grads
    flat = flax.traverse_util.flatten_dict(grads, sep="/")
    for path, row in rows.items():
        if path not in flat:
            raise KeyError(f"optim.zero_grad_rows names {path!r}, which is not a parameter; "
                           f"parameters: {sorted(flat)[:20]}...")
        flat[path] = flat[path].at[row].set(0.0)
    return flax.traverse_util.unflatten_dict(flat, sep="/")


def all_finite(*trees: Any) -> jax.Array:
    """Whether every element of every floating leaf is finite, as one boolean.

    Sums each leaf (an inf or NaN makes its sum non-finite): one read of the new parameters,
    0.4 % of the DIRL+CCR paper-preset step's memory traffic by XLA's count. A sum can
    overflow to inf only for a leaf of values near float32's limit, which a training run
    that is not diverging does not hold.
    """
    # At least float32 (a float64 run keeps float64: nothing narrows its step).
    sums = [jnp.sum(x, dtype=jnp.promote_types(x.dtype, jnp.float32)) for tree in trees
            for x in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack([jnp.isfinite(x) for x in sums])) if sums else jnp.bool_(True)


def make_update_step(loss_fn: LossFn, optimizer: Any, mesh: Any, schedule: Any, *,
                     zero_grad_rows: dict[str, int] | None = None,
                     post_update: Callable[[Any], Any] | None = None,
                     with_grads: bool = False, skip_nonfinite: bool = False) -> Any:
    """The jitted update (state, global batch) -> (state, metrics); with ``with_grads`` the
    gradients come back as a third output (for tests: one compile gives both).

    ``loss_fn`` is formed over the GLOBAL batch (inside ``shard_map``) and receives the step's
    key ``fold_in(state.rng, state.step)``. ``zero_grad_rows`` masks gradient rows before the
    optimiser; ``post_update`` constrains the parameters after it (e.g. clamping a logit scale
    to log 100, as the official loop does after optimizer.step()).

    ``metrics[NONFINITE_METRIC]`` is 1 when the loss or the updated parameters hold an inf or
    NaN (a non-finite gradient makes them so), else 0. With ``skip_nonfinite`` such an update
    is not applied: the parameters and optimiser state stay as they were (the step count still
    advances), and the metric says the step was skipped.
    """
    rows = dict(zero_grad_rows or {})

    # Named for the trace: profiles and HLO dumps call the program jit_train_step.
    def train_step(state: TrainState, batch: dict) -> tuple:
        step_rng = jax.random.fold_in(state.rng, state.step)
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state.params, batch, step_rng)
        grads = zero_gradient_rows(grads, rows)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        if post_update is not None:
            params = post_update(params)
        # A non-finite gradient makes the Adam-style update, hence the parameters, non-finite:
        # checking the new parameters alone also catches it, with one pass instead of two.
        finite = all_finite(loss, params)
        if skip_nonfinite:
            keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
            params = jax.tree_util.tree_map(keep, params, state.params)
            opt_state = jax.tree_util.tree_map(keep, opt_state, state.opt_state)
        metrics[NONFINITE_METRIC] = jnp.logical_not(finite).astype(jnp.int32)
        metrics["learning_rate"] = schedule(state.step)
        new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state,
                               rng=state.rng)
        return (new_state, metrics, grads) if with_grads else (new_state, metrics)

    repl, data = parallel.replicated(mesh), parallel.batch_sharding(mesh)
    return jax.jit(train_step, donate_argnums=0, in_shardings=(repl, data),
                   out_shardings=(repl,) * (3 if with_grads else 2))
