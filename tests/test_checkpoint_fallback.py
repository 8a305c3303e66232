"""Damaged checkpoints (changecap_jax/io/checkpoints.py): eval, resume and export pass them with
one warning line; a damaged step named explicitly, or no intact step at all, is a clear
error. One 4-step run (checkpoints at 2 and 4) is shared; each test damages its own copy."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest
from train_helpers import tiny_config

from changecap_jax import exported_model, parallel
from changecap_jax.commands import export
from changecap_jax.io import checkpoints, metric_writer
from changecap_jax.trainers import captioning, update


@pytest.fixture(scope="module")
def run(small_synthetic, tmp_path_factory) -> dict:
    data_dir = str(small_synthetic.directory.parents[2])
    workdir = tmp_path_factory.mktemp("fallback") / "run"
    trainer = captioning.Trainer(_config(data_dir), workdir, mesh=parallel.make_mesh(1))
    fresh = trainer.init_state()
    with pytest.MonkeyPatch.context() as patch:
        _reuse_fresh_state(patch, fresh)
        trainer.train()
    return {"data_dir": data_dir, "workdir": workdir, "history": trainer.history,
            "fresh": fresh, "train_step": trainer.train_step}


def _reuse_fresh_state(patch: pytest.MonkeyPatch, fresh: update.TrainState) -> None:
    """Every trainer starts from copies of one fresh state: ``init_state`` compiles the
    model's initialisation anew at each call (seconds each), and only its shapes matter to a
    restore. Copies, because the train step donates its input state."""
    patch.setattr(captioning.Trainer, "init_state", lambda self: jax.tree.map(jnp.copy, fresh))


def _config(data_dir: str, **overrides):
    return tiny_config(data_dir, num_train_steps=4, checkpoint_every_steps=2, **overrides)


def _copy(run: dict, tmp_path: Path) -> Path:
    workdir = tmp_path / "run"
    shutil.copytree(run["workdir"], workdir)
    return workdir


def _truncate_arrays(workdir: Path, step: int) -> None:
    """Cuts the array data files of the step's state in half (as a full disk would). All of
    them: which files a restore reads depends on the device count (OCDBT merges them)."""
    for path in (workdir / "checkpoints" / str(step) / "state").rglob("*"):
        if path.is_file() and path.parent.name == "d":
            os.truncate(path, path.stat().st_size // 2)


def _damage_messages(caplog) -> list[str]:
    # Not asyncio's "Task exception was never retrieved": orbax abandons the other reads of a
    # damaged step, and their errors are logged whenever the garbage collector meets them,
    # possibly during a later test (whose message then names an earlier test's "damaged" path).
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and r.name != "asyncio"
            and "damaged" in r.getMessage()]


def _steps(workdir: Path) -> list[int]:
    return list(checkpoints.make_checkpoint_manager(workdir / "checkpoints", 3).all_steps())


def test_eval_then_resume_fall_back_to_the_intact_step(run, tmp_path, caplog, monkeypatch):
    workdir = _copy(run, tmp_path)
    _truncate_arrays(workdir, 4)
    _reuse_fresh_state(monkeypatch, run["fresh"])
    scored = []
    with monkeypatch.context() as patch, caplog.at_level(logging.WARNING):
        patch.setattr(captioning.Trainer, "evaluate",  # the decoding is not what this tests
                      lambda self, state, split, step, writer=None: scored.append(step) or {})
        captioning.evaluate_checkpoint(_config(run["data_dir"], final_eval_splits=("val",)),
                                       workdir)
    assert scored == [2]
    (message,) = _damage_messages(caplog)
    assert message.startswith(f"checkpoint 4 in {workdir / 'checkpoints'} is damaged (")
    assert message.endswith("; falling back to step 2") and "\n" not in message
    assert _steps(workdir) == [2, 4]  # eval leaves the workdir as it is

    caplog.clear()
    resumed = captioning.Trainer(_config(run["data_dir"]), workdir, mesh=parallel.make_mesh(1))
    resumed.train_step = run["train_step"]  # the same update, compiled once for the module
    with caplog.at_level(logging.WARNING):
        resumed.train()
    (message,) = _damage_messages(caplog)
    assert "kept as 4.damaged" in message
    # Steps 3 and 4 again, exactly as the uninterrupted run made them.
    losses = [(step, m["loss"], m["loss/dirl"]) for step, m in resumed.history]
    assert losses == [(step, m["loss"], m["loss/dirl"]) for step, m in run["history"][2:]]
    lines = (workdir / metric_writer.SCALARS_FILE).read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]
    # The new step 4 was saved beside the damaged one kept for inspection, and restores.
    assert _steps(workdir) == [2, 4] and (workdir / "checkpoints" / "4.damaged").is_dir()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        step, _ = checkpoints.restore(
            checkpoints.make_checkpoint_manager(workdir / "checkpoints", 3),
            lambda step, items: {"state": ocp.args.StandardRestore()})
    assert step == 4 and not _damage_messages(caplog)


def test_a_damaged_step_named_explicitly_is_an_error(run, tmp_path, monkeypatch):
    workdir = _copy(run, tmp_path)
    _truncate_arrays(workdir, 4)
    _reuse_fresh_state(monkeypatch, run["fresh"])
    config = _config(run["data_dir"], final_eval_splits=("val",))
    with pytest.raises(checkpoints.CheckpointError,
                       match=r"^checkpoint 4 in .* is damaged \(.+\); intact steps: \[2\]$"):
        captioning.evaluate_checkpoint(config, workdir, step=4)
    manager = checkpoints.make_checkpoint_manager(workdir / "checkpoints", 3)
    with pytest.raises(checkpoints.CheckpointError, match=r"no checkpoint of step 3 .*\[2, 4\]"):
        checkpoints.restore(manager, lambda step, items: {}, step=3)
    assert _steps(workdir) == [2, 4]


def test_no_intact_step_is_an_error_naming_each(run, tmp_path, monkeypatch):
    workdir = _copy(run, tmp_path)
    _reuse_fresh_state(monkeypatch, run["fresh"])
    _truncate_arrays(workdir, 4)
    # Step 2's model state is whole, but its data iterator's state is not: damaged too.
    (workdir / "checkpoints" / "2" / "data" / "process_0-of-1.json").write_text('{"format"')
    with pytest.raises(checkpoints.CheckpointError) as error:
        captioning.Trainer(_config(run["data_dir"]), workdir, mesh=parallel.make_mesh(1)).train()
    message = str(error.value)
    assert message.startswith(f"no intact checkpoint in {workdir / 'checkpoints'}")
    assert "step 4: unreadable arrays" in message and "step 2: data/process_0-of-1.json" in message
    assert _steps(workdir) == [2, 4]  # nothing renamed when nothing could be restored


def test_export_takes_the_next_preferred_step(run, tmp_path, caplog, monkeypatch):
    workdir = _copy(run, tmp_path)
    _reuse_fresh_state(monkeypatch, run["fresh"])
    _truncate_arrays(workdir, 4)
    with caplog.at_level(logging.WARNING):
        out = export.export_model(workdir, tmp_path / "exported")
    assert exported_model.load_exported(out).step == 2
    assert len(_damage_messages(caplog)) == 1


def test_a_mismatch_is_not_taken_for_damage(tmp_path):
    manager = checkpoints.make_checkpoint_manager(tmp_path, 3)
    for step in (2, 4):
        manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave({"w": jnp.zeros((2,))})))
    manager.wait_until_finished()
    wrong = {"w": jnp.zeros((3,))}  # e.g. another model config
    with pytest.raises(ValueError, match="not compatible with the stored shape"):
        checkpoints.restore(manager, lambda step, items: {"state": ocp.args.StandardRestore(wrong)})


def test_the_command_passes_a_damaged_step_with_its_warning_line_alone(run, tmp_path):
    """orbax abandons a damaged step's other reads; their failures reach Python's unraisable
    hook with nobody to catch them (one traceback each, thousands of lines on a real run).
    The command's stderr holds the warning line and no traceback."""
    workdir = _copy(run, tmp_path)
    _truncate_arrays(workdir, 4)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
           "JAX_PLATFORMS": "cpu", "CHANGECAP_COMPILATION_CACHE": "0"}
    done = subprocess.run([sys.executable, "-m", "changecap_jax", "export",
                           f"--workdir={workdir}", f"--out={tmp_path}/exported"],
                          env=env, capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "checkpoint 4" in done.stderr and "falling back to step 2" in done.stderr
    for noise in ("Traceback", "Exception ignored", "Event loop is closed"):
        assert noise not in done.stderr, done.stderr[:3000]


def _abandon_a_read_task(error: BaseException) -> None:
    """What orbax leaves when it gives up a damaged step while another read runs as an asyncio
    task (more reads get that far on a loaded machine): a failed task that nobody awaits,
    whose error asyncio logs when the task is collected."""
    async def _read_array_index_and_device_put():
        raise error

    loop = asyncio.new_event_loop()
    task = loop.create_task(_read_array_index_and_device_put())
    loop.run_until_complete(asyncio.sleep(0.01))
    loop.close()
    assert task.done()
    del task
    gc.collect()


def test_an_abandoned_read_task_of_a_damaged_step_logs_nothing(run, tmp_path, caplog):
    workdir = _copy(run, tmp_path)
    _truncate_arrays(workdir, 4)
    manager = checkpoints.make_checkpoint_manager(workdir / "checkpoints", 3)
    state_only = lambda step, items: {"state": ocp.args.StandardRestore()}
    with caplog.at_level(logging.WARNING):
        assert checkpoints.restore(manager, state_only)[0] == 2
    with pytest.raises(Exception) as read:  # the error orbax's reads of step 4 end with
        manager.restore(4, args=ocp.args.Composite(**state_only(4, {})))
    assert checkpoints.damage_reason(read.value) is not None
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        _abandon_a_read_task(read.value)
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []
    # Any other failed task is still reported.
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        _abandon_a_read_task(KeyError("a bug, not damage"))
    (record,) = [r for r in caplog.records if r.name == "asyncio"]
    assert "Task exception was never retrieved" in record.getMessage()
