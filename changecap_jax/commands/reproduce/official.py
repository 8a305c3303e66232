"""Importing a user's official checkout (tuyunbin/DIRL, tuyunbin/SCORER, yaolinli/IDC) beside
this project.

The official code imports its own top-level packages ``configs``, ``utils`` and ``models``;
``configs`` is also this project's config package, and the official ``configs/`` and
``models/`` folders have no ``__init__.py``, so a plain ``sys.path`` insert would find ours
first. :func:`import_official` therefore binds those names to the checkout's folders in
``sys.modules`` for the duration of the import only, then puts back whatever was there: the
official modules keep working (they resolved their imports at import time) and ours stay
importable. :func:`cuda_is_identity` makes the ``.cuda()`` calls inside the official forward
passes (e.g. ``models/DIRL.py``, ``models/SCORER.py``, ``models/CBR.py``) no-ops on CPU.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

OFFICIAL_PACKAGES = ("configs", "utils", "models")  # top-level names the official code imports


class OfficialCheckoutError(RuntimeError):
    """The checkout cannot be imported or lacks a file the command needs."""


def _package(root: Path, name: str) -> types.ModuleType:
    """The checkout's folder ``name`` as a package, run from its ``__init__.py`` if it has one
    (``utils/``) or as an empty namespace package otherwise (``configs/``, ``models/``)."""
    folder = root / name
    init = folder / "__init__.py"
    if init.is_file():
        spec = importlib.util.spec_from_file_location(
            name, init, submodule_search_locations=[str(folder)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    module = types.ModuleType(name)
    module.__path__ = [str(folder)]
    return module


def _is_under(module_name: str, packages: Sequence[str]) -> bool:
    return module_name.split(".", 1)[0] in packages


@contextlib.contextmanager
def _isolated(root: Path, names: Sequence[str], packages: Sequence[str]) -> Iterator[None]:
    """While active: modules under the top-level ``names`` are the checkout's (``packages``
    bound to its folders), ``root`` first on ``sys.path``; everything is put back after."""
    saved = {k: v for k, v in sys.modules.items() if _is_under(k, names)}
    for k in saved:
        del sys.modules[k]
    sys.path.insert(0, str(root))
    try:
        for name in packages:
            sys.modules[name] = _package(root, name)
        yield
    finally:
        sys.path.remove(str(root))
        for k in [k for k in sys.modules if _is_under(k, names)]:
            del sys.modules[k]
        sys.modules.update(saved)


def import_official(root: str | Path, module_names: Sequence[str],
                    packages: Sequence[str] = OFFICIAL_PACKAGES) -> dict[str, Any]:
    """Imports ``module_names`` (e.g. ``"models.DIRL"``) from the checkout at ``root``, whose
    folders ``packages`` are bound as packages; returns {name: module}. ``sys.modules`` and
    ``sys.path`` are as before afterwards."""
    root = Path(root).expanduser().resolve()
    if not root.is_dir():
        raise OfficialCheckoutError(f"--official_repo {root} is not a folder")
    missing = [n for n in module_names
               if not (root / (n.replace(".", "/") + ".py")).is_file()]
    if missing:
        raise OfficialCheckoutError(
            f"{root} is not the expected official checkout: it lacks "
            f"{', '.join(n.replace('.', '/') + '.py' for n in missing)}")
    names = (*packages, *(n.split(".", 1)[0] for n in module_names))
    with _isolated(root, names, packages):
        try:
            return {n: importlib.import_module(n) for n in module_names}
        except ImportError as e:
            raise OfficialCheckoutError(f"importing the official code from {root} failed: "
                                        f"{e}") from e


@contextlib.contextmanager
def cuda_is_identity() -> Iterator[None]:
    """``Tensor.cuda()`` and ``Module.cuda()`` return their receiver while active."""
    import torch

    saved = torch.Tensor.cuda, torch.nn.Module.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.nn.Module.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda, torch.nn.Module.cuda = saved


@contextlib.contextmanager
def running_official() -> Iterator[None]:
    """While the official code runs: :func:`cuda_is_identity`, and torch's warning about the
    official CCR's masks silenced (it passes a float causal mask with a bool padding mask,
    models/CCR*.py)."""
    with cuda_is_identity(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Support for mismatched key_padding_mask")
        yield


def load_cfg(config_module: Any, root: Path, yaml_file: str,
             overrides: Sequence[tuple[str, Any]]) -> Any:
    """The official ``cfg`` as ``train.py`` builds it (``merge_cfg_from_file(args.cfg)``), then
    ``overrides`` (key, value) merged with the official ``merge_cfg_from_list``."""
    path = root / yaml_file
    if not path.is_file():
        raise OfficialCheckoutError(f"{root} lacks the official config {yaml_file}")
    config_module.merge_cfg_from_file(str(path))
    flat: list[Any] = []
    for key, value in overrides:
        flat += [key, value]
    if flat:
        config_module.merge_cfg_from_list(flat)
    return config_module.cfg


def parse_cfg_override(text: str) -> tuple[str, str]:
    """``"train.optim.lr=3e-4"`` -> (key, value string) for ``merge_cfg_from_list``."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--official_cfg takes KEY=VALUE (e.g. train.optim.lr=0.0003), got "
                         f"{text!r}")
    return key.strip(), value.strip()
