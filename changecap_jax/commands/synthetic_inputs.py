"""Random training batches of a dataset's shapes, to time a model without building its data.

A model on the trunk reads ``before``, and per caption stream (``semantic``, plus
``distractor`` when it trains on both pairs) the after-image and the caption ids, named by
``changecap_jax/data/streams.py``; a model with conditioning inputs
(``models.base.conditioning_shapes``, e.g. CHEERS's retrieved entities) also reads
``<name>_<stream>``. :func:`make_batch` fills those with random values
of the right shapes and dtypes: features from N(0, 1), captions ``<START> w ... <END>`` of
random length, zero-padded. :func:`check_model_reads` then runs the model's ``init`` on
shapes only, so a model that reads anything else is refused with the key it asked for.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import ml_collections
import numpy as np

from changecap_jax.data.streams import BEFORE, STREAMS
from changecap_jax.data.synthetic.examples import DEFAULT_MAX_CAPTION_LEN
from changecap_jax.data.vocab import END_ID, START_ID
from changecap_jax.errors import UserError
from changecap_jax.models import contract
from changecap_jax.models.base import conditioning_shapes

FIRST_WORD_ID = 4  # ids 0..3 are <NULL>, <UNK>, <START>, <END>
LAYER3_GRID = (14, 14, 1024)  # ResNet-101 layer3: SCORER, DIRL, CHEERS, Subtraction
LAYER4_GRID_HW = (7, 7)  # ResNet-101 layer4 (x 2048): IDC-PCL


class SyntheticInputError(UserError, ValueError):
    """The benchmark cannot make a batch this model or config reads."""


@dataclasses.dataclass(frozen=True)
class InputShapes:
    feature_shape: tuple[int, int, int]  # (H, W, C) of each image's grid
    vocab_size: int
    caption_len: int  # padded caption ids per example (the dataset's max_caption_len)


# The built datasets' vocabulary sizes and caption lengths (python -m data_prep.build).
PAPER_VOCAB = {"clevr_change": (76, 24), "clevr_dc": (87, 40)}
# The synthetic scenes' captions use words of CLEVR-Change's 76-word vocabulary only, so 76
# bounds the built vocabulary (about 70); the step's cost hardly depends on the difference.
SYNTHETIC_VOCAB = 76


def input_shapes(
    config: ml_collections.ConfigDict, *, feature_shape: tuple[int, ...] | None = None,
    vocab_size: int | None = None, caption_len: int | None = None,
) -> InputShapes:
    """The shapes of ``config``'s dataset, each overridable; a dataset without recorded sizes
    needs ``vocab_size`` and ``caption_len``."""
    name = config.dataset.name
    if name == "synthetic":
        grid = tuple(config.dataset.options.get("feature_shape", (8, 8, 64)))
        vocab, length = SYNTHETIC_VOCAB, DEFAULT_MAX_CAPTION_LEN
    else:
        image_dim = config.model.get("image_dim")  # a model with a fixed input width
        grid = (*LAYER4_GRID_HW, image_dim) if image_dim else LAYER3_GRID
        vocab, length = PAPER_VOCAB.get(name, (None, None))
    vocab, length = vocab_size or vocab, caption_len or length
    if vocab is None or length is None:
        raise SyntheticInputError(
            f"no recorded vocabulary size / caption length for dataset {name!r} (known: "
            f"synthetic, {', '.join(PAPER_VOCAB)}); give --vocab_size and --caption_len")
    grid = tuple(int(v) for v in (feature_shape or grid))
    if len(grid) != 3:
        raise SyntheticInputError(f"feature shape must be (H, W, C), got {grid}")
    return InputShapes(grid, int(vocab), int(length))


def random_captions(rng: np.random.Generator, batch_size: int, length: int,
                    vocab_size: int) -> np.ndarray:
    """(B, length) int32: START, 1..length-2 random words, END, zero padding."""
    ids = np.zeros((batch_size, length), np.int32)
    num_words = rng.integers(1, length - 2, size=batch_size, endpoint=True)
    for row, n in zip(ids, num_words, strict=True):
        row[0] = START_ID
        row[1:n + 1] = rng.integers(FIRST_WORD_ID, vocab_size, size=n)
        row[n + 1] = END_ID
    return ids


def make_batch(model: Any, batch_size: int, feature_shape: tuple[int, int, int],
               caption_len: int, vocab_size: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A random training batch with every key ``model`` reads (module docstring)."""
    if caption_len < 3 or vocab_size <= FIRST_WORD_ID:
        raise SyntheticInputError(f"need caption_len >= 3 and vocab_size > {FIRST_WORD_ID}, "
                                  f"got {caption_len} and {vocab_size}")
    rng = np.random.default_rng(seed)

    def floats(*shape: int) -> np.ndarray:
        return rng.standard_normal((batch_size, *shape), dtype=np.float32)

    batch = {BEFORE: floats(*feature_shape)}
    for stream in contract.model_streams(model):
        batch[STREAMS[stream].after] = floats(*feature_shape)
        batch[STREAMS[stream].caption] = random_captions(rng, batch_size, caption_len,
                                                         vocab_size)
        for name, shape in conditioning_shapes(model).items():
            batch[f"{name}_{stream}"] = floats(*shape)
    return batch


def check_model_reads(model: Any, batch: dict[str, Any]) -> None:
    """Runs ``model.init`` on the batch's shapes (nothing is computed); a key the model reads
    but the batch lacks raises :class:`SyntheticInputError` naming it."""
    specs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}
    try:
        jax.eval_shape(lambda b: model.init(jax.random.key(0), b, train=False), specs)
    except KeyError as e:
        raise SyntheticInputError(
            f"cannot synthesise a batch for {type(model).__name__}: it reads a key the "
            f"synthetic batch lacks ({e}); the batch has {sorted(batch)}") from e
