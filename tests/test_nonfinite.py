"""A diverged run never checkpoints a non-finite state (update.NONFINITE_METRIC,
loop.FiniteGuard): it stops with one line and exit status 3, or skips such updates when
``config.skip_nonfinite_updates`` says so. The end-to-end run is also the console's test:
stderr off a terminal holds log lines only (no progress-bar fragments, no library INFO lines),
and so does ``export`` of its workdir."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from train_helpers import SMALL, toy_loss_fn

from changecap_jax import parallel
from changecap_jax.data import datasets
from changecap_jax.errors import TrainingDivergedError
from changecap_jax.io import checkpoints
from changecap_jax.trainers import loop, update

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
# absl's log line prefix: level letter, date, time, thread, file:line]
LOG_LINE = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+\d+ ([\w.]+):\d+\] ")


def _toy_update(skip: bool):
    """An update of w by Adam(0.1) on sum(w * x) over the global batch."""
    mesh = parallel.make_mesh(1)
    loss_fn = toy_loss_fn(mesh)
    optimizer = optax.adam(0.1)
    step = update.make_update_step(loss_fn, optimizer, mesh, optax.constant_schedule(0.1),
                                   skip_nonfinite=skip)
    params = {"w": jnp.ones((3,))}
    state = update.TrainState(step=jnp.int32(0), params=params,
                              opt_state=optimizer.init(params), rng=jax.random.PRNGKey(0))

    def batch(value: float):
        return {"x": jax.device_put(np.full((2, 3), value, np.float32),
                                    parallel.batch_sharding(mesh))}

    return step, state, batch


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_the_update_flags_a_non_finite_step(bad):
    step, state, batch = _toy_update(skip=False)
    state, metrics = step(state, batch(1.0))
    assert int(metrics[update.NONFINITE_METRIC]) == 0
    state, metrics = step(state, batch(bad))
    assert int(metrics[update.NONFINITE_METRIC]) == 1
    assert not np.isfinite(np.asarray(state.params["w"])).all()  # applied: the loop stops


def test_a_skipped_update_leaves_params_and_optimizer_state_as_they_were():
    step, state, batch = _toy_update(skip=True)
    state, _ = step(state, batch(1.0))
    kept_params, kept_opt = jax.device_get((state.params, state.opt_state))
    state, metrics = step(state, batch(np.nan))
    assert int(metrics[update.NONFINITE_METRIC]) == 1 and int(state.step) == 2
    np.testing.assert_array_equal(state.params["w"], kept_params["w"])
    for got, want in zip(jax.tree_util.tree_leaves(state.opt_state),
                         jax.tree_util.tree_leaves(kept_opt), strict=True):
        np.testing.assert_array_equal(got, want)
    state, metrics = step(state, batch(1.0))  # a finite step after it is applied again
    assert int(metrics[update.NONFINITE_METRIC]) == 0
    assert np.abs(np.asarray(state.params["w"]) - kept_params["w"]).max() > 0


class _Manager:
    directory = "/run/checkpoints"

    def __init__(self, latest):
        self.latest = latest

    def wait_until_finished(self):
        pass

    def latest_step(self):
        return self.latest


def test_the_guard_names_the_first_bad_step_and_the_checkpoint_kept():
    guard = loop.FiniteGuard(skip=False)
    for step, flag in [(5, 0), (6, 1), (7, 1)]:
        metrics = {"loss": 1.0, update.NONFINITE_METRIC: jnp.int32(flag)}
        guard.add(step, metrics)
        assert update.NONFINITE_METRIC not in metrics  # not a scalar to log
    with pytest.raises(TrainingDivergedError,
                       match=r"step 6 gave a non-finite .* step 4 in /run/checkpoints"):
        guard.check(_Manager(4))
    guard.add(1, {update.NONFINITE_METRIC: jnp.int32(1)})
    with pytest.raises(TrainingDivergedError, match="No checkpoint was saved"):
        guard.check(_Manager(None))


def test_the_guard_counts_skipped_updates_per_log_window():
    guard = loop.FiniteGuard(skip=True)
    for step, flag in [(1, 0), (2, 1), (3, 1)]:
        guard.add(step, {update.NONFINITE_METRIC: jnp.int32(flag)})
    guard.check(_Manager(None))  # no error: the state stayed finite
    guard.add(4, {update.NONFINITE_METRIC: jnp.int32(1)})
    guard.check(_Manager(None))
    assert guard.take_skipped() == 3 and guard.take_skipped() == 0


# -- a diverging run, end to end ------------------------------------------------------------


@pytest.fixture(scope="module")
def diverged_run(tmp_path_factory):
    """``python -m changecap_jax.main`` of the tiny DIRL config with learning rate 1e20 (the
    first Adam step moves every parameter by ~1e20, so step 2's forward pass overflows),
    checkpointing every step and logging only at the end, stderr a pipe (not a terminal)."""
    root = tmp_path_factory.mktemp("diverged")
    datasets.prepare("synthetic", root / "data", "moderate", SMALL)
    config_file = root / "tiny.py"
    config_file.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        from train_helpers import tiny_config

        def get_config(preset=""):
            return tiny_config({str(root / "data")!r}, num_train_steps=4,
                               checkpoint_every_steps=1, log_every_steps=1000)
        """))
    workdir = root / "work"
    done = _command(["changecap_jax.main", f"--config={config_file}", f"--workdir={workdir}",
                     "--config.optim.learning_rate=1e20"])
    return workdir, done


def _command(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu",
           "CHANGECAP_COMPILATION_CACHE": "0"}
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_diverged_run_stops_with_one_line_and_keeps_finite_checkpoints(diverged_run):
    workdir, done = diverged_run
    assert done.returncode == TrainingDivergedError.exit_status, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: training diverged: step 2 ") and "step 1 in" in last, last
    assert checkpoints.steps(workdir / "checkpoints") == [1]
    like = _params_like(workdir)
    _, params = checkpoints.restore_params(workdir, like, step=1)
    for leaf in jax.tree_util.tree_leaves(params):
        assert np.isfinite(np.asarray(leaf)).all()


def _params_like(workdir: Path):
    """The tiny model's parameter shapes, read from the run's own config."""
    from changecap_jax.io import run_config
    from changecap_jax.trainers import captioning

    config = run_config.load_workdir_config(workdir)
    trainer = captioning.Trainer(config, workdir / "scratch", mesh=parallel.make_mesh(1))
    return jax.eval_shape(lambda: trainer.init_state().params)


def _non_log_lines(stderr: str) -> list[str]:
    """Lines of ``stderr`` that are neither absl log lines nor the final error line."""
    return [line for line in stderr.splitlines()
            if line.strip() and not LOG_LINE.match(line) and not line.startswith("error: ")]


def _package_files() -> set[str]:
    return {p.name for folder in ("changecap_jax", "data_prep")
            for p in (REPO / folder).rglob("*.py")}


def test_stderr_off_a_terminal_holds_log_lines_only(diverged_run):
    _, done = diverged_run
    assert _non_log_lines(done.stderr) == [], done.stderr[-3000:]
    # The progress bar became log lines: the training's start and its end.
    assert re.search(r"\] train: \d+/4 \[", done.stderr), done.stderr[-3000:]
    info_from = {m.group(1) for line in done.stderr.splitlines()
                 if line.startswith("I") and (m := LOG_LINE.match(line))}
    assert info_from <= _package_files(), info_from - _package_files()


def test_export_prints_no_library_info_lines(diverged_run, tmp_path):
    workdir, _ = diverged_run
    done = _command(["changecap_jax", "export", f"--workdir={workdir}", f"--out={tmp_path}/m"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "m").is_dir()
    info_from = {m.group(1) for line in done.stderr.splitlines()
                 if line.startswith("I") and (m := LOG_LINE.match(line))}
    assert info_from <= _package_files(), info_from - _package_files()
    assert _non_log_lines(done.stderr) == [], done.stderr[-3000:]
