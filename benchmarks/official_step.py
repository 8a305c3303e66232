"""``python -m benchmarks.vs_pytorch --official=CHECKOUT``: the OFFICIAL PyTorch
training iteration, imported from a local checkout of the model's official repository
(tuyunbin/DIRL, tuyunbin/SCORER), timed beside the jitted train step.

The official side is the one ``python -m changecap_jax reproduce`` builds
(changecap_jax/commands/reproduce/): the checkout imported without touching this project's
``configs`` package, its ``.cuda()`` calls made no-ops on the CPU, its yaml with the config's
model sizes, its modules (seeded as the training script seeds them), optimiser, losses and
loss weights.
Unlike ``reproduce``, dropout stays on (as in official training) and the two sides start from
their own initial weights, so their first-step losses agree in magnitude only. One timed
official step is the body of the training loop on the benchmark's first batch, from the
official batch layout (channels first, AddSpatialInfo where the script applies it, targets and
masks as the official loader builds them) to ``optimizer.step()`` and what follows it.

Timing: one untimed step each, then ``steps`` alternating rounds (JAX step, official step); the
ratio of the medians, official / JAX, is above 1 when the JAX step is faster.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np

from benchmarks.alternating import alternate_with_jax_step
from changecap_jax.commands.reproduce import adapters, registry
from changecap_jax.commands.reproduce import official as off
from changecap_jax.commands.reproduce import run as reproduce
from changecap_jax.data.streams import STREAM_KEYS
from changecap_jax.errors import UserError


class OfficialError(UserError):
    """A checkout or a config the official comparison cannot use."""


@dataclass
class OfficialStep:
    """The official modules, optimiser and batch of one benchmark run."""

    root: Path
    yaml: str  # the official config, relative to the checkout
    adapter: adapters.Adapter
    model: adapters.OfficialModel
    cfg: Any
    optimizer: Any
    batch: dict[str, np.ndarray]  # the benchmark's host batch (ours)
    streams: tuple[str, ...]
    notes: list[str]  # where the config trains differently from the official script

    def __call__(self) -> float:
        """One official iteration; returns its total loss."""
        with off.running_official():
            batch = reproduce.torch_batch(self.batch, self.streams, self.model.spatial_info)
            self.optimizer.zero_grad()
            total = self.adapter.losses(self.model, batch)["total"]
            loss = float(total.item())
            total.backward()
            reproduce.clip_gradients(self.model, self.cfg)
            self.optimizer.step()
            self.adapter.after_step(self.model)
        return loss


def prepare(config: ml_collections.ConfigDict, setup: Any, root: str | os.PathLike,
            threads: int = 0) -> OfficialStep:
    """The official step of ``config``'s model at the sizes of the benchmark's first batch,
    with ``threads`` torch CPU threads (0: torch's default)."""
    try:
        import torch
    except ImportError as e:
        raise OfficialError("--official needs PyTorch: pip install -r "
                            "requirements-torch.txt") from e
    if config.get("compute_dtype", "float32") != "float32":
        raise OfficialError("--official compares float32 steps: set "
                            "--config.compute_dtype=float32")
    try:
        adapter = registry.get_adapter(config.model.name)
        if adapter.snapshot_sources != adapters.Adapter.snapshot_sources:
            raise adapters.ReproduceError(
                f"--official times the tuyunbin/DIRL and tuyunbin/SCORER steps; "
                f"{adapter.repository} ({config.model.name}) is compared by reproduce only")
        fitted = ml_collections.ConfigDict(config.to_dict())
        changes = adapter.fit_config(fitted)
        if fitted.to_dict() != config.to_dict():
            raise OfficialError(f"the official code cannot build this config as it is: "
                                f"{'; '.join(changes)}")
        path = Path(root).expanduser().resolve()
        lib = off.import_official(path, adapter.module_names(config.model))
        host = {k: np.asarray(v) for k, v in jax.device_get(setup.batches[0]).items()}
        streams = tuple(setup.model.streams)
        caption_len = max(host[STREAM_KEYS[s][1]].shape[1] for s in streams)
        overrides = adapter.cfg_overrides(config, host["before"].shape[-1],
                                          setup.model.vocab_size, caption_len)
        if threads:
            torch.set_num_threads(threads)
        with off.cuda_is_identity():
            cfg, model, optimizer = reproduce.build_modules(adapter, config, path, lib,
                                                            overrides)
    except (adapters.ReproduceError, off.OfficialCheckoutError) as e:
        raise OfficialError(f"--official: {e}") from e
    for module in model.modules.values():
        module.train()  # as the training loop runs them, dropout on
    return OfficialStep(path, adapter.yaml(config.model), adapter, model, cfg, optimizer, host,
                        streams, changes + adapter.differences(config, cfg))


def compare(step: OfficialStep, setup: Any, steps: int) -> dict[str, Any]:
    """One untimed step each, then ``steps`` alternating rounds (JAX step, official step) on
    the benchmark's first batch; ``setup.compiled_step`` is the compiled JAX step."""
    import torch

    first = step()
    jax_s, official_s = alternate_with_jax_step(setup, setup.batches[:1], lambda k: step(),
                                                steps)
    return {"official_repo": str(step.root), "official_repository": step.adapter.repository,
            "official_yaml": step.yaml,
            "official_step_s": official_s, "official_jax_step_s": jax_s,
            "official_over_jax": official_s / jax_s, "official_steps": steps,
            "official_threads": torch.get_num_threads(), "official_loss_first_step": first,
            "official_notes": step.notes}


class OfficialComparison:
    """The official training iteration of the checkout at ``root`` as a side of
    ``benchmark.run`` (``comparisons``), with ``threads`` torch CPU threads."""

    def __init__(self, root: str | os.PathLike, threads: int = 0):
        self.root, self.threads = root, threads
        self.step: OfficialStep | None = None

    def check_config(self, config: ml_collections.ConfigDict) -> None:
        """``prepare`` checks the config against the checkout."""

    def prepare(self, config: ml_collections.ConfigDict, setup: Any) -> None:
        self.step = prepare(config, setup, self.root, self.threads)

    def compare(self, setup: Any, config: ml_collections.ConfigDict, steps: int,
                decode_batches: int, steps_per_epoch: int) -> dict[str, Any]:
        return compare(self.step, setup, steps)


def official_lines(r: dict[str, Any]) -> list[str]:
    """The lines of the official comparison (none without it)."""
    if r.get("official_step_s") is None:
        return []
    return [f"official step ({r['official_repository']} at {r['official_repo']}, "
            f"{r['official_yaml']}): median {r['official_step_s']:.3f} s/step; official/jax "
            f"ratio {r['official_over_jax']:.2f} (>1: JAX faster); {r['official_threads']} "
            f"torch threads (JAX {r['official_jax_step_s']:.3f} s/step in the same "
            f"{r['official_steps']} alternating rounds)",
            f"first-step loss, each side's own initial weights: official "
            f"{r['official_loss_first_step']:.6f}, jax {r['loss_first_step']:.6f}",
            *(f"official training differs: {note}" for note in r["official_notes"])]
