"""Multi-host jobs as they run on a slice, with four processes of two CPU devices each on this
machine (``python -m changecap_jax.main --multihost``, gloo collectives), sharing one workdir
(the lost-host job: workdir and data in a bucket of a local fake GCS server, as on a slice):

* the losses equal one process with eight devices (the global batches are the same: each
  process reads its slice of each, ``data/pipeline.py``); only process 0 writes the scalars,
  every process its checkpoint shards;
* ``kill -9`` of one host: every other process stops within ``--peer_timeout_s`` and a few
  seconds, on one line naming the lost process (exit status 4, ``host_watch.py``); the job
  started again on 2 processes x 4 devices resumes from the last checkpoint and continues
  with the same losses, and its final evaluation gathers every process's captions;
* SIGTERM to one host (a preemption notice): all four save the same step and exit 0; the run
  resumed on 1 process x 8 devices continues from that step with the same losses.

Marked slow (2-4 minutes each on a 2-core machine: four processes compile and train there
at once); CI runs them after the default suite (.ci/run). Their parts have fast tests in the
default run: test_host_watch.py (the one line), test_pipeline.py (each process's slice of the
global batches, states across process counts), test_train.py (a SIGTERM on one process).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gcs_helpers import BUCKET, fake_gcs
from train_helpers import SMALL, tiny_config

from changecap_jax import host_watch, parallel
from changecap_jax.data import datasets
from changecap_jax.io import paths
from changecap_jax.trainers import captioning

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
STEPS, CHECKPOINT_EVERY, PEER_TIMEOUT_S = 6, 2, 10
CONFIG = """
import sys
sys.path.insert(0, {tests!r})
from train_helpers import tiny_config


def get_config():
    return tiny_config({data_dir!r}, batch_size=8, num_train_steps={steps},
                       checkpoint_every_steps={every}, final_eval_splits=("val",), spice="off")
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(the config file's folder, data dir, the 1-process x 8-device reference losses)."""
    root = tmp_path_factory.mktemp("multihost")
    data_dir = str(root / "data")
    datasets.prepare("synthetic", data_dir, "moderate", SMALL)
    reference = root / "reference"
    trainer = captioning.Trainer(_config(data_dir), reference, mesh=parallel.make_mesh(8))
    trainer.train()
    return root, data_dir, _losses(reference)


def _config_file(folder: Path, data_dir: str) -> Path:
    config_file = folder / "tiny_multihost.py"
    config_file.write_text(CONFIG.format(tests=str(REPO / "tests"), data_dir=data_dir,
                                         steps=STEPS, every=CHECKPOINT_EVERY))
    return config_file


def _config(data_dir: str):
    return tiny_config(data_dir, batch_size=8, num_train_steps=STEPS,
                       checkpoint_every_steps=CHECKPOINT_EVERY, final_eval_splits=("val",),
                       spice="off")


def _losses(workdir: paths.PathLike) -> dict[int, float]:
    lines = (paths.path(workdir) / "scalars.jsonl").read_text().splitlines()
    steps = [s for s in map(json.loads, lines) if "loss" in s]  # not the evaluations' lines
    assert len({s["step"] for s in steps}) == len(steps), "a step logged twice"
    return {s["step"]: s["loss"] for s in steps}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """``processes`` hosts of ``devices`` CPU devices, each its own session (a host's
    processes die together), running the training command on one workdir."""

    def __init__(self, config_file: Path, workdir: str, logs: Path, processes: int,
                 devices: int):
        port = _free_port()
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                   JAX_PLATFORMS="cpu")
        command = [sys.executable, "-m", "changecap_jax.main", f"--config={config_file}",
                   f"--workdir={workdir}"]
        if processes > 1:
            command += ["--multihost", f"--coordinator_address=127.0.0.1:{port}",
                        f"--num_processes={processes}", "--cpu_collectives=gloo",
                        f"--peer_timeout_s={PEER_TIMEOUT_S}"]
        self.workdir = paths.path(workdir)
        logs.mkdir(parents=True, exist_ok=True)
        self.logs = [logs / f"process_{i}.log" for i in range(processes)]
        self.procs = [subprocess.Popen(
            command + ([f"--process_id={i}"] if processes > 1 else []), cwd=REPO, env=env,
            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
            for i, log in enumerate(self.logs)]

    def wait_for_step(self, step: int, timeout: float = 400) -> None:
        scalars = self.workdir / "scalars.jsonl"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if scalars.exists() and len(scalars.read_text().splitlines()) >= step:
                return
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.2)
        raise AssertionError(f"step {step} not reached:\n" + self.log(0)[-3000:])

    def wait(self, timeout: float = 400) -> list[int]:
        return [p.wait(timeout=timeout) for p in self.procs]

    def log(self, i: int) -> str:
        return self.logs[i].read_text(errors="replace")


def _close_to(losses: dict[int, float], reference: dict[int, float]) -> None:
    # The same global batches and updates; only the order of the cross-process sums differs
    # (gloo against one process's reduction): float32 rounding.
    assert sorted(losses) == sorted(reference)
    for step, loss in losses.items():
        assert loss == pytest.approx(reference[step], rel=1e-6), step


ON_DEVICE = """

_streamed = get_config


def get_config():
    config = _streamed()
    config.dataset.on_device = True
    return config
"""


def test_on_device_dataset_on_four_hosts_gives_the_loaders_losses(setup, tmp_path):
    # Each host holds its two devices' shares of the split; the batches gathered in the step
    # are the loader's global batches, so the losses are the 1-process loader run's.
    root, data_dir, reference = setup
    config_file = _config_file(tmp_path, data_dir)
    config_file.write_text(config_file.read_text() + ON_DEVICE)
    job = Job(config_file, str(tmp_path / "run"), tmp_path / "logs", processes=4, devices=2)
    assert job.wait() == [0, 0, 0, 0], job.log(0)[-3000:]
    _close_to(_losses(tmp_path / "run"), reference)


def _shards(checkpoint: paths.AnyPath) -> set[str]:
    return {p.name for p in (checkpoint / "state").glob("ocdbt.process_*")}


def test_lost_host_stops_the_others_and_the_job_resumes_on_two_hosts(setup, tmp_path):
    root, data_dir, reference = setup
    with fake_gcs():
        bucket_data = f"gs://{BUCKET}/multihost/data"
        datasets.prepare("synthetic", bucket_data, "moderate", SMALL)
        config_file = _config_file(tmp_path, bucket_data)
        _lose_a_host_then_resume(config_file, f"gs://{BUCKET}/multihost/run", tmp_path,
                                 reference)


def _lose_a_host_then_resume(config_file: Path, workdir: str, logs: Path,
                             reference: dict[int, float]) -> None:
    job = Job(config_file, workdir, logs / "four", processes=4, devices=2)
    job.wait_for_step(CHECKPOINT_EVERY + 1)
    os.killpg(job.procs[2].pid, signal.SIGKILL)
    killed = time.monotonic()
    statuses = [p.wait(timeout=PEER_TIMEOUT_S + 60) for p in job.procs]
    stopped_after = time.monotonic() - killed
    assert statuses[2] == -signal.SIGKILL
    assert stopped_after < PEER_TIMEOUT_S + 20, stopped_after
    for i in (0, 1, 3):
        assert statuses[i] == host_watch.EXIT_LOST_PROCESS, job.log(i)[-2000:]
        last = job.log(i).rstrip().splitlines()[-1]
        # Process 0 hosts the service that saw process 2 go silent. The others hear it from
        # there, or, when process 0 has stopped first, see the coordinator's connection close.
        named = last.startswith("error: lost process 2 of 4 (no heartbeat for 10 s)")
        assert named or (i != 0 and "connection to process 0, the coordinator" in last), last
        assert f"process {i} stopped too" in last
        assert "Check failure" not in job.log(i) and "coordination_service" not in job.log(i)
    checkpoints = paths.path(workdir) / "checkpoints"
    saved = sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
    assert saved and _shards(checkpoints / str(saved[-1])) == {
        f"ocdbt.process_{i}" for i in range(4)}  # every process wrote its shards
    # Only process 0 logs the training.
    assert "metric_writer" in job.log(0) and "metric_writer" not in job.log(1)

    again = Job(config_file, workdir, logs / "two", processes=2, devices=4)
    assert again.wait() == [0, 0], again.log(0)[-3000:]
    assert f"restored checkpoint of step {saved[-1]}" in again.log(0)
    assert "resumed from process_0-of-4.json" in again.log(0)
    _close_to(_losses(workdir), reference)
    # The final evaluation scored every val pair, process 0's share and process 1's.
    captions = json.loads((paths.path(workdir) / "captions" / f"val_{STEPS}.json").read_text())
    assert len({c["image_id"] for c in captions}) == len(captions) == 2 * SMALL["num_val"]


def test_preemption_saves_on_every_host_and_resumes_on_one(setup, tmp_path):
    root, data_dir, reference = setup
    config_file = _config_file(tmp_path, data_dir)
    workdir = tmp_path / "run"
    job = Job(config_file, str(workdir), tmp_path, processes=4, devices=2)
    job.wait_for_step(1)
    os.kill(job.procs[1].pid, signal.SIGTERM)  # the watcher of process 1 passes it on
    assert job.wait() == [0, 0, 0, 0], job.log(1)[-3000:]
    line = next((x for x in job.log(0).splitlines() if x.startswith("preempted: ")), "")
    assert line.startswith("preempted: saved the checkpoint of step "), job.log(0)[-2000:]
    step = int(line.split("step ")[1].split()[0])
    assert 1 < step < STEPS
    assert _shards(workdir / "checkpoints" / str(step)) == {f"ocdbt.process_{i}" for i in range(4)}

    resumed = captioning.Trainer(_config(data_dir), workdir, mesh=parallel.make_mesh(8))
    resumed.train()
    assert [s for s, _ in resumed.history] == list(range(step + 1, STEPS + 1))
    _close_to(_losses(workdir), reference)
