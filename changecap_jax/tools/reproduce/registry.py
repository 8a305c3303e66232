"""The models ``reproduce`` supports: one adapter each (``adapters.py``, ``idc_pcl.py``)."""

from __future__ import annotations

from changecap_jax.tools.reproduce.adapters import (
    Adapter,
    DirlAdapter,
    ReproduceError,
    ScorerAdapter,
)
from changecap_jax.tools.reproduce.idc_pcl import IdcPclAdapter

ADAPTERS: dict[str, Adapter] = {"dirl": DirlAdapter(), "scorer": ScorerAdapter(),
                                "idc_pcl": IdcPclAdapter()}


def get_adapter(model_name: str) -> Adapter:
    """The adapter of ``config.model.name``; a clear error for a model without one."""
    if model_name not in ADAPTERS:
        raise ReproduceError(f"python -m changecap_jax reproduce supports models "
                             f"{sorted(ADAPTERS)} (official code), not {model_name!r}")
    return ADAPTERS[model_name]
