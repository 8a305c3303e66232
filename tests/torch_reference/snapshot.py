"""Official SCORER / DIRL snapshot format (reference §3.6, §4.5), written with ``torch.save``.

The official ``experiments/<exp>/snapshots/<exp>_checkpoint_<t>.pt`` is a dict
{``change_detector_state``, ``speaker_state``, ``model_cfg``}. SCORER's CBR (``generator``) is
never checkpointed (S-Q1); :func:`save_cbr_state` writes its bare state_dict separately, for L_cbr
parity tests (§7 item 6).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

SNAPSHOT_KEYS = ("change_detector_state", "speaker_state", "model_cfg")


def default_model_cfg(change_detector: nn.Module, speaker: nn.Module) -> dict[str, Any]:
    """A plain-dict stand-in for the official ``model_cfg``: the constructor sizes of the two
    modules (their ``config`` attribute) under ``change_detector`` / ``speaker``."""
    return {
        "change_detector": dict(getattr(change_detector, "config", {})),
        "speaker": dict(getattr(speaker, "config", {})),
    }


def save_official_snapshot(
    path: str | os.PathLike[str],
    change_detector: nn.Module,
    speaker: nn.Module,
    model_cfg: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """§3.6 / §4.5: ``torch.save({"change_detector_state": cd.state_dict(), "speaker_state":
    speaker.state_dict(), "model_cfg": model_cfg}, path)``; returns the saved dict.

    Ambiguity: the official ``model_cfg`` is the experiment's yacs config object (a dict
    subclass whose layout the reference does not give). Here it is a plain nested dict, so the
    file loads with ``torch.load(..., weights_only=True)``; by default :func:`default_model_cfg`.
    """
    cfg = default_model_cfg(change_detector, speaker) if model_cfg is None else dict(model_cfg)
    checkpoint = {
        "change_detector_state": change_detector.state_dict(),
        "speaker_state": speaker.state_dict(),
        "model_cfg": cfg,
    }
    torch.save(checkpoint, path)
    return checkpoint


def load_official_snapshot(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a snapshot written by :func:`save_official_snapshot` (tensors on CPU)."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    missing = [key for key in SNAPSHOT_KEYS if key not in checkpoint]
    if missing:
        raise KeyError(f"{path} is not an official snapshot: missing {missing}")
    return checkpoint


def save_cbr_state(path: str | os.PathLike[str], generator: nn.Module) -> None:
    """§7 item 6: the CBR ``generator.state_dict()`` (not part of the official snapshot)."""
    torch.save(generator.state_dict(), path)
