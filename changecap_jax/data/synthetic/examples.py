"""The synthetic set's examples without TFDS: defaults, the seeded scene of an example id and its
three rendered views.

The TFDS builder (``builder.py``) writes these into records; the GPU check
(``changecap_jax/commands/gpu_check.py``) makes them in memory on a host that has no TFDS or
grain. Both get the same scene, captions and images for a (seed, example id).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from changecap_jax.data.synthetic import render, scenes

DEFAULT_SIZES = {"train": 3000, "val": 300, "test": 600}
DEFAULT_FEATURE_SHAPE = (8, 8, 64)
DEFAULT_IMAGE_SIZE = (128, 128)
DEFAULT_MAX_CAPTION_LEN = 16
DEFAULT_FEATURE_DTYPE = "float16"
DEFAULT_CAPTIONS_PER_PAIR = 6
# The features/grid.py extractor version of the newest builder (2.0.0; 1 before it).
GRID_EXTRACTOR_VERSION = 2
# The record key of each view; the distractor view shows the before scene from another camera.
VIEWS = ("before", "after_semantic", "after_distractor")


def example_rng(seed: int, example_id: int) -> np.random.Generator:
    """The generator of one example: independent of every other example."""
    return np.random.default_rng([seed, example_id])


def change_type_of(example_id: int) -> str:
    return scenes.CHANGE_TYPES[example_id % len(scenes.CHANGE_TYPES)]


def sample_example(seed: int, example_id: int, distractors: str = "moderate",
                   captions_per_pair: int = DEFAULT_CAPTIONS_PER_PAIR) -> scenes.Example:
    """The scene, change and captions of example ``example_id`` of the set seeded ``seed``."""
    return scenes.sample_example(example_rng(seed, example_id), change_type_of(example_id),
                                 distractors, captions_per_pair)


def render_views(ex: scenes.Example, image_size: tuple[int, int]
                 ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The three images of ``ex`` (uint8 H x W x 3, by ``VIEWS`` key) and each one's object
    boxes, as ``render.render`` returns them."""
    views = {
        "before": (ex.before, ex.camera_before, ex.light_before),
        "after_semantic": (ex.after, ex.camera_semantic, ex.light_semantic),
        "after_distractor": (ex.before, ex.camera_distractor, ex.light_distractor),
    }
    images, boxes = {}, {}
    for key, (objects, cam, light) in views.items():
        images[key], boxes[key] = render.render(objects, cam, light, image_size)
    return images, boxes
