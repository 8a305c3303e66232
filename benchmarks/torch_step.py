"""``python -m benchmarks.vs_pytorch --torch``: the project's torch reference of the config's
model (tools/torch_reference) timed beside the jitted train step.

Same model and sizes, same initial weights (the reference's, copied into the JAX state through
the model's converter table before the first JAX step), the same batches (the JAX step's,
converted to the official layout), the same optimiser settings; one untimed step each, then
``steps`` rounds of one JAX step and one torch step, alternating so that both see the same
machine load. The ratio of the medians, torch / JAX, is above 1 when the JAX step is faster
(docs/performance.md). PyTorch is imported by ``torch_reference`` only when this runs.
"""

from __future__ import annotations

import statistics
from typing import Any

import flax.traverse_util
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from benchmarks.alternating import alternate_with_jax_step
from changecap_jax.commands.benchmark import timed
from changecap_jax.convert import registry, tables
from changecap_jax.data.streams import BEFORE, STREAMS
from changecap_jax.decoding import search
from changecap_jax.trainers import optimizers
from tools import torch_reference
from tools.torch_reference import TorchReferenceError


def data_sizes(model: Any, batch: dict[str, Any]) -> tables.Sizes:
    """The data's sizes, read from a training batch of the JAX step."""
    _, height, width, channels = batch[BEFORE].shape
    caption_len = batch[STREAMS[model.streams[0]].caption].shape[1]
    return tables.Sizes(model.vocab_size, caption_len, channels, height, width,
                        "the benchmark's batch")


def check_config(config: ml_collections.ConfigDict) -> None:
    """A model the torch reference can build, PyTorch installed, float32 on both sides: checked
    before any data is read or step compiled."""
    torch_reference.check_model(config.model)
    dtype = config.get("compute_dtype", "float32")
    if dtype != "float32":
        raise TorchReferenceError(
            f"--torch compares float32 steps (the torch reference computes in float32); "
            f"the config computes in {dtype}: set --config.compute_dtype=float32")


def shared_params(config: ml_collections.ConfigDict, sizes: tables.Sizes, step: Any,
                  params: Any) -> Any:
    """``params`` (ours, replicated) with the reference's initial weights, mapped by the
    model's converter table; every parameter must get one, of its shape."""
    entries = registry.converter_for(config.model.name).table(config.model, sizes)
    theirs = tables.apply_table(entries, step.states())
    ours = flax.traverse_util.flatten_dict(params, sep="/")
    if set(theirs) != set(ours):
        raise TorchReferenceError(
            f"the converter table maps the torch reference onto other parameters than the "
            f"model's: missing {sorted(set(ours) - set(theirs))}, extra "
            f"{sorted(set(theirs) - set(ours))}")
    wrong = [k for k, v in ours.items() if v.shape != theirs[k].shape]
    if wrong:
        raise TorchReferenceError(f"the torch reference's weights differ in shape from the "
                                  f"model's at {wrong}")
    out = {k: jax.device_put(np.asarray(theirs[k], v.dtype), v.sharding)
           for k, v in ours.items()}
    return flax.traverse_util.unflatten_dict(out, sep="/")


def prepare(config: ml_collections.ConfigDict, setup: Any, threads: int = 0) -> Any:
    """Builds the reference (``torch_reference.train_step.ReferenceStep``, with ``threads``
    torch CPU threads, 0: torch's default) and gives ``setup.state`` its initial weights; call
    it before the first JAX step. The step keeps a copy of those JAX weights
    (``initial_params``) for :func:`compare_decode`: the train step donates its state."""
    check_config(config)
    host = jax.device_get(setup.batches[0])
    sizes = data_sizes(setup.model, host)
    step = torch_reference.reference_step(config, sizes, jax.devices()[0].platform, threads)
    params = shared_params(config, sizes, step, setup.state.params)
    setup.state = setup.state.replace(params=params)
    step.initial_params = jax.tree.map(jnp.copy, params)
    return step


def compare(step: Any, setup: Any, config: ml_collections.ConfigDict, steps: int,
            steps_per_epoch: int) -> dict[str, Any]:
    """One untimed step each, then ``steps`` alternating timed rounds (JAX step, torch step)
    on the same cycled batches. ``setup.compiled_step`` is the compiled JAX step; the torch
    side follows the config's learning-rate schedule from its own first update."""
    schedule = optimizers.learning_rate_schedule(config.optim, steps_per_epoch)
    rates = [float(schedule(k)) for k in range(steps + 1)]
    batches = [step.batch(jax.device_get(b)) for b in setup.batches]
    torch_first = step(batches[0], rates[0])
    jax_s, torch_s = alternate_with_jax_step(
        setup, setup.batches, lambda k: step(batches[(k + 1) % len(batches)], rates[k + 1]),
        steps)
    return {"torch_step_s": torch_s, "torch_jax_step_s": jax_s, "torch_over_jax": torch_s / jax_s,
            "torch_threads": step.threads, "torch_device": step.device.type,
            "torch_loss_first_step": torch_first, "torch_steps": steps}


def compare_decode(step: Any, setup: Any, rounds: int) -> dict[str, Any]:
    """Greedy decoding of the benchmark's eval batch by both sides from the shared initial
    weights: one untimed call each (JAX's compile), then ``rounds`` alternating timed rounds
    (JAX, torch). The reference decodes as the official test loop does (encoder, then the
    whole decoder rerun on the prefix at every step); the JAX side is evaluation's cached
    greedy decoding. Also returns the share of captions the two sides decode identically and
    the largest difference of a chosen token's log-probability."""
    inputs = setup.decode_inputs
    if inputs["conditioning"]:
        raise TorchReferenceError("the torch reference decodes models without extra inputs only")
    step.restore_initial()
    variables = {"params": step.initial_params}
    before_host, after_host = jax.device_get((inputs["before"], inputs["after"]))

    def jax_decode() -> Any:
        out = search.greedy_decode(setup.model, variables, inputs["before"], inputs["after"],
                                     max_len=setup.max_len)
        return jax.block_until_ready(out)

    def torch_decode() -> tuple[np.ndarray, np.ndarray]:
        return step.greedy(before_host, after_host, setup.max_len)

    ours = jax.device_get(jax_decode())
    theirs_ids, theirs_log_probs = torch_decode()
    jax_times, torch_times = [], []
    for _ in range(rounds):
        jax_times.append(timed(jax_decode))
        torch_times.append(timed(torch_decode))
    same = np.all(np.asarray(ours.ids) == theirs_ids, axis=1)
    torch_s, jax_s = statistics.median(torch_times), statistics.median(jax_times)
    return {"torch_decode_s": torch_s, "torch_decode_jax_s": jax_s,
            "torch_decode_over_jax": torch_s / jax_s, "torch_decode_rounds": rounds,
            "torch_decode_pairs": int(len(same)),
            "torch_decode_same_captions": float(same.mean()),
            "torch_decode_max_log_prob_diff": float(
                np.max(np.abs(np.asarray(ours.log_probs) - theirs_log_probs)))}


class TorchComparison:
    """The torch reference as a side of ``benchmark.run`` (``comparisons``), with ``threads``
    CPU threads (0: torch's default)."""

    def __init__(self, threads: int = 0):
        self.threads = threads
        self.reference: Any = None

    def check_config(self, config: ml_collections.ConfigDict) -> None:
        check_config(config)

    def prepare(self, config: ml_collections.ConfigDict, setup: Any) -> None:
        self.reference = prepare(config, setup, self.threads)

    def compare(self, setup: Any, config: ml_collections.ConfigDict, steps: int,
                decode_batches: int, steps_per_epoch: int) -> dict[str, Any]:
        results = compare(self.reference, setup, config, steps, steps_per_epoch)
        if decode_batches > 0:
            results.update(compare_decode(self.reference, setup, decode_batches))
        return results


def torch_lines(r: dict[str, Any]) -> list[str]:
    """The lines of the torch comparison (none without it)."""
    if r.get("torch_step_s") is None:
        return []
    threads = f"{r['torch_threads']} torch thread{'' if r['torch_threads'] == 1 else 's'}"
    return [f"torch reference: median {r['torch_step_s']:.3f} s/step; torch/jax ratio "
            f"{r['torch_over_jax']:.2f} (>1: JAX faster); {threads} on {r['torch_device']} "
            f"(JAX {r['torch_jax_step_s']:.3f} s/step in the same {r['torch_steps']} "
            "alternating rounds)",
            f"first-step loss, same weights and batch: torch {r['torch_loss_first_step']:.6f}, "
            f"jax {r['loss_first_step']:.6f}"] + torch_decode_lines(r)


def torch_decode_lines(r: dict[str, Any]) -> list[str]:
    """The decoding lines of the torch comparison (none when no decoding was timed)."""
    if r.get("torch_decode_s") is None:
        return []
    return [f"torch reference greedy decode: median {r['torch_decode_s']:.3f} s per batch of "
            f"{r['torch_decode_pairs']}; torch/jax ratio {r['torch_decode_over_jax']:.2f} "
            f"(JAX {r['torch_decode_jax_s']:.3f} s in the same {r['torch_decode_rounds']} "
            "alternating rounds)",
            f"same initial weights: {100 * r['torch_decode_same_captions']:.1f}% of the captions "
            f"identical, largest log-prob difference {r['torch_decode_max_log_prob_diff']:.2e}"]
