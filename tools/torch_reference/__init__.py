"""The project's PyTorch reference of the official models, and which models have one.

:mod:`.dirl` (DIRL+CCR) and :mod:`.scorer` (SCORER+CBR) re-implement the official modules in
plain PyTorch from the notes in docs/official/. The parity tests compare the Flax ports against
them, and ``python -m benchmarks.vs_pytorch --torch`` times their train step beside
ours (:func:`reference_step`; docs/performance.md). Each model's ``*_step`` module builds its
reference from a project config.

PyTorch is optional: importing this package does not import it; :func:`check_model` and
:func:`reference_step` do, and say in one line how to install it when it is missing.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import ml_collections

from changecap_jax.convert.tables import Sizes
from changecap_jax.errors import UserError

# config.model.name -> the module of this package whose ``build(model_config, sizes)`` returns
# the model's train_step.ReferenceModel and whose ``check_model(model_config)`` refuses what the
# reference cannot build.
STEP_MODULES: dict[str, str] = {"dirl": "dirl_step", "scorer": "scorer_step"}


class TorchReferenceError(UserError, ValueError):
    """A model without a torch reference, a config its reference cannot express, or no
    PyTorch install."""


def check_switches(model: ml_collections.ConfigDict, expected: dict[str, Any],
                   reference: str) -> None:
    """TorchReferenceError unless ``model`` has every switch of ``expected`` at its value: the
    references implement the full models only, no ablation."""
    wrong = {k: model.get(k, v) for k, v in expected.items() if model.get(k, v) != v}
    if wrong:
        raise TorchReferenceError(
            f"the {reference} torch reference is the full model {expected}; the config has "
            f"{wrong} (compare the full model, e.g. the preset without its /ABLATION)")


def check_square_grid(sizes: Sizes, what: str) -> None:
    """TorchReferenceError unless the data's grid is square (``what`` assumes it)."""
    if sizes.grid_height != sizes.grid_width:
        raise TorchReferenceError(f"{what} assume a square grid, got "
                                  f"{sizes.grid_height}x{sizes.grid_width}")


def check_has_reference(model_name: str) -> None:
    """TorchReferenceError naming the models with a reference unless ``model_name`` has one."""
    if model_name not in STEP_MODULES:
        raise TorchReferenceError(
            f"model {model_name!r} has no torch reference; models with one: "
            f"{sorted(STEP_MODULES)}")


def _builder(model_name: str) -> ModuleType:
    """The ``*_step`` module of ``model_name``; clear errors without a reference or torch."""
    check_has_reference(model_name)
    try:
        importlib.import_module("torch")
    except ImportError as e:
        raise TorchReferenceError(
            f"the torch reference needs PyTorch, which is not installed ({e}); install it "
            "with pip install -r requirements-torch.txt") from e
    # Imported here: it imports torch.
    return importlib.import_module(f"{__name__}.{STEP_MODULES[model_name]}")


def check_model(model: ml_collections.ConfigDict) -> None:
    """TorchReferenceError unless the torch reference can build ``config.model`` (before any
    data is read; the data's sizes are checked by :func:`reference_step`)."""
    _builder(model.name).check_model(model)


def reference_step(config: ml_collections.ConfigDict, sizes: Sizes, platform: str = "cpu",
                   threads: int = 0) -> Any:
    """The train step (``train_step.ReferenceStep``) of the torch reference of ``config``'s
    model at the config's sizes and the data's ``sizes``, seeded with ``config.seed``; on the
    GPU when the JAX ``platform`` is "gpu" and torch has CUDA, else on the CPU with ``threads``
    intra-op threads (0: torch's default)."""
    builder = _builder(config.model.name)
    train_step = importlib.import_module(f"{__name__}.train_step")  # imports torch
    train_step.seed(config.seed)
    return train_step.ReferenceStep(builder.build(config.model, sizes), config, platform,
                                    threads)
