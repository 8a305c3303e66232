"""Dropout whose masks come from a counter hash instead of a threefry stream.

``flax.linen.Dropout`` draws one threefry-2x32 output per element. On a CPU that costs about
15 ns per element, and the paper-sized models drop ~80 million elements per train step (the
encoders' attention probabilities dominate), which was a quarter of the DIRL step at batch 16
(docs/performance.md). Here each element's keep bit is a hash of its position:

    x = lowbias32(i * 0x9E3779B9 + s0) ^ s1;  keep = lowbias32(x) < round(keep_prob * 2**32)

where ``i`` is the element's flat index and (s0, s1) are two 32-bit words drawn with threefry
from the module's ``dropout`` key, once per call (one scalar draw, not one per element).
``lowbias32`` is a 32-bit integer mixer (two xor-shift / multiply rounds); two keyed rounds
make the masks of different keys, layers and steps look independent (tests/test_dropout.py
checks keep rate, neighbour correlation and agreement between keys). It costs about 1 ns per
element on the same CPU.

The module is a drop-in for ``nn.Dropout``: same fields and call, same scaling (kept elements
divided by keep_prob), ``rate == 0`` or ``deterministic`` returns the input and ``rate == 1``
returns zeros. Only the random bits differ, so a fixed seed gives other masks than flax's.

A mask of 2**32 elements or more (a large global batch: the counter counts the whole sharded
array, not one device's part) counts with two words. The shape splits into leading dimensions
and a trailing block of fewer than 2**32 elements; ``i`` is the position in the block and ``j``
the block's (row-major over the leading dimensions), and

    x = lowbias32(i * 0x9E3779B9 + s0) ^ s1 ^ lowbias32(j * 0x9E3779B9)

``lowbias32(0) == 0``, so block 0 has the one-word formula's bits, and a mask under 2**32
elements keeps exactly its one-word bits (the two-word path is never taken for it).
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

_GOLDEN = np.uint32(0x9E3779B9)  # odd: i -> i * _GOLDEN is a bijection of the 32-bit counters
# The one-word counter's range; masks this large count blocks with a second word (module
# docstring). A module constant so tests can take the two-word path at small sizes.
COUNTER_LIMIT = 2**32


class DropoutSizeError(ValueError):
    """A mask whose blocks cannot be counted with two 32-bit words."""


def _lowbias32(x: Array) -> Array:
    """A 32-bit integer mixer with low bias (C. Wellons' ``lowbias32`` constants)."""
    x = x ^ (x >> 16)
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> 16)


def keep_mask(key: Array, shape: Sequence[int], keep_prob: float) -> Array:
    """Boolean mask of ``shape``: each element True with probability ``keep_prob``.

    The probability is ``round(keep_prob * 2**32) / 2**32``, exact to 2**-32. Masks of one
    key are a pure function of the element's position, so they do not depend on how XLA
    schedules the computation (or shards it).
    """
    shape = tuple(int(d) for d in shape)
    size = int(np.prod(shape, dtype=np.int64))
    seeds = jax.random.bits(key, (2,), jnp.uint32)
    if size < COUNTER_LIMIT:
        counter = jax.lax.iota(jnp.uint32, size).reshape(shape)
        x = _lowbias32(counter * _GOLDEN + seeds[0]) ^ seeds[1]
    else:
        x = _two_word_bits(shape, seeds)
    threshold = min(round(keep_prob * 2**32), 2**32 - 1)
    return _lowbias32(x) < np.uint32(threshold)


def _two_word_bits(shape: tuple[int, ...], seeds: Array) -> Array:
    """The pre-mix bits of a mask of ``COUNTER_LIMIT`` elements or more (module docstring):
    blocks of the trailing dimensions, counted by the leading ones."""
    # The fewest leading dimensions that leave a block under the limit: the largest block.
    split = next((k for k in range(len(shape) + 1)
                  if int(np.prod(shape[k:], dtype=np.int64)) < COUNTER_LIMIT), len(shape))
    lead, block = shape[:split], shape[split:]
    blocks = int(np.prod(lead, dtype=np.int64))
    if blocks >= COUNTER_LIMIT:  # one dimension of 2**32 or more, or 2**64 elements
        raise DropoutSizeError(
            f"dropout over shape {shape}: its trailing dimensions do not split into under "
            f"2**32 blocks of under 2**32 elements")
    inner = jax.lax.iota(jnp.uint32, int(np.prod(block))).reshape((1,) * split + block)
    outer = jax.lax.iota(jnp.uint32, blocks).reshape(lead + (1,) * len(block))
    x = _lowbias32(inner * _GOLDEN + seeds[0]) ^ seeds[1]
    return x ^ _lowbias32(outer * _GOLDEN)


class Dropout(nn.Module):
    """``nn.Dropout`` with hashed masks (module docstring).

    Attributes:
      rate: probability of zeroing an element.
      broadcast_dims: dimensions that share one mask value (as in ``nn.Dropout``).
      deterministic: default of the call's ``deterministic``.
      rng_collection: the rng stream the key comes from.
    """

    rate: float
    broadcast_dims: Sequence[int] = ()
    deterministic: bool | None = None
    rng_collection: str = "dropout"

    @nn.compact
    def __call__(self, inputs: Array, deterministic: bool | None = None,
                 rng: Array | None = None) -> Array:
        deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
        if self.rate == 0.0 or deterministic:
            return inputs
        if self.rate == 1.0:
            return jnp.zeros_like(inputs)
        keep_prob = 1.0 - self.rate
        if rng is None:
            rng = self.make_rng(self.rng_collection)
        mask_shape = list(inputs.shape)
        for dim in self.broadcast_dims:
            mask_shape[dim] = 1
        mask = jnp.broadcast_to(keep_mask(rng, mask_shape, keep_prob), inputs.shape)
        return jnp.where(mask, inputs / keep_prob, jnp.zeros_like(inputs))
