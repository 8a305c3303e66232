"""changecap_jax/commands/flop_count.py: matmul FLOPs from the jaxpr, loop iterations counted,
against hand counts; XLA's cost analysis counts a scan's body once (why the module exists)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from changecap_jax import parallel
from changecap_jax.commands import flop_count
from changecap_jax.models import losses

F32 = jnp.float32


def spec(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, F32)


def test_plain_and_batched_dots():
    # (4, 6) @ (6, 5): 2*4*5*6; batched (3, 4, 6) x (3, 6, 7): 2*3*4*7*6.
    got = flop_count.dot_flops(lambda a, b, x, y: (a @ b, jnp.einsum("bij,bjk->bik", x, y)),
                               spec(4, 6), spec(6, 5), spec(3, 4, 6), spec(3, 6, 7))
    assert got == flop_count.DotFlops(2 * 4 * 5 * 6 + 2 * 3 * 4 * 7 * 6, 0, 0.0)


def test_scan_multiplies_and_xla_does_not():
    def loop(w, xs):
        return jax.lax.scan(lambda c, x: (jnp.tanh(c @ w) + x, None), xs[0], xs)[0]

    w, xs = spec(16, 16), spec(5, 8, 16)
    got = flop_count.dot_flops(loop, w, xs)
    assert got.flops == got.in_scans == 5 * 2 * 8 * 16 * 16
    # A dot outside the scan is not "in scans".
    outside = flop_count.dot_flops(lambda w, xs: loop(w, xs) @ w, w, xs)
    assert outside.flops - outside.in_scans == 2 * 8 * 16 * 16
    xla = jax.jit(loop).lower(w, xs).compile().cost_analysis()
    xla = xla[0] if isinstance(xla, list) else xla
    # XLA counts the body once: far below the five iterations.
    assert xla["flops"] < 0.5 * got.flops


def test_gradients_cond_while_and_convolution():
    x, w = spec(3, 4), spec(4, 2)
    # Forward dot plus two backward dots (d/dx and d/dw) of the same size.
    grad = flop_count.dot_flops(jax.grad(lambda x, w: jnp.sum(x @ w), argnums=(0, 1)), x, w)
    assert grad.flops == 3 * (2 * 3 * 4 * 2)
    # cond: the dearer branch; while: its body once, reported.
    branchy = flop_count.dot_flops(
        lambda p, x, w, v: jax.lax.cond(p, lambda: x @ w @ v, lambda: x @ w),
        jax.ShapeDtypeStruct((), jnp.bool_), x, w, spec(2, 2))
    assert branchy == flop_count.DotFlops(2 * 3 * 4 * 2 + 2 * 3 * 2 * 2, 0)
    looped = flop_count.dot_flops(
        lambda x, w: jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] @ w),
                                        (0, x))[1], x, spec(4, 4))
    assert looped == flop_count.DotFlops(2 * 3 * 4 * 4, 1)
    # NHWC image (2, 8, 8, 3), HWIO kernel (3, 3, 3, 5), SAME: 2*(2*8*8*5)*(3*3*3).
    conv = flop_count.dot_flops(
        lambda i, k: jax.lax.conv_general_dilated(i, k, (1, 1), "SAME",
                                                  dimension_numbers=("NHWC", "HWIO", "NHWC")),
        spec(2, 8, 8, 3), spec(3, 3, 3, 5))
    assert conv.flops == 2 * (2 * 8 * 8 * 5) * (3 * 3 * 3)


@pytest.mark.parametrize("chunk_size", [2, 3])
def test_scorer_matching_forward_counts_every_chunk(chunk_size):
    # Bq = Bk = 6 rows of N = M = 5 tokens, D = 4: R is 2*6*6*5*5*4 FLOPs whatever the chunks
    # (chunk 3 divides 6; the padded last chunk of a non-divisor would add columns).
    q = spec(6, 5, 4)
    fn = functools.partial(losses.token_matching_similarity, chunk_size=chunk_size)
    assert flop_count.dot_flops(fn, q, q).flops == 2 * 6 * 6 * 5 * 5 * 4


def test_shard_map_counts_per_device():
    mesh = parallel.make_mesh(8)  # the trainer's mesh
    fn = jax.jit(jax.shard_map(lambda x, w: x @ w, mesh=mesh, in_specs=(P("data"), P()),
                               out_specs=P("data")))
    x = jax.ShapeDtypeStruct((64, 16), F32, sharding=parallel.batch_sharding(mesh))
    # 64 rows over 8 devices: 8 rows of (8, 16) @ (16, 4) per device.
    assert flop_count.dot_flops(fn, x, spec(16, 4)).flops == 2 * 8 * 16 * 4
