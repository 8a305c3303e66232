"""Dataset builds: a killed build's leftovers are removed by the next one, one build per
dataset at a time (a second waits, or stops naming the first), Ctrl-C stops the render workers
before the cleanup, and the same seed gives byte-identical record files in any process."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from tensorflow_datasets.core import example_serializer

from changecap_jax.data import building, datasets, schema

ROOT = Path(__file__).resolve().parents[1]
# Big enough that the train split is still rendering when the test kills the build.
KILLED = {"num_train": 120, "num_val": 12, "num_test": 10, "feature_shape": (4, 4, 16)}
TINY = {"num_train": 16, "num_val": 8, "num_test": 8, "feature_shape": (4, 4, 16)}


def _cli(data_dir: Path, options: dict) -> list[str]:
    return [sys.executable, "-m", "data_prep.build", "synthetic", f"--data_dir={data_dir}",
            *(f"--{k}={','.join(map(str, v)) if isinstance(v, tuple) else v}"
              for k, v in options.items())]


def _incomplete(root: Path) -> list[Path]:
    return sorted(root.glob("synthetic_change/*/incomplete.*"))


@pytest.fixture(scope="module")
def killed_then_rebuilt(tmp_path_factory):
    """A command-line build SIGKILLed while it renders, then the same command again."""
    root = tmp_path_factory.mktemp("killed")
    proc = subprocess.Popen(_cli(root, KILLED), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not any((d / "raw" / "images").glob("*.png") for d in _incomplete(root)):
            assert proc.poll() is None, "the build ended before it could be killed"
            assert time.monotonic() < deadline, "the build wrote no image in 120 s"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # its render workers too
        proc.wait()
    left = _incomplete(root)
    assert len(left) == 1, left
    again = subprocess.run(_cli(root, KILLED), cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    return root, left[0], again.stderr


def test_next_build_removes_a_killed_builds_leftovers(killed_then_rebuilt):
    root, left, log = killed_then_rebuilt
    assert not _incomplete(root)
    assert "removed 1 leftover(s) of interrupted runs of synthetic_change/" in log
    assert str(left) in log
    dataset = datasets.prepare("synthetic", root, "moderate", KILLED, build_if_missing=False)
    assert len(dataset.split("train")) == KILLED["num_train"]
    datasets.verify(dataset)


def test_same_seed_gives_byte_identical_records_in_any_process(killed_then_rebuilt, tmp_path):
    # protobuf writes a record's feature map in a per-process hash order: equal records gave
    # different bytes in every build before they were written in key order.
    root, _, log = killed_then_rebuilt
    built_there = datasets.prepare("synthetic", root, "moderate", KILLED, build_if_missing=False)
    built_here = datasets.prepare("synthetic", tmp_path, "moderate", KILLED)
    there = (built_there.directory / schema.FILES_FILE).read_text()
    assert (built_here.directory / schema.FILES_FILE).read_text() == there
    for path in schema.record_files(built_here.directory):
        assert path.read_bytes() == (built_there.directory / path.name).read_bytes(), path.name
    # TFDS's banner ("Downloading and preparing dataset Unknown size") gave way to ours.
    assert "Downloading and preparing" not in log
    assert "building synthetic_change/moderate_n120-12-10_f4x4x16 2.0.0 (142 examples) in" in log


def test_second_build_waits_for_the_first_and_uses_its_result(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    results = {}

    def run(name: str) -> None:
        results[name] = datasets.prepare("synthetic", tmp_path, "moderate", TINY)

    first = threading.Thread(target=run, args=("first",))
    first.start()
    directory = Path(datasets._synthetic_builder(tmp_path, "moderate", TINY).data_dir)
    deadline = time.monotonic() + 60
    while building.holder(directory) is None and first.is_alive():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    run("second")  # the lock is held: this waits, then finds the dataset built
    first.join()
    assert results["first"].directory == results["second"].directory == directory
    assert len(results["second"].split("val")) == TINY["num_val"]
    messages = [r.getMessage() for r in caplog.records]
    assert sum(m.startswith("building synthetic_change/") for m in messages) == 1
    assert any(m.startswith("waiting for the build of synthetic_change/moderate_n16-8-8_f4x4x16"
                            f" 2.0.0 by pid {os.getpid()}") for m in messages)
    assert any(m.endswith(f"is already built in {directory}") for m in messages)


def test_a_build_held_too_long_stops_with_a_clear_message(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    directory = Path(datasets._synthetic_builder(tmp_path, "moderate", TINY).data_dir)
    with building.dataset_lock(directory, "the other build"):
        assert building.holder(directory) == str(os.getpid())
        with pytest.raises(datasets.DatasetError) as err:
            datasets.prepare("synthetic", tmp_path, "moderate", TINY, wait_s=0.3)
    message = str(err.value)
    assert f"is being built by pid {os.getpid()}" in message
    assert str(building.lock_path(directory)) in message and "waited 0 s" in message
    assert any("waiting for the build of" in r.getMessage() for r in caplog.records)
    assert building.holder(directory) is None and not directory.exists()


def test_ctrl_c_stops_the_render_workers_before_the_cleanup(tmp_path, monkeypatch):
    # Ctrl-C while TFDS writes (outside the example generator) left the generator suspended
    # and its pool's workers rendering the queued examples into TFDS's temporary folder while
    # TFDS removed it ("Directory not empty: 'images'").
    serialize = example_serializer.ExampleSerializer.serialize_example
    calls = []

    def interrupt_at_the_fifth(self, example):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return serialize(self, example)

    before = set(multiprocessing.active_children())
    monkeypatch.setattr(example_serializer.ExampleSerializer, "serialize_example",
                        interrupt_at_the_fifth)
    with pytest.raises(KeyboardInterrupt) as interrupted:
        datasets.prepare("synthetic", tmp_path, "moderate", TINY)
    # The traceback keeps every frame of the build alive, as it did while TFDS cleaned up:
    # only a pool stopped on the way out is gone now.
    assert interrupted.traceback and set(multiprocessing.active_children()) <= before
    assert not _incomplete(tmp_path)
    assert not list(tmp_path.glob("synthetic_change/*/2.0.0"))
