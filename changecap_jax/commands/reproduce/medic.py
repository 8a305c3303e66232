"""The ``reproduce`` adapter of DIRL+MEDIC (``VisualAIKHU/MEDIC``, a fork of tuyunbin/DIRL;
docs/models.md "MEDIC", docs/reproduce.md): ``train/train_chg_final.py`` (CLEVR-Change: both
pairs, AddSpatialInfo, yaml ``configs/dynamic/transformer_medic_chg.yaml``) and
``train/train_dc_std_final.py`` (CLEVR-DC / Spot-the-Diff: one pair, no coordinates).

The loop body (the scripts' ``with autocast():`` block): the encoder ``models/model.py`` DIRL
runs on (before, after, labels) and returns the difference features, the DIRL loss, MEDIC's
four losses and the expert features; ``models/CCR_expert.py`` CCR decodes from cat(diff) and the
expert features; the pair means (0.5 / 0.5 with two pairs) weighted as
``caption + 0.03 dirl + 0.05 ccr + lambda_cls cls + lambda_type type + lambda_disentangle
disentangle + lambda_consistency consistency``; the lambdas are the scripts' flags, set here
from ``config.loss_weights`` (the run scripts' values are the presets'). Labels: the pair's
change type as MEDIC's index (``changecap_jax.models.medic.medic_labels``: five types, 5 no
change), given to both sides; random inputs carry none, so each pair gets one from its caption
ids (deterministic, the same on both sides).

Differences kept on purpose (listed by :meth:`MedicAdapter.differences`): the scripts step a
PolyLR (``scheduler.py``) each iteration and run under ``GradScaler`` / ``autocast`` (CUDA only:
no-ops here); the comparison runs the project's schedule on both sides, as for DIRL. The
scripts do not clip gradients. Their ``optimizer.zero_grad()`` under the authors' torch 2.4
(README) sets the gradients to None, and torch's Adam then skips a parameter no loss reaches
in a step: the type classifier and the change experts until some pair is routed to a change
(the type loss is 0 and the routing weights are detached), each expert while no pair of its
type is routed. Optax's Adam (ours) steps them on zero gradients, so their bias-correction
counts differ from then on (measured: the two sides part by 8e-5 in
``medic/type_classifier/conv_0/kernel`` at the first step that routes a pair to a change). The
comparison therefore zeroes the gradients in place (``zero_grads_in_place``, torch 1.x's
``zero_grad``, as for IDC-PCL, docs/reproduce.md) after giving every parameter a zero
gradient, which is what our trainer computes; the difference from a torch 2.4 run is this
offset of those counts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import ml_collections
import numpy as np

from changecap_jax.commands.reproduce.adapters import (
    DirlAdapter,
    OfficialModel,
    OfficialSide,
    ReproduceError,
    TorchBatch,
    official_widths,
    tensor_batch,
    torch_pairs_mean,
)
from changecap_jax.models import medic

# The widths models/model.py hard-codes: 100 memory slots, 512-channel classifiers, 5 types.
FIXED = {"memory_size": 100, "classifier_hidden": 512}
CONFIG_MODULE = "configs.config_transformer_medic"


@dataclasses.dataclass
class MedicBatch(TorchBatch):
    """A batch with each stream's MEDIC labels (B,) int64, as ``aux_labels_pos/neg``."""

    labels: dict[str, Any] = dataclasses.field(default_factory=dict)


class MedicAdapter(DirlAdapter):
    """VisualAIKHU/MEDIC: DIRL + the MEDIC plug-in (module docstring)."""

    repository = "VisualAIKHU/MEDIC"
    fixed_widths = ("models/model.py fixes the grid tables at 14 rows, the MLP at 4 x att_dim, "
                    "100 memory slots, 512-channel classifiers and 5 change types; "
                    "models/CCR_expert.py the FFN at 4 x att_dim")
    HOST = {"dirl": 0.03, "ccr": 0.05}  # train_*_final.py: 0.03 * dirl_loss + 0.05 * ccr_loss
    _weights: dict[str, float] = {}  # config.loss_weights, set by fit_config
    zero_grads_in_place = True  # module docstring
    LAMBDAS = {"change_cls": "lambda_cls", "change_type_cls": "lambda_type",
               "expert_disentangle": "lambda_disentangle",
               "expert_consistency": "lambda_consistency"}

    def script(self, model: ml_collections.ConfigDict) -> str:
        return ("train/train_chg_final.py" if model.pairs == "both"
                else "train/train_dc_std_final.py")

    def yaml(self, model: ml_collections.ConfigDict) -> str:
        name = "chg" if model.pairs == "both" else "dc"
        return f"configs/dynamic/transformer_medic_{name}.yaml"

    def module_names(self, model: ml_collections.ConfigDict) -> tuple[str, ...]:
        return (CONFIG_MODULE, "utils.utils", "models.model", "models.CCR_expert")

    def import_lib(self, root: Path, model: ml_collections.ConfigDict) -> dict[str, Any]:
        lib = super().import_lib(root, model)
        lib["configs.config_transformer"] = lib[CONFIG_MODULE]  # build_modules reads this name
        return lib

    def official_weights(self, model: ml_collections.ConfigDict) -> dict[str, float]:
        weights = dict(self.HOST)
        weights.update({k: float(self._weights.get(k, 0.0)) for k in self.LAMBDAS})
        return weights

    def fit_config(self, config: ml_collections.ConfigDict) -> list[str]:
        m = config.model
        if not medic.enabled(m.get("medic")):
            raise ReproduceError("the MEDIC adapter needs config.model.medic")
        both = m.pairs == "both"
        if m.variant != "clevr_dc" or bool(m.use_coordinates) != both:
            raise ReproduceError(
                f"the official {self.script(m)} trains the CCR_expert.py decoder (variant "
                f"'clevr_dc') with use_coordinates={both}; the config has variant "
                f"{m.variant!r}, use_coordinates={m.use_coordinates}")
        notes = official_widths(m)
        for field, value in FIXED.items():
            if m.medic.get(field) != value:
                notes.append(f"model.medic.{field} {m.medic.get(field)} -> {value} (fixed in "
                             "the official models/model.py)")
                m.medic[field] = value
        if tuple(m.medic.get("type_names", medic.TYPE_NAMES)) != medic.TYPE_NAMES:
            raise ReproduceError(f"the official code has the types {list(medic.TYPE_NAMES)}")
        self._weights = dict(config.loss_weights)
        return notes

    def cfg_overrides(self, config: ml_collections.ConfigDict, feature_channels: int,
                      vocab_size: int, max_len: int) -> list[tuple[str, Any]]:
        """DIRL's sizes, and the scripts' temperature flags and the yaml's MEDIC loss
        settings from ``config``. (The lambdas are flags the scripts assign to ``cfg``
        unchecked; :meth:`losses` weights with them, ``official_weights``.)"""
        m = config.model.medic
        out = super().cfg_overrides(config, feature_channels, vocab_size, max_len)
        out += [(k, float(m.get(k, getattr(medic.MEDIC, k)))) for k in (
            "cls_temperature", "type_temperature")]
        out += [(f"loss.{k}", float(m.get(k, getattr(medic.MEDIC, k)))) for k in (
            "margin_inter", "margin_intra", "lambda_inter", "lambda_intra")]
        return out

    def build(self, lib: dict[str, Any], cfg: Any,
              model: ml_collections.ConfigDict) -> OfficialModel:
        """train_*_final.py: DIRL, ``apply(init_weights)``, the experts' ``reset_parameters``,
        then CCR; AddSpatialInfo applied with both pairs only."""
        encoder = lib["models.model"]
        det = encoder.DIRL(cfg)
        det.apply(encoder.init_weights)
        for expert in [*det.expert_modules_change, det.expert_module_no_change]:
            expert.reset_parameters()
        modules = {"change_detector": det, "speaker": lib["models.CCR_expert"].CCR(cfg)}
        spatial = encoder.AddSpatialInfo() if model.pairs == "both" else None
        return OfficialModel(modules, spatial, lib, self.official_weights(model))

    def build_side(self, *args: Any, **kwargs: Any) -> OfficialSide:
        """DIRL's, then a zero gradient on every trained parameter (module docstring)."""
        import torch

        side = super().build_side(*args, **kwargs)
        for module in side.model.trained:
            for p in module.parameters():
                p.grad = torch.zeros_like(p)
        return side

    def extra_fields(self, batch: dict[str, Any]) -> dict[str, np.ndarray]:
        """``change_type`` (our side's labels): the batch's, or one per pair from its caption
        ids when the inputs carry none (random inputs)."""
        if "change_type" in batch:
            return {"change_type": np.asarray(batch["change_type"], np.int32)}
        ids = np.asarray(batch["change_caption"])
        drawn = (ids.sum(axis=1) + np.arange(len(ids))) % len(medic.TYPE_NAMES)
        return {"change_type": drawn.astype(np.int32)}

    def torch_batch(self, batch: dict[str, np.ndarray], model: Any, streams: tuple[str, ...],
                    spatial_info: Any | None, inputs_key: Any) -> MedicBatch:
        import torch

        base = tensor_batch(batch, streams, spatial_info)
        types = medic.TYPE_NAMES
        labels = {s: torch.from_numpy(np.array(medic.medic_labels(
            batch["change_type"], types, no_change=s == "distractor"), np.int64))
            for s in streams}
        return MedicBatch(base.before, base.pairs, labels)

    def losses(self, official: OfficialModel, batch: MedicBatch) -> dict[str, Any]:
        """The loop body (module docstring)."""
        import torch

        encoder, speaker = official.modules["change_detector"], official.modules["speaker"]
        per_stream = {}
        for stream, pair in batch.pairs.items():
            diff_bef, diff_aft, dirl, terms, experts = encoder(batch.before, pair.after,
                                                               batch.labels[stream])
            caption, _, ccr = speaker._forward(torch.cat([diff_bef, diff_aft], dim=-1), experts,
                                               pair.labels, pair.masks,
                                               labels_with_ignore=pair.targets)
            per_stream[stream] = {"caption": caption, "dirl": dirl, "ccr": ccr,
                                  **{k: terms[f"{k}_loss"] for k in self.LAMBDAS}}
        out = torch_pairs_mean(per_stream)
        w = official.weights
        out["total"] = out["caption"] + sum(w[k] * out[k] for k in w)
        return out

    def clip(self, side: OfficialSide) -> None:
        """The MEDIC scripts do not clip gradients."""

    def differences(self, config: ml_collections.ConfigDict, cfg: Any) -> list[str]:
        out = [d for d in super().differences(config, cfg) if "grad_clip" not in d]
        out.append(f"{self.script(config.model)} steps a PolyLR (scheduler.py) every "
                   "iteration and runs under GradScaler/autocast (CUDA only); both sides run "
                   "the config's schedule here")
        if config.optim.grad_clip_norm:
            out.append(f"optim.grad_clip_norm = {config.optim.grad_clip_norm}; the official "
                       "scripts do not clip")
        return out
