"""What the ablation-preset tests of every model check: a preset switches exactly the config
fields its ABLATIONS entry names, to the values it names (configs/*.py, docs/ablations.md)."""

from __future__ import annotations

from collections.abc import Mapping

import flax
import ml_collections


def flatten(config: ml_collections.ConfigDict) -> dict[str, object]:
    """``{"model.use_sim": False, ...}``: every field of ``config`` by its dotted path."""
    return flax.traverse_util.flatten_dict(config.to_dict(), sep=".")


def assert_switches_exactly(base: Mapping[str, object], got: Mapping[str, object],
                            fields: Mapping[str, object], name: str, drop: object) -> None:
    """``got`` (flattened) differs from ``base`` in exactly the paths of ``fields`` whose
    value differs there, and holds each of them (``drop``: the path is removed)."""
    changed = {p for p in base.keys() | got.keys() if base.get(p, drop) != got.get(p, drop)}
    assert changed == {p for p, v in fields.items() if base.get(p, drop) != v}, name
    for path, value in fields.items():
        assert got.get(path, drop) == value, (name, path)
