"""DIRL+CCR at its synthetic preset trained on the in-memory synthetic pairs (child process):
the loss of every step, on whichever backend the child runs (``JAX_PLATFORMS``)."""

from __future__ import annotations

import time
from typing import Any

from changecap_jax.commands.gpu_check.plan import TRAINED


def run_job(spec: dict[str, Any]) -> dict[str, Any]:
    import jax

    from changecap_jax import models, parallel
    from changecap_jax.commands.gpu_check import synthetic_data
    from changecap_jax.commands.gpu_check.steps import load_config
    from changecap_jax.trainers import caption_step, optimizers

    data = synthetic_data.load(spec["data"])
    config = load_config(*TRAINED)
    config.batch_size = spec["batch"]
    steps = spec["steps"]
    mesh = parallel.make_mesh(1)  # one device on either backend: the same program
    model = models.build(config.model, vocab_size=int(data["vocab_size"]),
                         max_len=config.decode.max_len or data["change_ids"].shape[-1])
    optimizer, schedule = optimizers.make_optimizer(
        config.optim, max(1, data["before"].shape[0] // config.batch_size))
    step = caption_step.make_train_step(model, optimizer, dict(config.loss_weights), mesh,
                                        dict(config.optim.zero_grad_rows), schedule)
    sharding = parallel.batch_sharding(mesh)

    def batch(k: int) -> dict[str, Any]:
        host = synthetic_data.training_batch(data, k, config.batch_size, config.swap_prob)
        return jax.device_put(host, sharding)

    state = caption_step.init_train_state(model, optimizer, batch(0), mesh,
                                          jax.random.PRNGKey(config.seed))
    losses, t0 = [], time.perf_counter()
    for k in range(steps):
        state, metrics = step(state, batch(k))
        losses.append(metrics["loss"])  # fetched at the end: no wait per step
        if k == 0:
            jax.block_until_ready(metrics)
            t1 = time.perf_counter()
    jax.block_until_ready(losses)
    t2 = time.perf_counter()
    return {"backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
            "matmul_precision": str(jax.config.jax_default_matmul_precision),
            "losses": [float(v) for v in jax.device_get(losses)], "batch": config.batch_size,
            "first_step_s": t1 - t0,
            "step_s": (t2 - t1) / (steps - 1) if steps > 1 else None}
