"""Every path on gs:// (changecap_jax/io/paths.py), against a local fake GCS server
(tests/gcs_helpers.py): the path helpers, the workdir lock, a dataset built into a bucket and
copied to another host, and training resumed in a bucket giving the same losses as on local
disk. The whole command-line cycle (build, train, kill -9 after a checkpoint, resume, eval,
export, predict, report, every path on gs:// against the same on disk) is
test_the_command_line_cycle_on_gs_equals_local_disk, marked slow (minutes: 12 commands)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gcs_helpers import BUCKET, fake_gcs
from train_helpers import SMALL, tiny_config

from changecap_jax.data import datasets
from changecap_jax.errors import UserError
from changecap_jax.io import checkpoints, metric_writer, paths, workdir_lock
from changecap_jax.trainers import captioning, loop, update

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """The fake server for the module; local copies of bucket data in a private folder."""
    cache = tmp_path_factory.mktemp("local_cache")
    saved = os.environ.get("CHANGECAP_LOCAL_CACHE")
    os.environ["CHANGECAP_LOCAL_CACHE"] = str(cache)
    with fake_gcs() as url:
        yield url
    if saved is None:
        os.environ.pop("CHANGECAP_LOCAL_CACHE", None)
    else:
        os.environ["CHANGECAP_LOCAL_CACHE"] = saved


def _bucket(*parts: str) -> str:
    return "/".join([f"gs://{BUCKET}", *parts])


# ---- the path helpers -----------------------------------------------------------------------


def test_a_url_keeps_its_slashes_and_a_local_path_stays_pathlib(tmp_path):
    assert isinstance(paths.path(tmp_path / "x"), Path)
    assert isinstance(paths.path(str(tmp_path)), Path)
    remote = paths.path("gs://bucket/run") / "checkpoints"
    assert os.fspath(remote) == "gs://bucket/run/checkpoints" and paths.is_remote(remote)
    assert paths.join("gs://bucket/run", "a", "b") == "gs://bucket/run/a/b"
    assert paths.local_mirror_dir("gs://b/data/x").parts[-4:] == ("gs", "b", "data", "x")


def test_without_gcsfs_a_bucket_path_is_a_one_line_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gcsfs" else real(name, *a))
    with pytest.raises(UserError, match=r"gs://b/run: gs:// paths need gcsfs"):
        paths.path("gs://b/run")


def test_create_if_absent_append_and_atomic_write_in_a_bucket(gcs):
    lock = paths.path(_bucket("helpers", "run.lock"))
    assert paths.create_exclusive(lock, b"first")
    assert not paths.create_exclusive(lock, b"second")  # GCS refuses: the object exists
    assert lock.read_bytes() == b"first"
    before = paths.mtime(lock)
    time.sleep(0.01)
    paths.touch(lock)
    assert paths.mtime(lock) > before and lock.read_bytes() == b"first"
    scalars = _bucket("helpers", "scalars.jsonl")
    paths.append_text(scalars, "1\n")
    paths.append_text(scalars, "2\n")
    assert paths.path(scalars).read_text() == "1\n2\n"
    paths.write_atomic(_bucket("helpers", "a.json"), lambda fh: fh.write("{}"))
    assert paths.path(_bucket("helpers", "a.json")).read_text() == "{}"


def test_the_workdir_lock_in_a_bucket(gcs):
    workdir = _bucket("locked")
    me = workdir_lock.acquire(workdir, "main --workdir=gs://...")
    with pytest.raises(workdir_lock.WorkdirBusyError, match="in use by another run"):
        workdir_lock.acquire(workdir, "another")
    assert workdir_lock.read_holder(workdir) == me
    workdir_lock.release(workdir, me)
    assert not (paths.path(workdir) / workdir_lock.LOCK_FILE).exists()
    # A holder on another host that stopped refreshing its lock is gone: taken over.
    gone = workdir_lock.Holder(host="another-host", pid=1, started=0.0, command="old")
    assert paths.create_exclusive(paths.path(workdir) / workdir_lock.LOCK_FILE,
                                  json.dumps(gone.__dict__).encode())
    lock = paths.path(workdir) / workdir_lock.LOCK_FILE
    assert not workdir_lock.is_stale(gone, lock)
    assert workdir_lock.is_stale(gone, lock, now=time.time() + workdir_lock.STALE_AFTER_S + 60)


def test_the_best_state_and_init_from_in_a_bucket(gcs):
    """loop.EarlyStopping's best/ (its checkpoint and record.json) in a bucket, and another
    run's init_from reading it there."""
    best = _bucket("early", "best")
    state = update.TrainState(step=jnp.int32(1), params={"w": jnp.full(2, 0.5)}, opt_state=(),
                              rng=jax.random.key(0))
    stopper = loop.EarlyStopping(best, patience=1)
    assert not stopper.update(1, {"val": {"CIDEr": 0.5}}, state)
    worse = state.replace(step=jnp.int32(2), params={"w": jnp.zeros(2)})
    assert stopper.update(2, {"val": {"CIDEr": 0.4}}, worse)
    assert int(stopper.restore(worse).step) == 1
    resumed = loop.EarlyStopping(best, patience=1)  # the record is read back from the bucket
    assert (resumed.best, resumed.best_step, resumed.since) == (0.5, 1, 1)
    params = checkpoints.init_params_from({"w": jnp.zeros(2)}, best)
    assert np.all(np.asarray(params["w"]) == 0.5)


# ---- data, training, resume and evaluation in the bucket ------------------------------------


def test_a_dataset_built_into_a_bucket_is_read_from_a_local_copy(gcs, tmp_path):
    data_dir = _bucket("data_built")
    built = datasets.prepare("synthetic", data_dir, "moderate", SMALL)
    remote = paths.path(data_dir) / built.directory.relative_to(
        paths.local_mirror_dir(data_dir)).as_posix()
    assert (remote / "dataset_info.json").exists() and (remote / "files.json").exists()
    assert str(built.directory).startswith(str(paths.local_cache_root()))
    # Another host: an empty local cache copies it down, record for record the same.
    os.environ["CHANGECAP_LOCAL_CACHE"] = str(tmp_path / "other_host")
    try:
        copied = datasets.prepare("synthetic", data_dir, "moderate", SMALL,
                                  build_if_missing=False)
    finally:
        os.environ["CHANGECAP_LOCAL_CACHE"] = str(built.directory).split("/mirror/")[0]
    assert str(copied.directory).startswith(str(tmp_path / "other_host"))
    a, b = built.split("train"), copied.split("train")
    assert len(a) == len(b) == SMALL["num_train"]
    assert (a[3]["before"] == b[3]["before"]).all()
    with pytest.raises(datasets.DatasetError, match="is not built in gs://"):
        datasets.prepare("synthetic", _bucket("empty"), "moderate", SMALL,
                         build_if_missing=False)


def _trainer(data_dir: str, workdir: str, steps: int, final: tuple[str, ...],
             like: captioning.Trainer | None = None) -> captioning.Trainer:
    config = tiny_config(data_dir, num_train_steps=steps, checkpoint_every_steps=2,
                         eval_every_steps=1000, final_eval_splits=final, spice="off")
    trainer = captioning.Trainer(config, workdir)
    if like is not None:  # the same update, compiled once for the test
        trainer.train_step = like.train_step
    return trainer


def _scalars(workdir: str) -> list[dict]:
    """scalars.jsonl without the timings."""
    lines = (paths.path(workdir) / metric_writer.SCALARS_FILE).read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in metric_writer.TIMING_SCALARS}
            for line in lines]


def test_train_and_resume_in_a_bucket_give_the_local_digits(gcs, tmp_path):
    """Data and workdir in the bucket: 2 steps, then a resumed run to 4 from the step-2
    checkpoint, equal to 4 steps straight on local disk (every logged loss). Evaluation is
    left to the slow command-line cycle below (it costs a decode compile and the scorers)."""
    local_data = tmp_path / "data"
    datasets.prepare("synthetic", local_data, "moderate", SMALL)
    local = _trainer(str(local_data), str(tmp_path / "run"), 4, ())
    fresh = local.init_state()
    workdir = _bucket("run_resumed")
    with pytest.MonkeyPatch.context() as patch:
        # Every trainer starts from copies of one fresh state (its init compiles anew each
        # time; the step donates its input).
        patch.setattr(captioning.Trainer, "init_state",
                      lambda self: jax.tree.map(jnp.copy, fresh))
        local.train()
        _trainer(_bucket("data_train"), workdir, 2, (), like=local).train()
        resumed = _trainer(_bucket("data_train"), workdir, 4, (), like=local)
        resumed.train()
    assert resumed.history[0][0] == 3  # resumed after step 2, not from scratch
    got, want = _scalars(workdir), _scalars(str(tmp_path / "run"))
    assert got == want and [row["step"] for row in got] == [1, 2, 3, 4]  # once each
    root = paths.path(workdir)
    assert sorted(p.name for p in (root / "checkpoints").iterdir() if p.name.isdigit()) == [
        "2", "4"]
    assert (root / "config.json").exists()
    assert any(p.name.startswith("events.out.tfevents") for p in (root / "tensorboard").iterdir())
    assert not (root / workdir_lock.LOCK_FILE).exists()
    from changecap_jax import main as entry  # its flags are defined at import

    assert entry.closing_line(workdir) == f"done: checkpoints {workdir}/checkpoints"


# ---- the command-line cycle ----------------------------------------------------------------

STEPS, KILL_AFTER, LOG_EVERY = 30, 10, 5
OPTIONS = [f"--config.dataset.options.{k}={v}" for k, v in SMALL.items()
           if k != "feature_shape"] + ["--config.dataset.options.feature_shape=(4, 4, 16)"]


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", *args]


def _main_args(data_dir: str, workdir: str) -> list[str]:
    return ["changecap_jax.main", "--config=configs/dirl.py:synthetic", f"--workdir={workdir}",
            f"--config.dataset.data_dir={data_dir}", *OPTIONS,
            "--config.model.hidden_dim=32", "--config.model.num_heads=4",
            "--config.model.word_dim=16", "--config.model.ffn_dim=64",
            "--config.model.mlp_hidden_dim=64", "--config.batch_size=16",
            "--config.eval_batch_size=8", f"--config.num_train_steps={STEPS}",
            f"--config.log_every_steps={LOG_EVERY}", "--config.eval_every_steps=1000",
            f"--config.checkpoint_every_steps={KILL_AFTER}", "--config.eval_splits=()",
            "--config.final_eval_splits=('test',)", "--config.difficulty_bins=0",
            "--config.spice=off"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}


def _run(args: list[str]) -> subprocess.CompletedProcess:
    done = subprocess.run(_command(*args), cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"{args[0]}: {done.stderr[-3000:]}"
    return done


def _train_killed_then_resumed(data_dir: str, workdir: str) -> None:
    """Starts training, kill -9s it once the step-KILL_AFTER checkpoint is complete, then
    trains again (resuming) to the end."""
    log = tempfile.TemporaryFile()  # not a pipe: nobody reads it while the run writes
    proc = subprocess.Popen(_command(*_main_args(data_dir, workdir)), cwd=ROOT, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while KILL_AFTER not in checkpoints.steps(paths.join(workdir, "checkpoints")):
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"the run ended before the kill: {log.read()[-3000:].decode()}")
            assert time.monotonic() < deadline, "no checkpoint after 300 s"
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
        log.close()
    assert proc.returncode == -signal.SIGKILL
    saved = checkpoints.steps(paths.join(workdir, "checkpoints"))
    assert STEPS not in saved, "the kill came after the run's end"
    resumed = _run(_main_args(data_dir, workdir))
    assert f"restored checkpoint of step {saved[-1]} " in resumed.stderr


def _cycle(root: str, images: tuple[str, str]) -> dict[str, object]:
    """The whole cycle with every path under ``root``; what it wrote, for comparison."""
    data_dir, workdir = paths.join(root, "data"), paths.join(root, "run")
    _train_killed_then_resumed(data_dir, workdir)
    # Scores the latest checkpoint again: the same files, rewritten.
    _run([*_main_args(data_dir, workdir), "--mode=eval"])
    model = paths.join(root, "exported")
    _run(["changecap_jax", "export", f"--workdir={workdir}", f"--out={model}"])
    _run(["changecap_jax", "predict", f"--model={model}", f"--before={images[0]}",
          f"--after={images[1]}", f"--out={paths.join(root, 'predictions')}"])
    _run(["changecap_jax", "report", f"--workdir={workdir}", "--split=test"])
    run = paths.path(workdir)
    prediction = json.loads(paths.path(root).joinpath("predictions", "pair_0000.json")
                            .read_text())
    report = next(p for p in run.iterdir() if p.name.startswith("report_test_"))
    return {
        "metrics": json.loads((run / "metrics" / f"test_{STEPS}.json").read_text()),
        "captions": json.loads((run / "captions" / f"test_{STEPS}.json").read_text()),
        "scalars": _scalars(workdir),
        "exported": sorted(p.name for p in paths.path(model).iterdir()),
        "prediction": {k: prediction[k] for k in ("caption", "tokens", "log_prob")},
        "report": report.name,
    }


@pytest.mark.slow
def test_the_command_line_cycle_on_gs_equals_local_disk(gcs, tmp_path):
    """Build, train, kill -9 after a checkpoint, resume, evaluate, export, predict and report,
    each a command as a user runs it, with every path (data, workdir, compilation cache,
    model, predictions) on gs://, then on local disk: the same metrics, captions, losses and
    prediction to the digit."""
    # Both runs render the same synthetic set; the images predict reads are in each data dir.
    rel = "synthetic_change/moderate_n40-12-10_f4x4x16/2.0.0/raw"
    pair = ("images/CLEVR_default_000000.png", "sc_images/CLEVR_semantic_000000.png")
    remote_root = _bucket("cycle")
    os.environ["CHANGECAP_CACHE_DIR"] = _bucket("xla")
    try:
        on_gs = _cycle(remote_root, tuple(paths.join(remote_root, "data", rel, p)
                                          for p in pair))
    finally:
        os.environ.pop("CHANGECAP_CACHE_DIR")
    assert any(paths.path(_bucket("xla")).iterdir())  # JAX wrote its compiled programs there
    local_root = str(tmp_path / "cycle")
    os.environ["CHANGECAP_CACHE_DIR"] = str(tmp_path / "xla")
    try:
        on_disk = _cycle(local_root, tuple(os.path.join(local_root, "data", rel, p) for p in pair))
    finally:
        os.environ.pop("CHANGECAP_CACHE_DIR")
    for key in ("metrics", "captions", "scalars", "exported", "prediction", "report"):
        assert on_gs[key] == on_disk[key], key
    print("equal on gs:// and disk:", json.dumps({k: on_gs[k] for k in ("metrics", "prediction")}))
    assert len(on_gs["scalars"]) > STEPS // LOG_EVERY and on_gs["metrics"]["num_pairs"] > 0


def test_an_extra_pretraining_source_in_a_bucket_is_read_from_a_local_copy(gcs, tmp_path):
    """config.pretrain.extra_source.dir on gs://: its arrays are memory-mapped from this host's
    copy, the same as the folder's own."""
    from changecap_jax.data import extra_source

    folder = tmp_path / "source"
    folder.mkdir()
    meta = {"task": "classify", "splits": {"train": 3}, "feature_shape": [2, 2, 4],
            "labels": ["wren", "gull"]}
    (folder / "meta.json").write_text(json.dumps(meta))
    features = np.arange(48, dtype=np.float16).reshape(3, 2, 2, 4)
    np.save(folder / "train.features.npy", features)
    np.savez(folder / "train.npz", labels=np.array([1, 0, 1]))
    remote = _bucket("sources", "birds")
    paths.upload(folder, remote, "the test source", last=("meta.json",))
    read = extra_source.open_source(remote, "train")
    assert read.directory == paths.local_mirror_dir(remote) and read.directory.is_dir()
    np.testing.assert_array_equal(read.features, features)
    np.testing.assert_array_equal(read.labels, [1, 0, 1])
    assert extra_source.read_meta(remote) == meta
    with pytest.raises(extra_source.ExtraSourceError, match="has no meta.json"):
        extra_source.open_source(_bucket("sources", "none"), "train")
