"""The ResNet-101 network, now in the library
(``changecap_jax/features/resnet.py``: ``predict`` needs it too); its names stay importable
from here for the ``data_prep`` commands and scripts."""

from changecap_jax.features.resnet import *  # noqa: F403
