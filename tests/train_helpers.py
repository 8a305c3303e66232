"""Tiny configs and runs shared by the trainer tests (also run as a multi-host worker)."""

from __future__ import annotations

import json
import sys

import ml_collections

SMALL = {"num_train": 40, "num_val": 12, "num_test": 10, "feature_shape": (4, 4, 16)}


def tiny_config(data_dir: str, **overrides) -> ml_collections.ConfigDict:
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    from configs import dirl

    config = dirl.get_config("synthetic")
    config.dataset.data_dir = data_dir
    config.dataset.options = dict(SMALL)
    config.model.update(hidden_dim=32, num_heads=4, word_dim=16, ffn_dim=64, mlp_hidden_dim=64)
    config.batch_size = 16
    config.eval_batch_size = 8
    config.num_train_steps = 3
    config.log_every_steps = 1
    config.eval_every_steps = 1000
    config.checkpoint_every_steps = 1000
    config.eval_splits = ()
    config.final_eval_splits = ()
    config.update(overrides)
    return config


def multihost_worker(process_id: int, port: int, data_dir: str, workdir: str) -> None:
    """One of two processes with 2 CPU devices each: trains 3 steps, prints the losses."""
    import jax

    from changecap_jax import parallel, train

    parallel.initialize_distributed(f"127.0.0.1:{port}", 2, process_id, cpu_collectives="gloo")
    assert jax.device_count() == 4 and jax.local_device_count() == 2
    # The final evaluation exercises the cross-process gather of decoded captions.
    config = tiny_config(data_dir, batch_size=8, final_eval_splits=("val",))
    trainer = train.Trainer(config, workdir)
    trainer.train()
    if process_id == 0:
        print("LOSSES " + json.dumps(trainer.history))
    jax.distributed.shutdown()


if __name__ == "__main__":
    multihost_worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
