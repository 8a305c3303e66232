"""Every model of the trunk satisfies the model contract (changecap_jax/models/contract.py),
and the caption-stream table (changecap_jax/data/streams.py) agrees with itself."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from changecap_jax import models
from changecap_jax.data import streams
from changecap_jax.models import contract
from changecap_jax.models.base import MEMORY_LAYOUTS, DecodingRules

MODEL_CLASSES = sorted(models.MODELS.items())


@pytest.mark.parametrize(("name", "cls"), MODEL_CLASSES)
def test_model_satisfies_the_protocol(name, cls):
    model = cls(vocab_size=10, max_len=8)
    assert isinstance(model, contract.CaptionModel), name
    assert cls.MEMORY_LAYOUT in MEMORY_LAYOUTS
    assert isinstance(model.decoding_rules, DecodingRules)
    assert set(model.streams) <= set(streams.STREAMS)
    assert all(isinstance(k, int) for k in model.extra_tokens)
    assert all(isinstance(v, tuple) for v in model.conditioning_shapes.values())
    call = inspect.signature(cls.__call__).parameters
    for keyword in ("train", "axis_name"):
        assert call[keyword].kind is inspect.Parameter.KEYWORD_ONLY, (name, keyword)
    assert inspect.signature(cls.encode).parameters["train"].default is False


@pytest.mark.parametrize(("name", "cls"), MODEL_CLASSES)
def test_capabilities_are_declared_not_discovered(name, cls):
    # Declared on the class itself, not inherited from a default.
    assert "capabilities" in vars(cls), name
    assert "MEMORY_LAYOUT" in vars(cls), name
    assert cls.capabilities <= set(contract.CAPABILITIES)
    for capability in contract.CAPABILITIES:
        declared = capability in cls.capabilities
        assert hasattr(cls, capability) == declared, (name, capability)
        assert contract.has_capability(cls(vocab_size=10, max_len=8), capability) == declared


def test_capability_accessors():
    scorer = models.MODELS["scorer"](vocab_size=10, max_len=8)
    idc = models.MODELS["idc_pcl"](vocab_size=10, max_len=8)
    assert contract.post_update_fn(scorer) is not None
    assert contract.post_update_fn(idc) is None
    assert contract.distractor_classifier(idc) is not None
    assert contract.distractor_classifier(scorer) is None
    dirl = models.MODELS["dirl"]
    assert contract.change_router(dirl(vocab_size=10, max_len=8)) is None  # MEDIC off
    router = contract.change_router(dirl(vocab_size=10, max_len=8,
                                         medic={"dataset_types": ["add"]}))
    assert router is not None and router[1] == ("color", "material", "add", "drop", "move")
    with pytest.raises(ValueError, match="unknown capability"):
        contract.has_capability(scorer, "fly")


def test_stream_views_agree_with_the_table():
    assert streams.STREAM_KEYS == {"semantic": ("after_semantic", "change_caption"),
                                   "distractor": ("after_distractor", "no_change_caption")}
    assert streams.STREAM_INPUTS == {
        "semantic": ("after_semantic", "change_captions", ""),
        "distractor": ("after_distractor", "no_change_captions", "_n")}
    assert streams.DISTRACTOR_LABELS == {"semantic": 1, "distractor": 0}
    assert streams.pair_streams("both") == ("semantic", "distractor")
    assert streams.pair_streams("semantic_only") == ("semantic",)
    with pytest.raises(ValueError, match="pairs must be one of"):
        streams.check_pairs("all")


def test_example_batch_and_validation():
    batch = streams.example_batch(("semantic", "distractor"), (2, 3, 4), 5,
                                  conditioning={"entities": (3, 6)}, start_id=2)
    assert tuple(batch) == streams.batch_keys(("semantic", "distractor"), ("entities",))
    assert batch["before"].shape == (1, 2, 3, 4) and batch["before"].dtype == np.float32
    assert batch["no_change_caption"].tolist() == [[2, 0, 0, 0, 0]]
    assert batch["entities_distractor"].shape == (1, 3, 6)
    streams.validate_batch(batch, ("semantic", "distractor"), model="M")
    with pytest.raises(KeyError, match="M batch is missing.*after_distractor"):
        streams.validate_batch({k: v for k, v in batch.items() if k != "after_distractor"},
                               ("semantic", "distractor"), model="M")
    with pytest.raises(ValueError, match=r"batch\['change_caption'\] must be \(B, L\)"):
        streams.validate_batch({**batch, "change_caption": batch["before"]}, ("semantic",),
                               model="M")
    streams.validate_batch({**batch, "before": batch["before"][0]}, ("semantic",), model="M",
                           check_ranks=False)


def test_caption_targets_shift_inside_the_mask():
    ids = np.array([[2, 7, 8, 3, 0, 0]], np.int32)
    assert streams.caption_mask(ids).tolist() == [[True] * 4 + [False] * 2]
    assert streams.make_caption_targets(ids).tolist() == [[7, 8, 3, -1, -1, -1]]
