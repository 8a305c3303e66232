"""The model contract: exactly what the trunk may call on a model, as a typed Protocol.

A model on the trunk is a Flax module that satisfies :class:`CaptionModel`:

* ``__call__(batch, *, train, axis_name=None) -> ModelOutput``: one training forward pass on
  a batch laid out as ``changecap_jax/data/streams.py`` says (models/base.py explains the
  output and the rng streams);
* the decoding protocol of ``changecap_jax/decoding/search.py``: ``encode``, ``init_cache``,
  ``decode_step`` and the full-recompute reference ``decode``;
* declared attributes: ``streams`` (the caption streams it trains on), ``decoding_rules``,
  ``extra_tokens``, ``conditioning_shapes`` (models/base.py) and the class constants
  ``MEMORY_LAYOUT`` (where its decoder memory lies on the images) and ``capabilities``.

Optional capabilities are DECLARED in ``capabilities``, never discovered: the trunk calls a
capability's method only through the accessors below, which look at the declaration. Known
capabilities (:data:`CAPABILITIES`):

* ``"post_update"``: ``post_update(params) -> params``, a constraint applied after every
  optimiser update (e.g. SCORER's logit-scale clamp);
* ``"classify_distractor"``: ``classify_distractor(before, after) -> logits (B, 2)``, a
  distractor classifier whose held-out accuracy evaluation reports (1 = semantic change);
* ``"check_dataset"``: ``check_dataset(meta) -> None``, called with the dataset's
  ``DatasetMeta`` when the experiment is built; raises a one-line ``UserError`` when the dataset
  lacks what the model needs (e.g. MEDIC's change-type labels);
* ``"classify_change"``: ``classify_change(before, after) -> (change_logits (B, 2),
  type_logits (B, K))``, a change router (1 = change; K change types) whose held-out change and
  type accuracy evaluation reports, and ``change_type_names`` (a property: the K type names,
  matched by name with ``DatasetMeta.change_types``). A router that the configuration switches
  on (a plug-in such as MEDIC) is declared by its host class; an instance whose configuration
  has none says so with an empty ``change_type_names``, and the trunk then evaluates nothing.

:class:`TrunkModel` gives a model the defaults of the declared attributes (the trunk
vocabulary's token conventions, no extra tokens, no conditioning, streams from the ``pairs``
field); a model overrides what differs and always states ``MEMORY_LAYOUT`` and
``capabilities`` itself. tests/test_model_contract.py checks every model of ``models.MODELS``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Protocol, runtime_checkable

import jax

from changecap_jax.data.streams import pair_streams
from changecap_jax.models.base import DecodingRules, ModelOutput

Array = jax.Array

POST_UPDATE = "post_update"
CLASSIFY_DISTRACTOR = "classify_distractor"
CHECK_DATASET = "check_dataset"
CLASSIFY_CHANGE = "classify_change"
CAPABILITIES = (POST_UPDATE, CLASSIFY_DISTRACTOR, CHECK_DATASET, CLASSIFY_CHANGE)


@runtime_checkable
class CaptionModel(Protocol):
    """What the trunk may call on a model (module docstring)."""

    MEMORY_LAYOUT: ClassVar[str]  # one of models.base.MEMORY_LAYOUTS
    capabilities: ClassVar[frozenset[str]]  # a subset of CAPABILITIES

    @property
    def streams(self) -> tuple[str, ...]: ...

    @property
    def decoding_rules(self) -> DecodingRules: ...

    @property
    def extra_tokens(self) -> Mapping[int, str]: ...

    @property
    def conditioning_shapes(self) -> Mapping[str, tuple[int, ...]]: ...

    def __call__(self, batch: dict[str, Array], *, train: bool,
                 axis_name: Any = None) -> ModelOutput: ...

    def encode(self, before: Array, after: Array, *, train: bool = False,
               **conditioning: Array) -> Any: ...

    def init_cache(self, memory: Any, max_len: int) -> None: ...

    def decode_step(self, token: Array, index: Array) -> Array: ...

    def decode(self, memory: Any, ids: Array, *, train: bool = False) -> Array: ...


class TrunkModel:
    """Defaults of the declared attributes for a Flax model (mix in before ``nn.Module``).

    ``streams`` follows the model's ``pairs`` field (``data/streams.py``); the token
    conventions are the trunk vocabulary's; no extra tokens, no conditioning inputs.
    """

    @property
    def streams(self) -> tuple[str, ...]:
        return pair_streams(self.pairs)  # type: ignore[attr-defined]

    @property
    def decoding_rules(self) -> DecodingRules:
        return DecodingRules()

    @property
    def extra_tokens(self) -> Mapping[int, str]:
        return {}

    @property
    def conditioning_shapes(self) -> Mapping[str, tuple[int, ...]]:
        return {}


def has_capability(model: Any, name: str) -> bool:
    """Whether ``model`` declares the optional capability ``name``."""
    if name not in CAPABILITIES:
        raise ValueError(f"unknown capability {name!r}; known: {CAPABILITIES}")
    return name in getattr(type(model), "capabilities", frozenset())


def post_update_fn(model: Any) -> Callable[[Any], Any] | None:
    """The model's declared ``post_update(params) -> params``, or None."""
    return model.post_update if has_capability(model, POST_UPDATE) else None


def distractor_classifier(model: Any) -> Callable[..., Array] | None:
    """The model's declared ``classify_distractor`` method (for ``model.apply(...,
    method=...)``), or None."""
    return model.classify_distractor if has_capability(model, CLASSIFY_DISTRACTOR) else None


def dataset_check(model: Any) -> Callable[[Any], None] | None:
    """The model's declared ``check_dataset(meta)`` (raises a one-line UserError when the
    dataset lacks what the model needs, e.g. change-type labels), or None."""
    return model.check_dataset if has_capability(model, CHECK_DATASET) else None


def change_router(model: Any) -> tuple[Callable[..., Any], tuple[str, ...]] | None:
    """The model's declared ``classify_change`` method (for ``model.apply(..., method=...)``)
    and its change types' names, or None (not declared, or this instance has no router)."""
    if not has_capability(model, CLASSIFY_CHANGE):
        return None
    names = tuple(model.change_type_names)
    return (model.classify_change, names) if names else None


def model_streams(model: Any) -> tuple[str, ...]:
    """The caption streams ``model`` trains on (its declared ``streams``)."""
    return tuple(model.streams)


# Read off the Protocol, so that this list cannot drift from it: its class constants, then its
# properties and methods in the order they are declared.
CONTRACT_MEMBERS = (*CaptionModel.__annotations__, *(
    name for name in vars(CaptionModel) if not name.startswith("_") or name == "__call__"))


def missing_members(cls: type) -> list[str]:
    """The members of :class:`CaptionModel` that the class ``cls`` lacks (empty: it
    satisfies the contract as far as a class can show)."""
    return [m for m in CONTRACT_MEMBERS if not hasattr(cls, m)]
