"""Matmul FLOPs of a traced function, every loop iteration counted.

XLA's ``cost_analysis()`` counts the body of a while loop once, whatever its trip count, so a
step whose heavy work runs inside ``jax.lax.map`` / ``scan`` (SCORER's chunked batch-wide
matching: 8 chunks at batch 64) is undercounted several times over. This module walks the
jaxpr instead and counts the multiply-adds of every ``dot_general``, convolution and dense
kernel gradient (``cpu/kernel_gradient.py``'s primitive), times the trip count of each
enclosing ``scan``. Element-wise work is not counted (XLA counts it), so for a program without
loops this count is a little below XLA's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax.extend import core as jex_core

from changecap_jax.cpu.kernel_gradient import kernel_gradient_p


class DotFlops(NamedTuple):
    flops: float  # 2 x multiply-adds of the dots and convolutions, loop iterations included
    unknown_trip_count_loops: int  # while loops whose body was counted once
    in_scans: float = 0.0  # the part of ``flops`` inside scans (all their iterations)


def _dot_general_flops(eqn: Any) -> float:
    lhs, _ = (v.aval for v in eqn.invars)
    (contracting, _), _ = eqn.params["dimension_numbers"]
    out = eqn.outvars[0].aval
    return 2.0 * math.prod(out.shape) * math.prod(lhs.shape[d] for d in contracting)


def _conv_flops(eqn: Any) -> float:
    _, rhs = (v.aval for v in eqn.invars)
    out = eqn.outvars[0].aval
    spec = eqn.params["dimension_numbers"].rhs_spec  # (out feature, in feature, spatial...)
    per_output = math.prod(rhs.shape[d] for d in spec[1:])  # in features x kernel window
    return 2.0 * math.prod(out.shape) * per_output


def _subjaxprs(value: Any) -> list[Any]:
    if isinstance(value, jex_core.ClosedJaxpr):
        return [value.jaxpr]
    if isinstance(value, jex_core.Jaxpr):
        return [value]
    if isinstance(value, (tuple, list)):
        return [j for v in value for j in _subjaxprs(v)]
    return []


def _count(jaxpr: Any) -> DotFlops:
    flops, unknown, in_scans = 0.0, 0, 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            flops += _dot_general_flops(eqn)
            continue
        if name == "conv_general_dilated":
            flops += _conv_flops(eqn)
            continue
        if eqn.primitive is kernel_gradient_p:  # a dense layer's x^T g: (T, I) x (T, O)
            (tokens, fan_in), (_, fan_out) = (v.aval.shape for v in eqn.invars)
            flops += 2.0 * tokens * fan_in * fan_out
            continue
        inner = [_count(j) for v in eqn.params.values() for j in _subjaxprs(v)]
        if not inner:
            continue
        if name == "cond":  # one branch runs: count the most expensive
            dearest = max(inner, key=lambda c: c.flops)
            flops += dearest.flops
            in_scans += dearest.in_scans
            unknown += max(c.unknown_trip_count_loops for c in inner)
            continue
        repeat = eqn.params["length"] if name == "scan" else 1
        if name == "while":
            unknown += 1
        body = repeat * sum(c.flops for c in inner)
        flops += body
        in_scans += body if name == "scan" else repeat * sum(c.in_scans for c in inner)
        unknown += sum(c.unknown_trip_count_loops for c in inner)
    return DotFlops(flops, unknown, in_scans)


def jaxpr_dot_flops(closed_jaxpr: Any) -> DotFlops:
    """The matmul FLOPs of a traced program (``jax.make_jaxpr(fn)(...)`` or the ``.jaxpr`` of
    ``jax.jit(fn).trace(...)``).

    Inside ``shard_map`` the shapes are per device, so a step that computes under shard_map
    (changecap_jax/trainers/captioning.py) is counted per device, as XLA's ``cost_analysis`` counts
    it."""
    return _count(closed_jaxpr.jaxpr)


def dot_flops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> DotFlops:
    """The matmul FLOPs of one call ``fn(*args, **kwargs)`` (arrays or ShapeDtypeStructs), as
    :func:`jaxpr_dot_flops` counts them."""
    return jaxpr_dot_flops(jax.make_jaxpr(fn)(*args, **kwargs))
