"""The torch reference's train step, as ``python -m benchmarks.vs_pytorch --torch``
runs it beside the jitted step (docs/performance.md).

Model-agnostic: a model's ``*_step`` module returns a :class:`ReferenceModel` (its modules by
our parameter group and by converter source, its loss terms, what follows the optimiser step);
:class:`ReferenceStep` adds what the project config says about training: Adam with the
config's betas, eps and weight decay, the learning rate the caller passes per step (the
config's schedule), global-norm clipping, ``optim.frozen`` groups outside the optimiser, and the
total ``caption + sum(config.loss_weights[name] * term)``. Batches are the project's (channels
last, caption ids) converted as the official dataset hands them to its models (docs/official/
§2.3 AddSpatialInfo, §2.5 caption masks and targets with ignore index -1).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import ml_collections
import numpy as np
import torch
from torch import Tensor, nn

from changecap_jax.data.streams import BEFORE, STREAMS
from tools.torch_reference import TorchReferenceError
from tools.torch_reference.scorer import (
    add_spatial_info,
    caption_mask,
    labels_with_ignore,
)


@dataclasses.dataclass
class TorchPair:
    """One caption stream's inputs, as the official dataset yields them (§2.5)."""

    after: Tensor  # (B, C, H, W) float32, with the coordinate channels where the model has them
    labels: Tensor  # (B, L) int64 ids, START first
    targets: Tensor  # (B, L) int64 labels_with_ignore (-1 = no loss)
    masks: Tensor  # (B, L) float32, 1 on the first k positions (k = non-zero ids)


@dataclasses.dataclass
class TorchBatch:
    """One step's inputs: the shared "before" grid and each caption stream's pair."""

    before: Tensor
    pairs: dict[str, TorchPair]  # by stream name (data/streams.py), the model's order


def _nothing() -> None:
    pass


@dataclasses.dataclass
class ReferenceModel:
    """A model's torch reference, built at a config's sizes by its ``*_step`` module.

    Attributes:
      groups: our top-level parameter group ("encoder", ...) -> the torch module holding it
        (``optim.frozen`` names groups).
      sources: the model converter's source names -> modules, for
        ``changecap_jax.convert.tables.apply_table`` (same initial weights on both sides).
      streams: the caption streams the model trains on.
      spatial_info: whether the inputs get the two AddSpatialInfo coordinate channels.
      losses: a batch -> ``{"caption": ..., <auxiliary loss>: ...}`` (unweighted means over
        the streams).
      aux_losses: the auxiliary loss names ``losses`` returns (config.loss_weights' keys).
      zero_grad_rows: the embedding rows whose gradient the reference keeps at zero (torch's
        ``padding_idx``), as ``config.optim.zero_grad_rows`` names them.
      after_step: what the official loop does after ``optimizer.step()``.
      greedy: (before, after grids as :meth:`ReferenceStep.batch` converts them, max_len) ->
        the official test-time greedy ``sample()``'s (ids, log_probs), each (B, max_len); the
        modules are in eval mode and gradients off when it is called.
    """

    groups: dict[str, nn.Module]
    sources: dict[str, nn.Module]
    streams: tuple[str, ...]
    spatial_info: bool
    losses: Callable[[TorchBatch], dict[str, Tensor]]
    aux_losses: tuple[str, ...]
    zero_grad_rows: dict[str, int]
    after_step: Callable[[], None] = _nothing
    greedy: Callable[[Tensor, Tensor, int], tuple[Tensor, Tensor]] | None = None


def seed(value: int) -> None:
    """Seeds torch's global generator (initial weights, dropout masks)."""
    torch.manual_seed(value)


def stream_mean(per_stream: Mapping[str, Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """{stream: {term: loss}} -> {term: mean over the streams} (the official 0.5 pos + 0.5 neg
    with two pairs, the value itself with one)."""
    terms = next(iter(per_stream.values()))
    return {t: sum(losses[t] for losses in per_stream.values()) / len(per_stream)
            for t in terms}


def torch_grid(x: np.ndarray, spatial_info: bool, device: torch.device) -> Tensor:
    """(B, H, W, C) channels-last features -> (B, C [+ 2], H, W) float32 on ``device``."""
    # A copy: arrays fetched from JAX are read-only, torch wants to own writable memory.
    grid = torch.from_numpy(np.array(x, np.float32)).permute(0, 3, 1, 2).contiguous().to(device)
    return add_spatial_info(grid) if spatial_info else grid


def torch_pair(after: np.ndarray, ids: np.ndarray, spatial_info: bool,
               device: torch.device) -> TorchPair:
    """One stream's after grid and caption ids -> :class:`TorchPair`."""
    labels = torch.from_numpy(np.array(ids, np.int64)).to(device)
    return TorchPair(torch_grid(after, spatial_info, device), labels,
                     labels_with_ignore(labels), caption_mask(labels))


class ReferenceStep:
    """One training step of a :class:`ReferenceModel`: zero the gradients, losses, backward,
    clip, Adam step, the model's ``after_step``. Modules in training mode (dropout on).
    ``threads`` > 0 sets torch's intra-op CPU threads (0: torch's default)."""

    def __init__(self, model: ReferenceModel, config: ml_collections.ConfigDict,
                 platform: str = "cpu", threads: int = 0) -> None:
        self.model = model
        if threads:
            torch.set_num_threads(threads)  # process-wide, as torch has it
        self.loss_weights = {k: float(v) for k, v in dict(config.loss_weights).items()}
        if set(self.loss_weights) != set(model.aux_losses):
            raise TorchReferenceError(
                f"config.loss_weights {sorted(self.loss_weights)} must name the reference's "
                f"auxiliary losses {sorted(model.aux_losses)}")
        optim = config.optim
        rows = dict(optim.get("zero_grad_rows", {}))
        if rows != model.zero_grad_rows:
            raise TorchReferenceError(
                f"optim.zero_grad_rows is {rows}; the torch reference zeroes the gradient of "
                f"{model.zero_grad_rows} (padding_idx) and no other")
        frozen = set(optim.get("frozen", ()))
        if frozen - set(model.groups):
            raise TorchReferenceError(f"optim.frozen names {sorted(frozen - set(model.groups))}"
                                      f"; the reference's groups: {sorted(model.groups)}")
        # A GPU run of the jitted step is compared with torch on the GPU where torch has one.
        cuda = platform == "gpu" and torch.cuda.is_available()
        self.device = torch.device("cuda" if cuda else "cpu")
        for name, module in model.groups.items():
            module.to(self.device).train()
            module.requires_grad_(name not in frozen)
        self.trained = [p for name, module in model.groups.items() if name not in frozen
                        for p in module.parameters()]
        self.optimizer = torch.optim.Adam(
            self.trained, lr=float(optim.learning_rate), betas=(float(optim.b1), float(optim.b2)),
            eps=float(optim.eps), weight_decay=float(optim.get("weight_decay", 0.0)))
        self.clip_norm = float(optim.get("grad_clip_norm") or 0.0)
        # The weights the JAX state starts from, for a decoding comparison after training steps.
        self.initial = {name: copy.deepcopy(module.state_dict())
                        for name, module in model.groups.items()}

    @property
    def threads(self) -> int:
        """torch's intra-op CPU threads."""
        return torch.get_num_threads()

    def batch(self, batch: Mapping[str, Any]) -> TorchBatch:
        """A host batch of the project (NumPy, channels last) -> the reference's inputs."""
        spatial = self.model.spatial_info
        pairs = {s: torch_pair(batch[STREAMS[s].after], batch[STREAMS[s].caption], spatial,
                               self.device) for s in self.model.streams}
        return TorchBatch(torch_grid(batch[BEFORE], spatial, self.device), pairs)

    def states(self) -> dict[str, dict[str, np.ndarray]]:
        """Converter source -> the module's state_dict as NumPy arrays."""
        return {source: {k: v.detach().cpu().numpy() for k, v in module.state_dict().items()}
                for source, module in self.model.sources.items()}

    def restore_initial(self) -> None:
        """Every module back to the weights it had when the step was built."""
        for name, module in self.model.groups.items():
            module.load_state_dict(self.initial[name])

    def greedy(self, before: np.ndarray, after: np.ndarray,
               max_len: int) -> tuple[np.ndarray, np.ndarray]:
        """Greedy captions (ids, log_probs) of channels-last grids, as the official test loop
        decodes: eval mode (no dropout), no gradients; training mode again afterwards."""
        if self.model.greedy is None:
            raise TorchReferenceError("this torch reference has no greedy decoding")
        spatial = self.model.spatial_info
        grids = (torch_grid(before, spatial, self.device), torch_grid(after, spatial, self.device))
        for module in self.model.groups.values():
            module.eval()
        try:
            with torch.no_grad():
                ids, log_probs = self.model.greedy(*grids, max_len)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
        finally:
            for module in self.model.groups.values():
                module.train()
        return ids.cpu().numpy(), log_probs.cpu().numpy()

    def __call__(self, batch: TorchBatch, learning_rate: float) -> float:
        """One step at ``learning_rate``; returns the total loss before the update."""
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate
        self.optimizer.zero_grad(set_to_none=True)
        terms = self.model.losses(batch)
        total = terms["caption"] + sum(w * terms[k] for k, w in self.loss_weights.items())
        total.backward()
        if self.clip_norm:
            nn.utils.clip_grad_norm_(self.trained, self.clip_norm)
        self.optimizer.step()
        self.model.after_step()
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the step's kernels are done when the call returns
        return float(total.detach())
