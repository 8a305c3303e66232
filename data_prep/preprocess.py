"""The image preprocessing of the ResNet-101 extraction, now in the library
(``changecap_jax/features/preprocess.py``: ``predict`` needs it too); its names stay importable
from here for the ``data_prep`` commands and scripts."""

from changecap_jax.features.preprocess import *  # noqa: F403
