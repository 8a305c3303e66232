"""Official SCORER / DIRL snapshot format, written with ``torch.save`` as the official scripts do.

``train.py`` of tuyunbin/SCORER and tuyunbin/DIRL saves ``experiments/<exp>/snapshots/
<exp>_checkpoint_<t>.pt`` as ``torch.save({"change_detector_state": ..., "speaker_state": ...,
"model_cfg": cfg}, path)``, where ``cfg`` is their config object: nested
``utils.attr_dict.AttrDict`` (``utils/attr_dict.py``) laid out as ``configs/config_transformer.py``
and ``configs/dynamic/*.yaml``. :class:`AttrDict` is this test suite's own class of that name;
:func:`official_modules` makes it importable as ``utils.attr_dict`` only while a file is written
(or read back by :func:`load_official_snapshot`), so the converter under test cannot import it.

SCORER's CBR (``generator``) is never checkpointed by the official ``train.py``;
:func:`save_cbr_state` writes its bare state_dict separately, for the L_cbr parity tests.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

SNAPSHOT_KEYS = ("change_detector_state", "speaker_state", "model_cfg")
OFFICIAL_CONFIG_MODULE = "utils.attr_dict"


class AttrDict(dict):
    """A dict whose items are also its attributes (``cfg.model.att_head = 8``), pickled as
    ``utils.attr_dict.AttrDict`` like the official config class."""

    __module__ = OFFICIAL_CONFIG_MODULE

    def __getattr__(self, name: str) -> Any:
        if name in self:
            return self[name]
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value


@contextlib.contextmanager
def official_modules() -> Iterator[None]:
    """While active, ``utils.attr_dict.AttrDict`` imports as :class:`AttrDict` (pickle needs the
    class importable to save it; the official scripts run where ``utils/`` is). The previous
    ``sys.modules`` entries come back afterwards."""
    attr_dict = types.ModuleType(OFFICIAL_CONFIG_MODULE)
    attr_dict.AttrDict = AttrDict
    utils = types.ModuleType("utils")
    utils.attr_dict = attr_dict
    modules = {"utils": utils, OFFICIAL_CONFIG_MODULE: attr_dict}
    previous = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name, module in previous.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def torch_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save`` of an object that may hold :class:`AttrDict` configs."""
    with official_modules():
        torch.save(obj, path)


def _section(module: nn.Module) -> AttrDict:
    sizes = dict(getattr(module, "config", {}))
    if "num_layers" in sizes:
        sizes["att_layer"] = sizes.pop("num_layers")  # the official name
    return AttrDict(sizes)


def default_model_cfg(change_detector: nn.Module, speaker: nn.Module) -> AttrDict:
    """A ``model_cfg`` laid out as the official one: nested AttrDicts with the two modules'
    constructor sizes (their ``config`` attribute; ``num_layers`` as ``att_layer``) under
    ``model.transformer_encoder`` / ``model.transformer_decoder``, beside the other kinds of
    value the official config holds (str, list, None, bool, float)."""
    cfg = AttrDict()
    cfg.exp_name = "test"
    cfg.gpu_id = [0]
    cfg.model = AttrDict(type="")
    cfg.model.transformer_encoder = _section(change_detector)
    cfg.model.transformer_decoder = _section(speaker)
    cfg.model.transformer_decoder.share_wd_cls_weight = False
    cfg.data = AttrDict(dataset="rcc_dataset_transformer")
    cfg.data.train = AttrDict(batch_size=128, seq_per_img=1, max_samples=None)
    cfg.train = AttrDict(max_iter=10000, snapshot_interval=1000, start_from=None, grad_clip=-1.0)
    cfg.train.optim = AttrDict(type="adam", lr=2e-4, weight_decay=0.0)
    return cfg


def save_official_snapshot(
    path: str | os.PathLike[str],
    change_detector: nn.Module,
    speaker: nn.Module,
    model_cfg: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``torch.save({"change_detector_state": cd.state_dict(), "speaker_state":
    speaker.state_dict(), "model_cfg": model_cfg}, path)`` as the official ``train.py`` does;
    returns the saved dict.

    ``model_cfg`` defaults to :func:`default_model_cfg` (AttrDicts, which
    ``torch.load(weights_only=True)`` refuses, as it refuses the official files); a given
    mapping is saved as it is (a plain dict loads with ``weights_only=True``).
    """
    cfg = default_model_cfg(change_detector, speaker) if model_cfg is None else model_cfg
    checkpoint = {
        "change_detector_state": change_detector.state_dict(),
        "speaker_state": speaker.state_dict(),
        "model_cfg": cfg,
    }
    torch_save(checkpoint, path)
    return checkpoint


def load_official_snapshot(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a snapshot written by :func:`save_official_snapshot` (tensors on CPU; its config
    as :class:`AttrDict`). Full pickle: the weights-only loader rebuilds no dict subclass, and
    these files are the tests' own."""
    with official_modules():
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    missing = [key for key in SNAPSHOT_KEYS if key not in checkpoint]
    if missing:
        raise KeyError(f"{path} is not an official snapshot: missing {missing}")
    return checkpoint


def save_cbr_state(path: str | os.PathLike[str], generator: nn.Module) -> None:
    """The CBR ``generator.state_dict()`` (not part of the official snapshot)."""
    torch.save(generator.state_dict(), path)
