"""``--precision=float64``: both sides of the comparison in float64, and the checks that
nothing on either side computes in float32 meanwhile (docs/reproduce.md).

Ours: the run is traced under ``jax_enable_x64`` (scoped to the comparison, so the process's
setting is back afterwards), the converted parameters, the Adam moments and the batch grids
are float64, and :func:`jax_float32_values` lists every value of the traced train step that
is narrower than float64 where a float64 value went in (a cast down) and every float32
constant. The official side: the modules are built as in float32 (the same random
initialisation) and then cast with ``.double()``, the batches are float64, each step runs
under ``torch.set_default_dtype(torch.float64)`` (the official forwards create tensors with
``torch.Tensor(np.ones(...))``) and :func:`official_guard` refuses any torch call that turns a
float64 tensor into a narrower float. The official positional-encoding buffers are computed in
float32 (``.float()`` in ``models/CCR*.py`` and ``models/transformer_decoder.py``); they are
recomputed in float64 (:func:`official_to_float64`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from changecap_jax.commands.reproduce.adapters import OfficialModel, ReproduceError

PRECISIONS = ("float32", "float64")
PE_BUFFER = "pe"  # register_buffer("pe", ...) of the official PositionalEncoding
PE_TOLERANCE = 1e-5  # the converter's check of the buffer (convert/tables.py sinusoid_check)


def check_precision(precision: str) -> None:
    """A clear error for anything but float32 / float64."""
    if precision not in PRECISIONS:
        raise ReproduceError(f"--precision must be one of {PRECISIONS}, got {precision!r}")


def host_dtype(precision: str) -> np.dtype:
    """The NumPy dtype of the batch grids and masks given to both sides."""
    return np.dtype(precision)


def jax_precision(precision: str) -> Any:
    """``jax_enable_x64`` on for float64 (off for float32) while the context is active."""
    return jax.enable_x64(precision == "float64")


@contextlib.contextmanager
def torch_precision(precision: str) -> Iterator[None]:
    """``torch.set_default_dtype(float64)`` for float64, the previous default restored."""
    import torch

    saved = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, precision))
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def official_to_float64(model: OfficialModel,
                        pe_table: Callable[[tuple[int, ...]], np.ndarray]) -> list[str]:
    """Casts the official modules to float64 and recomputes their positional-encoding buffers
    in float64 (``pe_table``: the table of a buffer's shape); returns a note saying which
    buffers were replaced."""
    import torch

    replaced = []
    for module_name, module in model.modules.items():
        module.double()
        for name, buffer in list(module.named_buffers()):
            if name.rsplit(".", 1)[-1] != PE_BUFFER or not buffer.is_floating_point():
                continue
            table = pe_table(tuple(buffer.shape))
            diff = float(np.max(np.abs(buffer.detach().cpu().numpy() - table)))
            if diff > PE_TOLERANCE:
                raise ReproduceError(
                    f"float64: the official buffer {module_name}.{name} is not the sinusoid "
                    f"table (max |diff| {diff:.3g}), so it cannot be recomputed in float64")
            with torch.no_grad():
                buffer.copy_(torch.from_numpy(table))
            replaced.append(f"{module_name}.{name}")
    if model.spatial_info is not None:
        model.spatial_info.double()
    return [f"float64: the official modules cast with .double(); the positional-encoding "
            f"buffers {', '.join(replaced)}, which the official code computes in float32, "
            "recomputed in float64"] if replaced else ["float64: the official modules cast "
                                                      "with .double()"]


def _float_width(dtype: Any) -> int:
    """Bits of a floating dtype, 0 for anything else."""
    if not jnp.issubdtype(dtype, jnp.floating):  # also PRNG key dtypes
        return 0
    return np.dtype(dtype).itemsize * 8


def _closed_jaxprs(params: dict[str, Any]) -> Iterator[Any]:
    """The jaxprs nested in an equation's parameters (jit, shard_map, cond branches ...),
    each with its constants (an empty list where it has none)."""
    for value in params.values():
        for item in value if isinstance(value, list | tuple) else (value,):
            inner = getattr(item, "jaxpr", item)
            if hasattr(inner, "eqns"):
                yield inner, list(getattr(item, "consts", ()))


def _narrowed(jaxpr: Any, consts: list[Any]) -> Iterator[str]:
    """Equations of ``jaxpr`` (recursively) with a float64 input and a narrower float output,
    and its float constants narrower than float64."""
    for c in consts:
        if 0 < _float_width(np.asarray(c).dtype) < 64:
            yield f"constant {np.shape(c)} {np.asarray(c).dtype}"
    for eqn in jaxpr.eqns:
        widths = [_float_width(v.aval.dtype) for v in eqn.invars if hasattr(v.aval, "dtype")]
        outs = [v.aval for v in eqn.outvars if 0 < _float_width(v.aval.dtype) < 64]
        if 64 in widths and outs:
            yield f"{eqn.primitive.name} -> {outs[0].str_short()}"
        for inner, inner_consts in _closed_jaxprs(eqn.params):
            yield from _narrowed(inner, inner_consts)


def jax_float32_values(fn: Any, *args: Any) -> list[str]:
    """What :func:`jax.make_jaxpr` of ``fn(*args)`` computes below float64 from float64
    values, and its float constants narrower than float64 (empty: all float64)."""
    closed = jax.make_jaxpr(fn)(*args)
    return sorted(set(_narrowed(closed.jaxpr, list(closed.consts))))


def _guard_mode() -> type:
    """:class:`torch.overrides.TorchFunctionMode` subclass (torch is optional)."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_leaves

    def floats(tree: Any) -> list[Any]:
        return [t for t in tree_leaves(tree)
                if isinstance(t, torch.Tensor) and t.is_floating_point()]

    class Guard(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            if any(t.dtype == torch.float64 for t in floats((args, kwargs))):
                narrow = [t.dtype for t in floats(out) if t.dtype != torch.float64]
                if narrow:
                    raise ReproduceError(
                        f"float64: the official code computes {getattr(func, '__name__', func)}"
                        f" of a float64 tensor in {narrow[0]}; it cannot run in float64")
            return out

    return Guard


def official_guard(precision: str) -> Any:
    """For float64: a torch function mode that refuses any call turning a float64 tensor
    into a narrower float (:func:`_guard_mode`); for float32 nothing."""
    return _guard_mode()() if precision == "float64" else contextlib.nullcontext()
