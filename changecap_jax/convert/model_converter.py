"""What a model's converter provides: :class:`ModelConverter`, one per ``config.model.name``.

The converter, ``compare`` and the command look a model's converter up in
:mod:`changecap_jax.convert.registry`; everything model-specific (the key table, how to read the
sizes and recognise the snapshot, the example batch, the extra outputs ``compare`` derives) is
a field here, filled in by the model's module in ``changecap_jax/convert/models/``
(docs/converters.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import ml_collections
import numpy as np

from changecap_jax.convert.tables import Entry, Sizes, Source, States, TokenRows
from changecap_jax.convert.torch_checkpoint import OfficialSnapshot, read_official_snapshot
from changecap_jax.data import streams

# (Flax model, outputs so far) -> more named outputs (see ModelConverter.stream_aux).
StreamAux = Callable[[Any, dict[str, np.ndarray]], dict[str, Any]]


def _no_fresh_params(model: ml_collections.ConfigDict, sizes: Sizes) -> tuple[str, ...]:
    return ()


@dataclasses.dataclass(frozen=True)
class ModelConverter:
    """What the converter needs to know about one model family.

    Attributes:
      name: ``config.model.name``.
      title: for messages.
      sources: the state_dicts of its checkpoint (official ones first).
      table: (model config, sizes) -> entries.
      sizes_from_states: (model config, states) -> the sizes the checkpoint was built with.
      check_identity: (model config, states, model_cfg) -> None, or raises WrongModelError.
      example_batch: (Flax model, sizes) -> a batch of zeros for ``model.init``.
      vocab_size_of_params: Flax params -> vocabulary size.
      read_snapshot: (path, allow_pickle=...) -> OfficialSnapshot; the official file format.
      fresh_params: (model config, sizes) -> Flax param paths that the official restore
        leaves at their fresh initialisation, so the converter initialises them as the
        trainer does without asking (IDC-PCL: the pooler, from a pretraining checkpoint).
      token_rows: None, or (model config, dataset vocabulary, vocabulary file, checkpoint
        token rows) -> :class:`TokenRows`, for checkpoints whose token ids follow another
        vocabulary file (IDC-PCL: ``--dict_json``).
      init_inputs: None (``model.init(key, example_batch, train=False)``), or (Flax model,
        sizes) -> (args, kwargs) of ``model.init`` after the key (IDC-PCL's pretraining
        model initialises through its ``pretrain`` method).
      output_fields: for ``compare.forward_outputs``: top-level module -> names of the fields
        of the plain tuple its ``__call__`` returns (unnamed fields are numbered).
      stream_aux: for ``compare.forward_outputs``: None, or (Flax model, outputs so far) ->
        more outputs, e.g. the per-stream auxiliary losses ``aux/{name}/{stream}``.
    """

    name: str
    title: str
    sources: tuple[Source, ...]
    table: Callable[[ml_collections.ConfigDict, Sizes], list[Entry]]
    sizes_from_states: Callable[[ml_collections.ConfigDict, States], Sizes]
    check_identity: Callable[[ml_collections.ConfigDict, States, Any], None]
    example_batch: Callable[[Any, Sizes], dict[str, np.ndarray]]
    vocab_size_of_params: Callable[[Mapping[str, Any]], int]
    read_snapshot: Callable[..., OfficialSnapshot] = read_official_snapshot
    fresh_params: Callable[[ml_collections.ConfigDict, Sizes], tuple[str, ...]] = (
        _no_fresh_params)
    token_rows: Callable[[ml_collections.ConfigDict, Any, str, int], TokenRows] | None = None
    init_inputs: Callable[[Any, Sizes], tuple[tuple, dict[str, Any]]] | None = None
    output_fields: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    stream_aux: StreamAux | None = None


def zero_batch(model: Any, sizes: Sizes) -> dict[str, np.ndarray]:
    """A batch of one zero example for ``model.init``: the ``before`` grid and, per stream of
    ``model.streams``, its after grid and caption ids (``data/streams.py``)."""
    return streams.example_batch(
        model.streams, (sizes.grid_height, sizes.grid_width, sizes.feature_channels),
        sizes.max_len)
