"""A workdir's orbax checkpoints: the manager of (train state, data iterator state) items."""

from __future__ import annotations

import os
from pathlib import Path

import orbax.checkpoint as ocp


def make_checkpoint_manager(directory: str | os.PathLike, keep: int,
                            item_names: tuple[str, ...] = ("state", "data"),
                            ) -> ocp.CheckpointManager:
    """orbax manager of (train state, data iterator state) items.

    Keeps the latest ``keep`` checkpoints plus the one with the best ``val_CIDEr`` metric;
    every save is atomic (written to a temporary directory, renamed when complete) and
    multi-host safe.
    """
    from orbax.checkpoint import checkpoint_managers as cm

    policy = cm.AnyPreservationPolicy([
        cm.LatestN(keep),
        # Ascending sort, the last n kept: the highest CIDEr survives.
        cm.BestN(get_metric_fn=lambda m: m["val_CIDEr"], reverse=False, n=1,
                 keep_checkpoints_without_metrics=False),
    ])
    options = ocp.CheckpointManagerOptions(
        preservation_policy=policy, enable_async_checkpointing=False, create=True)
    return ocp.CheckpointManager(Path(directory).absolute(), options=options,
                                 item_names=item_names)
