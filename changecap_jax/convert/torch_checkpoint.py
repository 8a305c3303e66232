"""Reading official PyTorch snapshots (and bare state_dicts) into NumPy, with torch optional.

The official SCORER / DIRL ``train.py`` (tuyunbin/SCORER, tuyunbin/DIRL) save
``experiments/<exp>/snapshots/<exp>_checkpoint_<t>.pt`` as ``torch.save({"change_detector_state":
change_detector.state_dict(), "speaker_state": speaker.state_dict(), "model_cfg": cfg}, path)``.
``cfg`` is their config (``configs/config_transformer.py``): nested ``utils.attr_dict.AttrDict``
objects (``utils/attr_dict.py``, a ``dict`` subclass whose attributes are its items, e.g.
``cfg.model.transformer_encoder.att_head``) holding str / int / float / bool / None / list
values. ``torch.load(weights_only=True)`` refuses such a file, and full pickle would import
``utils.attr_dict`` from the official code. Loading therefore goes:

1. ``torch.load(weights_only=True)`` (the safe loader; enough for every file whose
   ``model_cfg`` is a plain dict or absent);
2. if that refuses a Python object, a restricted unpickler that constructs only: the globals
   torch's weights-only loader allows; NumPy arrays, scalars and dtypes (their reconstruction
   functions, under NumPy 1's ``numpy.core`` and NumPy 2's ``numpy._core`` names); and the
   config classes (:func:`is_config_class`), each replaced by the inert mapping
   :class:`ConfigNode`. Nothing is imported and no code of a pickled class runs; any other
   global is refused with its ``module.qualname`` and a pointer to ``--allow_pickle``;
3. full pickle (``weights_only=False``) only when the caller passes ``allow_pickle=True``
   (``--allow_pickle``: trusted files only). It imports the classes the file names; one whose
   module cannot be imported here is reported as such, not as a damaged file.

Config classes: ``utils.attr_dict.AttrDict`` (SCORER, DIRL), ``yacs.config.CfgNode`` (yacs
configs), and a class named ``AttrDict`` in any module whose last component is ``attr_dict``
(a fork that moved the official file, e.g. ``lib.utils.attr_dict``). As the stand-in never
imports or runs the class, accepting the name under another package path runs nothing; at
worst an object of another class so named is read as a mapping. Other names (an ``AttrDict``
elsewhere, ``argparse.Namespace``, ...) are refused.

Official IDC-PCL files (yaolinli/IDC ``clver/pretrain.py``, ``clver/finetune.py``) are read by
:func:`read_idc_checkpoint`: the pretraining dict ``{"global_step", "model_state_dict",
"task_batch_num"}`` or the fine-tuning ``best_checkpoint.pt``, a bare state_dict; keys may carry
DataParallel's "module." prefix.

Tensors come back as NumPy arrays (floating tensors as float32: the ports compute in float32).
torch is imported lazily; without it every entry point raises :class:`TorchUnavailableError`
naming ``pip install -r requirements-torch.txt``.
"""

from __future__ import annotations

import _compat_pickle
import dataclasses
import os
import pickle
import re
import types
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from changecap_jax.convert.errors import (
    CheckpointFormatError,
    TorchUnavailableError,
    WrongModelError,
)

# The snapshot dict of tuyunbin/SCORER and tuyunbin/DIRL train.py.
SNAPSHOT_STATE_KEYS = ("change_detector_state", "speaker_state")
SNAPSHOT_KEYS = (*SNAPSHOT_STATE_KEYS, "model_cfg")
# Top-level keys a snapshot may carry to say which iteration it is (the official ones do not;
# the iteration is in the file name, <exp>_checkpoint_<t>.pt).
ITERATION_KEYS = ("iteration", "iter", "step", "t")
_FILENAME_ITERATION = re.compile(r"_checkpoint_(\d+)\.pth?$")
IDC_PRETRAIN_KEYS = ("global_step", "model_state_dict", "task_batch_num")  # clver/pretrain.py
IDC_STATE = "state_dict"  # the one state_dict of an IDC-PCL checkpoint


class ConfigNode(dict):
    """Inert stand-in for a pickled config object (``AttrDict``, yacs ``CfgNode``): its items as
    a dict and its pickled instance attributes in ``__dict__``; no code of the original class
    runs."""

    def __setstate__(self, state: Any) -> None:
        # pickle's BUILD: the instance __dict__, or (__dict__, slots); both only stored.
        for part in state if isinstance(state, tuple) else (state,):
            if isinstance(part, Mapping):
                self.__dict__.update(part)


# Pickled config classes the restricted loader reads as ConfigNode (see is_config_class).
CONFIG_STAND_INS = ("utils.attr_dict.AttrDict", "yacs.config.CfgNode")


def is_config_class(module: str, name: str) -> bool:
    """Whether the pickled global ``module.name`` is read as a :class:`ConfigNode`: one of
    :data:`CONFIG_STAND_INS`, or ``AttrDict`` in any module whose last component is
    ``attr_dict`` (e.g. ``lib.utils.attr_dict``; module docstring)."""
    return (f"{module}.{name}" in CONFIG_STAND_INS
            or (name == "AttrDict" and module.rpartition(".")[2] == "attr_dict"))


def require_torch() -> types.ModuleType:
    """Imports torch or raises :class:`TorchUnavailableError` with the install command."""
    try:
        import torch
    except ImportError as e:
        raise TorchUnavailableError(
            "reading PyTorch checkpoints needs PyTorch, an optional dependency of "
            "changecap_jax: pip install -r requirements-torch.txt"
        ) from e
    return torch


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def _numpy_globals() -> dict[str, Any]:
    """The globals NumPy arrays, scalars and dtypes pickle as (NumPy 1 and 2 module names),
    which torch's weights-only allowlist lacks."""
    try:
        from numpy._core import multiarray
    except ImportError:  # NumPy 1
        from numpy.core import multiarray
    allowed: dict[str, Any] = {"numpy.ndarray": np.ndarray, "numpy.dtype": np.dtype}
    for package in ("numpy.core", "numpy._core"):
        allowed[f"{package}.multiarray._reconstruct"] = multiarray._reconstruct
        allowed[f"{package}.multiarray.scalar"] = multiarray.scalar
    return allowed


class _RefusedGlobal(pickle.UnpicklingError):
    """The restricted loader met a global it does not construct."""

    def __init__(self, qualified: str):
        super().__init__(f"the file pickles the Python object {qualified}, which the safe "
                         "loader does not construct")


class _UnresolvedGlobal(Exception):
    """Full pickle could not import a global the file names."""

    def __init__(self, module: str, name: str, error: Exception):
        qualified = f"{module}.{name}"
        if isinstance(error, AttributeError):
            what = f"which its module {module} does not define here"
        else:
            what = f"whose module {module} cannot be imported here"
        super().__init__(
            f"the file pickles {qualified}, {what}: {type(error).__name__}: {error}. Full "
            "pickle needs the code that wrote the file importable (e.g. its repository on "
            "PYTHONPATH)")


def _restricted_pickle_module() -> types.ModuleType:
    """A ``pickle_module`` for ``torch.load`` whose unpickler resolves only torch's weights-only
    allowlist, NumPy's reconstruction globals and the config stand-ins."""
    from torch import _weights_only_unpickler

    allowed = {**_weights_only_unpickler._get_allowed_globals(), **_numpy_globals()}

    class RestrictedUnpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            # Protocol-2 files name Python-2 modules (__builtin__.set); map them as pickle does.
            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            module = _compat_pickle.IMPORT_MAPPING.get(module, module)
            qualified = f"{module}.{name}"
            if qualified in allowed:
                return allowed[qualified]
            if is_config_class(module, name):
                return ConfigNode
            raise _RefusedGlobal(qualified)

    return _pickle_module(RestrictedUnpickler)


def _full_pickle_module() -> types.ModuleType:
    """A ``pickle_module`` for ``torch.load``: plain pickle, except that a global it cannot
    import raises :class:`_UnresolvedGlobal` (naming it) instead of ImportError."""

    class ResolvingUnpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            try:
                return super().find_class(module, name)
            except Exception as e:  # importing the module can raise anything
                raise _UnresolvedGlobal(module, name, e) from e

    return _pickle_module(ResolvingUnpickler)


def _pickle_module(unpickler: type[pickle.Unpickler]) -> types.ModuleType:
    module = types.ModuleType("changecap_pickle")
    module.Unpickler = unpickler
    module.load = lambda f, **kwargs: unpickler(f, **kwargs).load()
    return module


def _describe_load_failure(path: Path, error: BaseException) -> str:
    kind = "torch zip archive" if zipfile.is_zipfile(path) else "legacy torch file"
    return (f"{path} is a damaged or truncated {kind} ({path.stat().st_size} bytes): "
            f"{type(error).__name__}: {error}")


def _is_read_failure(error: BaseException) -> bool:
    """Whether ``error`` is how torch / pickle report bytes they cannot read (damage or
    truncation), rather than an object that fails to rebuild."""
    return (isinstance(error, EOFError | pickle.UnpicklingError | zipfile.BadZipFile)
            or "PytorchStreamReader" in str(error))


def _sniff(path: Path) -> None:
    """Rejects files that are neither a torch zip archive nor a (legacy) torch pickle."""
    size = path.stat().st_size
    if size == 0:
        raise CheckpointFormatError(f"{path} is empty (0 bytes)")
    if zipfile.is_zipfile(path):
        return
    with open(path, "rb") as f:
        head = f.read(2)
    if head == b"PK":
        raise CheckpointFormatError(
            f"{path} is a truncated or damaged torch zip archive ({size} bytes; no zip directory)")
    if head[:1] != b"\x80":  # every pickle of protocol >= 2 starts with PROTO
        raise CheckpointFormatError(
            f"{path} is not a PyTorch checkpoint (neither a torch zip archive nor a pickle; "
            f"{size} bytes starting with {head!r})")


def load_torch_file(path: str | os.PathLike[str], *, allow_pickle: bool = False) -> Any:
    """``torch.load`` of ``path`` on CPU, as safely as the file allows (module docstring).
    Pickled config objects come back as :class:`ConfigNode` unless ``allow_pickle`` was
    needed for some other object.

    Raises:
      FileNotFoundError: no such file.
      CheckpointFormatError: truncated, damaged or not a torch file; or it pickles a Python
        object the safe loaders do not construct (named in the message) and ``allow_pickle``
        is False; or, with ``allow_pickle``, a pickled class that cannot be imported here.
      TorchUnavailableError: torch is not installed.
    """
    torch = require_torch()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint file {path}")
    _sniff(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        pass  # a refused global, or damage: the restricted loader below tells them apart
    except Exception as e:  # torch raises RuntimeError / EOFError / ... for damaged files
        raise CheckpointFormatError(_describe_load_failure(path, e)) from e
    try:
        return torch.load(path, map_location="cpu", weights_only=False,
                          pickle_module=_restricted_pickle_module())
    except _RefusedGlobal as e:
        refused = e
    except Exception as e:
        raise CheckpointFormatError(_describe_load_failure(path, e)) from e
    if not allow_pickle:
        raise CheckpointFormatError(
            f"{path} cannot be read with the safe loaders: {refused}. If you trust the file, "
            "pass --allow_pickle (full pickle; it can run arbitrary code).") from refused
    try:
        return torch.load(path, map_location="cpu", weights_only=False,
                          pickle_module=_full_pickle_module())
    except _UnresolvedGlobal as e:
        raise CheckpointFormatError(f"{path} cannot be read with --allow_pickle: {e}") from e
    except Exception as e:
        if _is_read_failure(e):
            raise CheckpointFormatError(_describe_load_failure(path, e)) from e
        raise CheckpointFormatError(
            f"{path}: full pickle (--allow_pickle) failed to rebuild a pickled object: "
            f"{type(e).__name__}: {e}") from e


# ---------------------------------------------------------------------------------------------
# State dicts as NumPy
# ---------------------------------------------------------------------------------------------


def state_dict_to_numpy(state: Any, where: str) -> dict[str, np.ndarray]:
    """A torch state_dict (str -> Tensor) as str -> NumPy; floating tensors become float32.

    Raises CheckpointFormatError for a non-mapping, a non-string key or a non-tensor value.
    """
    torch = require_torch()
    if not isinstance(state, Mapping):
        raise CheckpointFormatError(
            f"{where} must be a state_dict (a dict of name -> tensor), got {type(state).__name__}")
    out: dict[str, np.ndarray] = {}
    for key, value in state.items():
        if not isinstance(key, str):
            raise CheckpointFormatError(f"{where} has a non-string key {key!r}")
        if not isinstance(value, torch.Tensor):
            raise CheckpointFormatError(
                f"{where}[{key!r}] is a {type(value).__name__}, not a tensor")
        tensor = value.detach().cpu()
        if tensor.is_floating_point():
            tensor = tensor.float()
        out[key] = tensor.numpy().copy()
    return out


@dataclasses.dataclass
class OfficialSnapshot:
    """An official snapshot read into NumPy.

    Attributes:
      path: the file.
      states: ``"change_detector_state"`` / ``"speaker_state"`` -> {torch key: array}.
      model_cfg: the pickled config as nested mappings (``ConfigNode`` for ``AttrDict`` / yacs
        nodes, plain dicts as saved), or None.
      iteration: the training iteration, from an iteration key of the dict or else the
        official file name ``..._checkpoint_<t>.pt``; None when neither says.
      ignored: other top-level keys of the dict (not used).
      stage: the official training stage that wrote the file, where its format tells
        (IDC-PCL: "pretrain" or "finetune"); None otherwise.
    """

    path: Path
    states: dict[str, dict[str, np.ndarray]]
    model_cfg: Any
    iteration: int | None
    ignored: tuple[str, ...] = ()
    stage: str | None = None


def _preview(keys: list[Any], n: int = 6) -> str:
    shown = ", ".join(repr(k) for k in keys[:n])
    return f"[{shown}{', ...' if len(keys) > n else ''}] ({len(keys)} keys)"


def read_official_snapshot(
    path: str | os.PathLike[str], *, allow_pickle: bool = False
) -> OfficialSnapshot:
    """Reads an official SCORER / DIRL snapshot (the dict their ``train.py`` saves).

    Raises:
      CheckpointFormatError: the file is unreadable (:func:`load_torch_file`) or is not such a
        dict: e.g. a bare state_dict, a list, or a dict without both state keys.
    """
    path = Path(path)
    obj = load_torch_file(path, allow_pickle=allow_pickle)
    expected = ("expected the dict the official training scripts (train.py of tuyunbin/SCORER, "
                "tuyunbin/DIRL) save: {'change_detector_state': ..., 'speaker_state': ..., "
                "'model_cfg': ...}")
    if not isinstance(obj, Mapping):
        raise CheckpointFormatError(
            f"{path} is not an official snapshot: it holds a {type(obj).__name__}; {expected}")
    keys = list(obj)
    missing = [k for k in SNAPSHOT_STATE_KEYS if k not in obj]
    if missing:
        torch = require_torch()
        if keys and all(isinstance(v, torch.Tensor) for v in obj.values()):
            raise CheckpointFormatError(
                f"{path} is a bare state_dict {_preview(keys)}, not an official snapshot; "
                f"{expected}. A state_dict of parameters the snapshot lacks (e.g. SCORER's CBR) "
                "goes to --extra_params.")
        raise CheckpointFormatError(
            f"{path} is not an official snapshot: its dict lacks {missing} (it has "
            f"{_preview(keys)}); {expected}")
    states = {k: state_dict_to_numpy(obj[k], f"{path}: {k}") for k in SNAPSHOT_STATE_KEYS}
    iteration = None
    for key in ITERATION_KEYS:
        value = obj.get(key)
        if isinstance(value, int | np.integer) and not isinstance(value, bool):
            iteration = int(value)
            break
    if iteration is None:
        match = _FILENAME_ITERATION.search(path.name)
        iteration = int(match.group(1)) if match else None
    ignored = tuple(str(k) for k in keys if k not in SNAPSHOT_KEYS and k not in ITERATION_KEYS)
    return OfficialSnapshot(path, states, obj.get("model_cfg"), iteration, ignored)


def read_idc_checkpoint(
    path: str | os.PathLike[str], *, allow_pickle: bool = False
) -> OfficialSnapshot:
    """Reads an official IDC-PCL checkpoint (yaolinli/IDC ``clver/pretrain.py``,
    ``clver/finetune.py``) as ``states = {IDC_STATE: ...}``.

    The pretraining dict ``{"global_step", "model_state_dict", "task_batch_num"}`` gives stage
    "pretrain" and iteration = global_step; a bare state_dict (the fine-tuning
    ``best_checkpoint.pt``) gives stage "finetune" and no iteration. A "module." prefix is
    stripped from every key that has one, as the official loader does.

    Raises:
      CheckpointFormatError: unreadable (:func:`load_torch_file`), or neither format.
    """
    torch = require_torch()
    path = Path(path)
    obj = load_torch_file(path, allow_pickle=allow_pickle)
    expected = ("expected the IDC-PCL pretraining dict {'global_step', 'model_state_dict', "
                "'task_batch_num'} or a fine-tuning state_dict (yaolinli/IDC)")
    if not isinstance(obj, Mapping):
        raise CheckpointFormatError(
            f"{path} is not an IDC-PCL checkpoint: it holds a {type(obj).__name__}; {expected}")
    keys = list(obj)
    if any(k in obj for k in SNAPSHOT_STATE_KEYS):
        raise WrongModelError(f"{path} is an official SCORER / DIRL snapshot, not an IDC-PCL "
                              "checkpoint; convert it with the config of that model")
    if "model_state_dict" in obj:
        stage, state, where = "pretrain", obj["model_state_dict"], f"{path}: model_state_dict"
        step = obj.get("global_step")
        iteration = int(step) if isinstance(step, int | np.integer) and not isinstance(
            step, bool) else None
        ignored = tuple(str(k) for k in keys if k not in IDC_PRETRAIN_KEYS[:2])
    elif keys and all(isinstance(v, torch.Tensor) for v in obj.values()):
        stage, state, where, iteration, ignored = "finetune", obj, str(path), None, ()
    else:
        raise CheckpointFormatError(
            f"{path} is not an IDC-PCL checkpoint: its dict {_preview(keys)} is neither; "
            f"{expected}")
    arrays = state_dict_to_numpy(state, where)
    stripped = {k.removeprefix("module."): v for k, v in arrays.items()}
    if len(stripped) != len(arrays):
        raise CheckpointFormatError(
            f"{where} holds keys both with and without the 'module.' prefix")
    return OfficialSnapshot(path, {IDC_STATE: stripped}, None, iteration, ignored, stage)


def read_state_dict(
    path: str | os.PathLike[str], *, allow_pickle: bool = False
) -> dict[str, np.ndarray]:
    """Reads a bare torch state_dict file (``torch.save(module.state_dict(), path)``), e.g. the
    CBR weights for ``--extra_params``. An official snapshot is refused."""
    path = Path(path)
    obj = load_torch_file(path, allow_pickle=allow_pickle)
    if isinstance(obj, Mapping) and any(k in obj for k in SNAPSHOT_STATE_KEYS):
        raise CheckpointFormatError(
            f"{path} is an official snapshot; --extra_params takes a bare state_dict")
    return state_dict_to_numpy(obj, str(path))
