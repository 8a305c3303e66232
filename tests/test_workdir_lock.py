"""One run per workdir (changecap_jax/io/workdir_lock.py): a second run is refused at start with
one line naming the holder, a lock whose holder is gone is taken over with a warning, and the
temporary folders of a killed run's unfinished saves are removed by the next run."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from changecap_jax import cli
from changecap_jax.errors import WorkdirBusyError
from changecap_jax.io import checkpoints, workdir_lock

REPO = Path(__file__).resolve().parents[1]


def _dead_pid() -> int:
    """The pid of a process that has exited."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _write_lock(workdir: Path, **fields) -> Path:
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
              "command": "main --config=x", "process_start": ""}
    holder.update(fields)
    workdir.mkdir(parents=True, exist_ok=True)
    lock = workdir / workdir_lock.LOCK_FILE
    lock.write_text(json.dumps(holder))
    return lock


def test_a_live_holder_refuses_a_second_run_naming_itself(tmp_path):
    me = workdir_lock.acquire(tmp_path, "main --workdir=w")
    with pytest.raises(WorkdirBusyError) as error:
        workdir_lock.acquire(tmp_path, "another")
    message = str(error.value)
    assert f"pid {os.getpid()} on {socket.gethostname()}" in message
    assert "main --workdir=w" in message and str(tmp_path) in message
    workdir_lock.release(tmp_path, me)
    assert not (tmp_path / workdir_lock.LOCK_FILE).exists()
    workdir_lock.release(tmp_path, workdir_lock.acquire(tmp_path, "third"))  # free again


def test_the_lock_of_a_dead_process_is_taken_over_with_a_warning(tmp_path, caplog):
    pid = _dead_pid()
    _write_lock(tmp_path, pid=pid)
    with caplog.at_level(logging.WARNING):
        me = workdir_lock.acquire(tmp_path, "mine")
    assert me.pid == os.getpid() and workdir_lock.read_holder(tmp_path) == me
    assert any(f"pid {pid}" in r.getMessage() and "gone" in r.getMessage()
               for r in caplog.records)


def test_a_reused_pid_does_not_keep_a_lock(tmp_path):
    # This process is alive, but it is not the process that took the lock (start time differs).
    _write_lock(tmp_path, process_start="1")
    assert workdir_lock.acquire(tmp_path, "mine").pid == os.getpid()


def test_another_hosts_lock_is_stale_only_without_heartbeat(tmp_path):
    lock = _write_lock(tmp_path, host="some-other-host", pid=1)
    with pytest.raises(WorkdirBusyError, match="pid 1 on some-other-host"):
        workdir_lock.acquire(tmp_path, "mine")
    old = time.time() - workdir_lock.STALE_AFTER_S - 5
    os.utime(lock, (old, old))
    assert workdir_lock.acquire(tmp_path, "mine").pid == os.getpid()


def test_the_holder_refreshes_its_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(workdir_lock, "HEARTBEAT_S", 0.05)
    with workdir_lock.hold(tmp_path, "main"):
        lock = tmp_path / workdir_lock.LOCK_FILE
        old = time.time() - 1000
        os.utime(lock, (old, old))
        time.sleep(0.3)
        assert time.time() - lock.stat().st_mtime < 10
    assert not lock.exists()


def test_a_second_main_is_refused_with_one_line(tmp_path):
    me = workdir_lock.acquire(tmp_path / "w", "python -m changecap_jax.main (the first run)")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", CHANGECAP_COMPILATION_CACHE="0", PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-m", "changecap_jax.main",
                           "--config=configs/dirl.py", f"--workdir={tmp_path}/w",
                           f"--config.dataset.data_dir={tmp_path}/data"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == cli.EXIT_USER_ERROR, done.stderr[-3000:]
    assert len(lines) <= 3 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines[-1].startswith(f"error: workdir {tmp_path}/w is in use by another run: "
                                f"pid {os.getpid()} on {socket.gethostname()}"), lines[-1]
    assert "(the first run)" in lines[-1]
    assert not (tmp_path / "data").exists()  # refused before the dataset was built
    assert workdir_lock.read_holder(tmp_path / "w") == me  # the holder's lock is untouched


def test_a_writer_removes_unfinished_saves_a_reader_does_not(tmp_path):
    directory = tmp_path / "checkpoints"
    leftover = directory / "10.orbax-checkpoint-tmp"
    (leftover / "state.orbax-checkpoint-tmp").mkdir(parents=True)
    with checkpoints.make_checkpoint_manager(directory, 1):
        pass
    assert leftover.exists()  # a reader (export, report) leaves a live run's save alone
    with checkpoints.make_checkpoint_manager(directory, 1, writer=True) as manager:
        manager.wait_until_finished()
    deadline = time.time() + 10
    while leftover.exists() and time.time() < deadline:  # orbax cleans in the background
        time.sleep(0.05)
    assert not leftover.exists()


def test_export_refuses_a_workdir_its_run_is_still_writing(tmp_path):
    from changecap_jax import exported_model
    from changecap_jax.commands import export

    (tmp_path / "checkpoints" / "3").mkdir(parents=True)
    me = workdir_lock.acquire(tmp_path, "main (training)")
    with pytest.raises(exported_model.ExportError, match=r"still being written by its run \(pid "):
        export.export_model(tmp_path, tmp_path / "out")
    workdir_lock.release(tmp_path, me)
    assert not (tmp_path / "out").exists()


MULTIHOST_SCRIPT = """
import json, os, sys
import jax
from changecap_jax import parallel
from changecap_jax.io import workdir_lock
from changecap_jax.errors import WorkdirBusyError
process_id, port, workdir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
parallel.initialize_distributed(f"127.0.0.1:{port}", 2, process_id, cpu_collectives="gloo")
try:
    with workdir_lock.hold(workdir, "two-process run"):
        holder = workdir_lock.read_holder(workdir) if process_id == 0 else None
        print("HELD", json.dumps(holder.pid if holder else None), flush=True)
except WorkdirBusyError as e:
    print("BUSY", e, flush=True)
jax.distributed.shutdown()
"""


def _two_processes(workdir: Path) -> list[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, "-c", MULTIHOST_SCRIPT, str(i), str(port),
                               str(workdir)], env=env, cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    return [next(line for line in out.splitlines() if line.startswith(("HELD", "BUSY")))
            for out, _ in outs]


def test_multi_host_process_0_holds_the_lock_and_all_refuse_together(tmp_path):
    held = _two_processes(tmp_path / "free")
    assert held[0].startswith("HELD ") and held[0] != "HELD null"  # process 0's own pid
    assert held[1] == "HELD null"
    assert not (tmp_path / "free" / workdir_lock.LOCK_FILE).exists()  # released at the end
    me = workdir_lock.acquire(tmp_path / "busy", "the first run")
    busy = _two_processes(tmp_path / "busy")
    assert busy[0].startswith("BUSY ") and "the first run" in busy[0]
    assert busy[1].startswith("BUSY ") and "process 0 could not take its lock" in busy[1]
    workdir_lock.release(tmp_path / "busy", me)
