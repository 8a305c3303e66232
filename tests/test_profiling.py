"""A jax.profiler trace of chosen training steps (config.profile_steps,
changecap_jax/trainers/profiling.py): written under the workdir for TensorBoard's profile
plugin, naming the train step, off by default, copied into a bucket workdir."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from gcs_helpers import BUCKET, fake_gcs
from train_helpers import SMALL, tiny_config

from changecap_jax.data import datasets
from changecap_jax.io import paths
from changecap_jax.trainers import captioning, profiling


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("profile_data")
    datasets.prepare("synthetic", root, "moderate", SMALL)
    return str(root)


def _traces(folder: Path) -> list[Path]:
    # TensorBoard's profile plugin reads <logdir>/plugins/profile/<run>/<host>.xplane.pb.
    return sorted(folder.glob("plugins/profile/*/*.xplane.pb"))


def test_a_tiny_run_writes_a_trace_of_its_train_step(data_dir, tmp_path):
    config = tiny_config(data_dir, num_train_steps=2, profile_steps=(2, 1))
    trainer = captioning.Trainer(config, tmp_path / "w")
    trainer.train()
    traces = _traces(tmp_path / "w" / profiling.PROFILE_DIR)
    assert len(traces) == 1, list((tmp_path / "w").rglob("*"))
    # The jitted update (trainers/update.py) is named in the trace; step 2 ran its compiled
    # program, so the trace holds an execution of it, not only a compile.
    assert b"jit_train_step" in traces[0].read_bytes()
    assert [s for s, _ in trainer.history] == [1, 2]  # every step ran and was logged


def test_profiling_is_off_by_default(data_dir, tmp_path):
    config = tiny_config(data_dir, num_train_steps=1)
    assert config.profile_steps == ()
    captioning.Trainer(config, tmp_path / "w").train()
    assert not (tmp_path / "w" / profiling.PROFILE_DIR).exists()


@pytest.mark.parametrize("value, steps", [((), None), ((5, 0), None), ((5, 3), (5, 3)),
                                          ([1, 1], (1, 1))])
def test_parse_steps(value, steps):
    assert profiling.parse_steps(value) == steps


@pytest.mark.parametrize("value", [(5,), (0, 2), (2, -1), (1.5, 2), (1, 2, 3)])
def test_a_bad_profile_steps_is_a_user_error(value):
    with pytest.raises(profiling.ProfileStepsError, match="profile_steps"):
        profiling.parse_steps(value)


def _traced_steps(profiler: profiling.StepProfiler, steps: range) -> None:
    f = jax.jit(lambda x: x * 2.0 + 1.0)
    x = jnp.ones((8,))
    for step in steps:
        x = profiler.step(step, f, x)
    profiler.close()


def test_a_run_resumed_past_the_start_and_other_processes_trace_nothing(tmp_path):
    # Resumed after step 4: steps 5.. run, the trace of (3, 2) would start before them.
    _traced_steps(profiling.StepProfiler((3, 2), tmp_path / "a", True, 4), range(5, 8))
    _traced_steps(profiling.StepProfiler((3, 2), tmp_path / "b", False, 0), range(1, 8))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_bucket_workdir_gets_the_trace_copied_in():
    with fake_gcs():
        workdir = f"gs://{BUCKET}/profiled"
        _traced_steps(profiling.StepProfiler((2, 2), workdir, True, 0), range(1, 5))
        traces = list(paths.path(workdir).glob(
            f"{profiling.PROFILE_DIR}/plugins/profile/*/*.xplane.pb"))
        assert len(traces) == 1 and b"jit_" in traces[0].read_bytes(), traces
