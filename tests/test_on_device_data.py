"""The training split on the devices (``config.dataset.on_device``) and device prefetch
(``config.data.device_prefetch``) give the streaming loader's batches and losses exactly, on
8 CPU devices, and resume where the loader would; a split too big for the devices is refused.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from train_helpers import SMALL, tiny_config

from changecap_jax.data import datasets, pipeline
from changecap_jax.trainers import captioning, on_device_data
from changecap_jax.trainers.device_prefetch import DevicePrefetch

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (CPU) devices")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("on_device_data")
    # 41 records: not a multiple of 8 devices, so the split is padded.
    datasets.prepare("synthetic", root, "moderate", {**SMALL, "num_train": 41})
    return str(root)


def _config(data_dir, mode: str, **overrides):
    config = tiny_config(data_dir, **overrides)
    config.dataset.options.num_train = 41
    config.swap_prob = 0.5  # the swap must be reproduced (about half the examples)
    config.data.device_prefetch = 2 if mode == "prefetch" else 0
    config.dataset.on_device = mode == "on_device"
    return config


def test_resident_batches_equal_the_loaders(data_dir, tmp_path):
    trainer = captioning.Trainer(_config(data_dir, "on_device"), tmp_path)
    split = trainer.resident
    assert split.records == 41 and split.per_device == 6
    gather = jax.jit(lambda arrays, choices: on_device_data.gather_batch(
        arrays, choices, trainer.mesh, split.pair_fields))
    loader_batches = iter(trainer.train_loader())
    resident = on_device_data.ResidentIterator(trainer.train_loader(), split)
    swaps = 0
    for _ in range(4):  # 16 per batch: the fourth batch is in the second epoch
        expected = pipeline.device_fields(next(loader_batches))
        choices = next(resident)
        swaps += int(choices["swap"].sum())
        got = jax.device_get(gather(split.arrays, split.to_global(choices)))
        assert sorted(got) == sorted(expected)
        for key, value in expected.items():
            assert got[key].dtype == value.dtype, key
            np.testing.assert_array_equal(got[key], value, err_msg=key)
    assert 0 < swaps < 64


def _losses(trainer) -> list[float]:
    trainer.train()
    return [scalars["loss"] for _, scalars in trainer.history]


def test_losses_equal_the_loaders_with_prefetch_and_on_device(data_dir, tmp_path):
    losses = {mode: _losses(captioning.Trainer(_config(data_dir, mode), tmp_path / mode))
              for mode in ("loader", "prefetch", "on_device")}
    assert len(losses["loader"]) == 3
    assert losses["prefetch"] == losses["loader"]
    assert losses["on_device"] == losses["loader"]


def test_on_device_resume_equals_an_uninterrupted_run(data_dir, tmp_path):
    full = _losses(captioning.Trainer(_config(data_dir, "on_device", num_train_steps=4),
                                      tmp_path / "full"))
    captioning.Trainer(_config(data_dir, "on_device", num_train_steps=2),
                       tmp_path / "run").train()  # its final checkpoint is step 2
    # Resumed on the streaming path with prefetch: the state is the loader's own.
    for mode, steps in (("on_device", 3), ("prefetch", 4)):
        again = captioning.Trainer(_config(data_dir, mode, num_train_steps=steps),
                                   tmp_path / "run")
        again.train()
        assert [s for s, _ in again.history] == [steps]
        assert again.history[-1][1]["loss"] == full[steps - 1], mode


def test_prefetch_state_counts_consumed_batches(data_dir, tmp_path):
    trainer = captioning.Trainer(_config(data_dir, "prefetch"), tmp_path)
    loader = trainer.train_loader()
    host = lambda b: b  # noqa: E731 (the order, not the transfer, is tested here)
    stream = DevicePrefetch(iter(loader), host, depth=2)
    seen = [next(stream)["id"] for _ in range(2)]
    state = stream.get_state()  # the thread has read ahead by now
    after = next(stream)["id"]
    stream.close()
    again = DevicePrefetch(iter(loader), host, depth=2)
    again.set_state(state)
    np.testing.assert_array_equal(next(again)["id"], after)
    again.close()
    plain = iter(loader)
    for ids in [*seen, after]:
        np.testing.assert_array_equal(next(plain)["id"], ids)


def test_a_split_too_big_for_the_devices_is_refused_in_one_line(data_dir, tmp_path,
                                                               monkeypatch):
    monkeypatch.setenv(on_device_data.BOUND_ENV, "1000")
    trainer = captioning.Trainer(_config(data_dir, "on_device"), tmp_path)
    with pytest.raises(on_device_data.DoesNotFitError) as error:
        trainer.resident  # noqa: B018
    message = str(error.value)
    assert "\n" not in message
    per_record = on_device_data.record_bytes(trainer.dataset.split("train")[0])
    assert f"needs {6 * per_record:,} bytes per device" in message
    assert "1,000 available" in message


def test_aot_adds_the_split_bytes_per_chip_when_on_device(data_dir):
    from changecap_jax.commands import aot_programs
    from changecap_jax.commands import synthetic_inputs as si

    config = _config(data_dir, "on_device")
    shapes = si.InputShapes((4, 4, 16), 76, 16)
    per_record = 3 * 4 * 4 * 16 * 2 + 2 * 6 * 16 * 4 + 8  # float16 grids, 6 captions a stream
    config.dataset.options.captions_per_pair = 6
    assert aot_programs.resident_dataset_bytes(config, shapes, 8, "float16") == 6 * per_record
    config.dataset.on_device = False
    assert aot_programs.resident_dataset_bytes(config, shapes, 8, "float16") == 0
