"""``python -m changecap_jax.benchmark --compare_official=PATH``: the OFFICIAL PyTorch train step
of DIRL+CCR or SCORER+CBR, imported from a local checkout of its repository, timed beside the
jitted train step.

PATH is a checkout of tuyunbin/DIRL (for ``configs/dirl.py``) or tuyunbin/SCORER (for
``configs/scorer.py``); nothing is copied from it and nothing in it is written. Its modules are
built as the official CLEVR-Change training scripts build them (DIRL: ``train_clevr_change.py``
with ``configs/dynamic/transformer_clevr_change.yaml``: ``DIRL``, ``CCR`` from
``models/CCR_no_init.py``, ``AddSpatialInfo``; SCORER: ``train.py`` with
``configs/dynamic/transformer.yaml``: ``ChangeDetector``, ``Speaker``, ``CBR``), with the
official optimiser (``utils.utils.build_optimizer``), and one step is the body of their training
iteration: spatial coordinates, both pairs, the official loss weights, backward, the optimiser
step (SCORER: and its logit-scale clamps). The training scripts themselves are not imported
(they parse argv, pick a GPU and open data files when imported). Their hard-coded ``.cuda()``
calls are made no-ops while the official code runs, so the step runs on the CPU.

The batches are the benchmark's own, converted as the official CLEVR-Change loader builds them
(features channels first; caption mask over START..END; targets shifted, -1 where ignored).
The two sides start from different weights (each its own initialisation), so their first-step
losses agree in magnitude only. Timing: one untimed step each, then ``steps`` alternating
rounds (JAX, official); the ratio of the medians, official / JAX, is above 1 when JAX is
faster. docs/performance.md, "Against the official code".
"""

from __future__ import annotations

import contextlib
import importlib
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np

from changecap_jax.errors import UserError

# Top-level names of the official repositories that clash with this project's (``configs``) or
# with other installed packages; the official ``configs/`` and ``models/`` are namespace
# packages, which any regular package of the same name on sys.path would shadow.
OFFICIAL_PACKAGES = ("configs", "models", "utils", "datasets")


class OfficialError(UserError):
    """A checkout or a config the official comparison cannot use."""


@dataclass(frozen=True)
class Recipe:
    yaml: str  # the official CLEVR-Change config, relative to the checkout
    modules: tuple[str, ...]  # configs module first, utils module last
    loss_weights: dict[str, float]  # the training script's total-loss weights


RECIPES = {
    # train_clevr_change.py: total = speaker + 0.5 * dirl + 0.3 * ccr
    "dirl": Recipe("configs/dynamic/transformer_clevr_change.yaml",
                   ("configs.config_transformer", "models.DIRL", "models.CCR_no_init",
                    "utils.utils"),
                   {"dirl": 0.5, "ccr": 0.3}),
    # train.py: total = speaker + 0.1 * sim + 0.001 * cbr
    "scorer": Recipe("configs/dynamic/transformer.yaml",
                     ("configs.config_transformer", "models.SCORER",
                      "models.transformer_decoder", "models.CBR", "utils.utils"),
                     {"sim": 0.1, "cbr": 0.001}),
}


def _module_file(root: Path, name: str) -> Path:
    return root.joinpath(*name.split(".")).with_suffix(".py")


def check_checkout(config: ml_collections.ConfigDict, root: str | os.PathLike) -> Path:
    """The checkout's path, once it holds every file the config's model needs and the config
    is one the official step computes (two pairs per example, float32)."""
    name = config.model.name
    if name not in RECIPES:
        raise OfficialError(f"--compare_official: no official step for model {name!r} "
                            f"(only {sorted(RECIPES)})")
    if config.model.get("pairs", "both") != "both":
        raise OfficialError("--compare_official times the CLEVR-Change step (both pairs of an "
                            "example): use the config's clevr_change preset")
    if config.get("compute_dtype", "float32") != "float32":
        raise OfficialError("--compare_official compares float32 steps: set "
                            "--config.compute_dtype=float32")
    path = Path(root).expanduser().resolve()
    recipe = RECIPES[name]
    needed = [path / recipe.yaml, *(_module_file(path, m) for m in recipe.modules)]
    missing = [str(p) for p in needed if not p.is_file()]
    if missing:
        raise OfficialError(f"--compare_official={root}: not a checkout of the official {name} "
                            f"repository: missing {', '.join(missing)}")
    return path


@contextlib.contextmanager
def _cpu_cuda_calls() -> Iterator[None]:
    """``Tensor.cuda()`` / ``Module.cuda()`` as no-ops while the official code runs."""
    import torch

    saved = torch.Tensor.cuda, torch.nn.Module.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.Tensor.cuda, torch.nn.Module.cuda = saved


def import_official(root: Path, names: tuple[str, ...]) -> list[Any]:
    """Imports ``names`` from the checkout ``root``; afterwards ``sys.path`` and ``sys.modules``
    are as before for every clashing name (the returned modules stay usable), and no bytecode
    is written into the checkout."""
    def clashes(module: str) -> bool:
        return module.split(".")[0] in OFFICIAL_PACKAGES

    saved_modules = {k: sys.modules.pop(k) for k in list(sys.modules) if clashes(k)}
    saved_path, saved_bytecode = sys.path[:], sys.dont_write_bytecode
    sys.dont_write_bytecode = True
    def holds_a_clashing_name(entry: str) -> bool:
        folder = Path(entry or ".")
        return any((folder / n).exists() or (folder / f"{n}.py").exists()
                   for n in OFFICIAL_PACKAGES)

    sys.path[:] = [str(root)] + [p for p in saved_path if not holds_a_clashing_name(p)]
    importlib.invalidate_caches()
    try:
        return [importlib.import_module(n) for n in names]
    finally:
        sys.path[:] = saved_path
        sys.dont_write_bytecode = saved_bytecode
        for k in [k for k in sys.modules if clashes(k)]:
            del sys.modules[k]
        sys.modules.update(saved_modules)
        importlib.invalidate_caches()


def _check_sizes(cfg: Any, yaml: Path, batch: dict[str, np.ndarray], hidden_dim: int,
                 vocab_size: int) -> None:
    """The official config's sizes against the benchmark's data and model."""
    channels = batch["before"].shape[-1]
    caption_len = batch["change_caption"].shape[1]
    enc, dec = cfg.model.transformer_encoder, cfg.model.transformer_decoder
    for key, theirs, ours, what in (
            ("transformer_encoder.feat_dim", enc.feat_dim, channels + 2,
             "feature channels + 2 coordinates"),
            ("transformer_encoder.att_dim", enc.att_dim, hidden_dim, "model.hidden_dim"),
            ("transformer_decoder.vocab_size", dec.vocab_size, vocab_size, "vocabulary size")):
        if theirs != ours:
            raise OfficialError(f"{yaml}: model.{key} is {theirs}, the benchmark's {what} "
                                f"{ours}")
    if dec.seq_length < caption_len:
        raise OfficialError(f"{yaml}: model.transformer_decoder.seq_length is "
                            f"{dec.seq_length}, shorter than the benchmark's captions "
                            f"({caption_len})")


def _official_caption(ids: np.ndarray) -> tuple[Any, Any, Any]:
    """(seq, labels_with_ignore, mask) as the official CLEVR-Change loader builds them."""
    import torch

    seq = torch.as_tensor(np.array(ids), dtype=torch.int64)
    length = (seq != 0).sum(1, keepdim=True)
    position = torch.arange(seq.shape[1])[None]
    mask = (position < length).float()
    nxt = torch.where(position[:, 1:] < length, seq[:, 1:], torch.full_like(seq[:, 1:], -1))
    return seq, torch.cat([nxt, torch.full_like(seq[:, :1], -1)], 1), mask


class OfficialStep:
    """One official training iteration (module docstring) on a fixed converted batch."""

    def __init__(self, name: str, root: Path, batch: dict[str, np.ndarray], hidden_dim: int,
                 vocab_size: int, threads: int = 0, seed: int = 1111):
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.name, self.root, self.recipe = name, root, RECIPES[name]
        mods = import_official(root, self.recipe.modules)
        config_module, self.utils = mods[0], mods[-1]
        config_module.merge_cfg_from_file(str(root / self.recipe.yaml))
        self.cfg = cfg = config_module.cfg
        _check_sizes(cfg, root / self.recipe.yaml, batch, hidden_dim, vocab_size)

        def channels_first(x: np.ndarray) -> Any:
            return torch.as_tensor(np.ascontiguousarray(np.transpose(x, (0, 3, 1, 2))))

        self.images = tuple(channels_first(batch[k])
                            for k in ("before", "after_semantic", "after_distractor"))
        self.captions = (_official_caption(batch["change_caption"]),
                         _official_caption(batch["no_change_caption"]))
        random.seed(seed)  # the training scripts' seeds, before the modules are built
        np.random.seed(seed)
        torch.manual_seed(seed)
        with _cpu_cuda_calls():
            if name == "dirl":
                _, dirl, ccr, _ = mods
                self.detector, self.speaker = dirl.DIRL(cfg), ccr.CCR(cfg)
                self.spatial, self.extra = dirl.AddSpatialInfo(), None
            else:
                _, scorer, decoder, cbr, _ = mods
                self.detector, self.speaker = scorer.ChangeDetector(cfg), decoder.Speaker(cfg)
                self.spatial, self.extra = scorer.AddSpatialInfo(), cbr.CBR(cfg)
                self.cross_entropy = self.utils.CrossEn()
        # As the scripts: the optimiser holds detector and speaker (not SCORER's CBR).
        params = list(self.detector.parameters()) + list(self.speaker.parameters())
        self.optimizer = self.utils.build_optimizer(params, cfg)
        self.utils.set_mode("train", [self.detector, self.speaker])
        self.threads = torch.get_num_threads()

    def _losses(self, before: Any, afters: tuple[Any, Any]) -> dict[str, Any]:
        """Per pair (semantic, distractor), averaged 0.5 / 0.5 as the scripts do."""
        parts: dict[str, Any] = {}
        for after, (seq, targets, mask) in zip(afters, self.captions, strict=True):
            if self.name == "dirl":
                diff_before, diff_after, dirl = self.detector(before, after)
                caption, _, ccr = self.speaker._forward(diff_before, diff_after, seq, mask,
                                                        labels_with_ignore=targets)
                pair = {"caption": caption, "dirl": dirl, "ccr": ccr}
            else:
                encoded, sim1, sim2, bef, aft = self.detector(before, after)
                caption, _, _, sentence = self.speaker._forward(encoded, seq, mask,
                                                                labels_with_ignore=targets)
                pair = {"caption": caption,
                        "sim": (self.cross_entropy(sim1) + self.cross_entropy(sim2)) / 2.0,
                        "cbr": self.extra(bef, sentence, aft, mask)}
            for k, v in pair.items():
                parts[k] = parts.get(k, 0.0) + 0.5 * v
        return parts

    def __call__(self) -> float:
        import torch

        with _cpu_cuda_calls():
            before, *afters = (self.spatial(x) for x in self.images)
            self.optimizer.zero_grad()
            parts = self._losses(before, tuple(afters))
            total = parts["caption"] + sum(w * parts[k]
                                           for k, w in self.recipe.loss_weights.items())
            loss = float(total.item())
            total.backward()
            clip = self.cfg.train.grad_clip
            if clip != -1.0:
                torch.nn.utils.clip_grad_norm_(self.detector.parameters(), clip)
                torch.nn.utils.clip_grad_norm_(self.speaker.parameters(), clip)
            self.optimizer.step()
            if self.name == "scorer":  # train.py clamps the two logit scales after the step
                for scale in (self.detector.scorer[-1].attention.logit_scale,
                              self.extra.contra.logit_scale):
                    torch.clamp_(scale.data, max=float(np.log(100)))
        return loss


def prepare(config: ml_collections.ConfigDict, setup: Any, root: str | os.PathLike,
            threads: int = 0) -> OfficialStep:
    """The official step of ``config``'s model on the benchmark's first batch."""
    path = check_checkout(config, root)
    try:
        import torch  # noqa: F401
    except ImportError as e:
        raise OfficialError("--compare_official needs PyTorch: pip install -r "
                            "requirements-torch.txt") from e
    host = {k: np.asarray(v) for k, v in jax.device_get(setup.batches[0]).items()}
    return OfficialStep(config.model.name, path, host, config.model.hidden_dim,
                        setup.model.vocab_size, threads)


def compare(step: OfficialStep, setup: Any, steps: int) -> dict[str, Any]:
    """One untimed step each, then ``steps`` alternating rounds (JAX step, official step);
    ``setup.compiled_step`` is the compiled JAX step."""
    first = step()
    state = setup.state

    def jax_step() -> None:
        nonlocal state
        state, metrics = setup.compiled_step(state, setup.batches[0])
        jax.block_until_ready(metrics)

    jax_step()
    jax_times, official_times = [], []
    for _ in range(steps):
        for fn, times in ((jax_step, jax_times), (step, official_times)):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    setup.state = state  # the old state was donated to the step
    official_s, jax_s = statistics.median(official_times), statistics.median(jax_times)
    return {"official_repo": str(step.root), "official_yaml": step.recipe.yaml,
            "official_step_s": official_s, "official_jax_step_s": jax_s,
            "official_over_jax": official_s / jax_s, "official_steps": steps,
            "official_threads": step.threads, "official_loss_first_step": first}
