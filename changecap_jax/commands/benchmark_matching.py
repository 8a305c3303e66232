"""Peak temporary memory of SCORER's batch-wide token-wise matching loss, naive vs chunked.

    python -m changecap_jax benchmark_matching [--batch=128] [--tokens=196] [--dim=512]
        [--chunk_sizes=1,4,8,16] [--time] [--nonaive]

Compiles value_and_grad (w.r.t. q, k and the logit scale) of
:func:`changecap_jax.models.losses.matching_contrastive_loss` on one device, once holding the whole
(B, B, N, N) token-similarity tensor (``naive=True``) and once per chunk size and backward mode
("argmax": custom VJP, the default; "remat": autodiff through jax.checkpoint), and prints XLA's
``memory_analysis()`` temporary bytes (buffers beyond the arguments and outputs). Nothing is
executed unless ``--time`` is given (then each compiled function runs a few times on random
inputs; the naive form at the paper sizes needs about 12 GiB).
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
from absl import flags

from changecap_jax import cli, compile_cache
from changecap_jax.models import losses

FLAGS = flags.FLAGS
flags.DEFINE_integer("batch", 128, "Global batch B (rows and columns of S).")
flags.DEFINE_integer("tokens", 196, "Tokens per image N (14 x 14 grid).")
flags.DEFINE_integer("dim", 512, "Channels D of the query / key projections.")
flags.DEFINE_list("chunk_sizes", ["1", "4", "8", "16"], "Chunk sizes to measure.")
flags.DEFINE_bool("time", False, "Also run each compiled function and report its median time.")
flags.DEFINE_bool("naive", True, "Include the naive (whole-tensor) form.")


def compile_loss(
    batch: int, tokens: int, dim: int, *, naive: bool, chunk_size: int = 8,
    backward: str = "argmax",
) -> Any:
    """The compiled forward + backward of the matching loss for (batch, tokens, dim) inputs."""

    def loss(q: jax.Array, k: jax.Array, logit_scale: jax.Array) -> jax.Array:
        return losses.matching_contrastive_loss(q, k, logit_scale, naive=naive,
                                                chunk_size=chunk_size, backward=backward)

    tokens_spec = jax.ShapeDtypeStruct((batch, tokens, dim), jnp.float32)
    scale_spec = jax.ShapeDtypeStruct((), jnp.float32)
    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    return fn.lower(tokens_spec, tokens_spec, scale_spec).compile()


def temp_bytes(compiled: Any) -> int:
    return int(compiled.memory_analysis().temp_size_in_bytes)


def _median_time(compiled: Any, batch: int, tokens: int, dim: int) -> float:
    kq, kk = jax.random.split(jax.random.key(0))
    q = jax.random.normal(kq, (batch, tokens, dim)) / dim**0.5
    k = jax.random.normal(kk, (batch, tokens, dim)) / dim**0.5
    scale = jnp.float32(1.0)
    jax.block_until_ready(compiled(q, k, scale))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(compiled(q, k, scale))
        times.append(time.perf_counter() - start)
    return sorted(times)[1]


def main(argv: list[str]) -> None:
    del argv
    b, n, d = FLAGS.batch, FLAGS.tokens, FLAGS.dim
    print(f"device: {jax.devices()[0].platform}; B={b}, N={n}, D={d}; "
          f"value_and_grad of matching_contrastive_loss w.r.t. (q, k, logit_scale)")
    print(f"one (B, B, N, N) float32 tensor: {b * b * n * n * 4 / 2**20:.0f} MiB")
    cases = [("naive", True, 0, "argmax")] if FLAGS.naive else []
    cases += [
        (f"chunk {c} {bwd}", False, int(c), bwd)
        for bwd in ("argmax", "remat") for c in FLAGS.chunk_sizes]
    for name, naive, chunk, bwd in cases:
        compiled = compile_loss(b, n, d, naive=naive, chunk_size=max(chunk, 1), backward=bwd)
        line = f"{name:>16}: temp {temp_bytes(compiled) / 2**20:9.1f} MiB"
        if FLAGS.time:
            line += f", {_median_time(compiled, b, n, d) * 1e3:.1f} ms"
        print(line)


if __name__ == "__main__":
    compile_cache.enable()
    cli.run(main)
