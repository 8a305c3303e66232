"""The models ``reproduce`` supports: one adapter each (``adapters.py``, ``idc_pcl.py``), and
one per plug-in of a host whose official code is its own repository (``medic.py``)."""

from __future__ import annotations

from typing import Any

from changecap_jax.commands.reproduce.adapters import (
    Adapter,
    DirlAdapter,
    ReproduceError,
    ScorerAdapter,
)
from changecap_jax.commands.reproduce.idc_pcl import IdcPclAdapter
from changecap_jax.commands.reproduce.idc_pretrain import IdcPclPretrainAdapter
from changecap_jax.commands.reproduce.medic import MedicAdapter
from changecap_jax.models import medic

ADAPTERS: dict[str, Adapter] = {"dirl": DirlAdapter(), "scorer": ScorerAdapter(),
                                "idc_pcl": IdcPclAdapter()}
# (model, config.model.stage) -> the adapter of a second official script of that model.
STAGE_ADAPTERS: dict[tuple[str, str], Adapter] = {("idc_pcl", "pretrain"):
                                                  IdcPclPretrainAdapter()}


def get_adapter(model_name: str, stage: str = "") -> Adapter:
    """The adapter of ``config.model.name`` (and ``config.model.stage`` where the stage has
    its own official script); a clear error for a model without one."""
    if (model_name, stage) in STAGE_ADAPTERS:
        return STAGE_ADAPTERS[(model_name, stage)]
    if model_name not in ADAPTERS:
        raise ReproduceError(f"python -m changecap_jax reproduce supports models "
                             f"{sorted(ADAPTERS)} (official code), not {model_name!r}")
    return ADAPTERS[model_name]


def adapter_for(model: Any) -> Adapter:
    """The adapter of ``config.model``: DIRL with ``model.medic`` on is VisualAIKHU/MEDIC's
    code; otherwise :func:`get_adapter` of its name and stage."""
    if model.name == "dirl" and medic.enabled(model.get("medic")):
        return MEDIC_ADAPTER
    return get_adapter(model.name, model.get("stage", ""))


MEDIC_ADAPTER = MedicAdapter()
