"""The loader benchmark: its ReLU-noise copy of a dataset and one measurement round."""

import numpy as np

from changecap_jax.commands import loader_benchmark
from changecap_jax.data import datasets, schema


def test_relu_noise_copy_keeps_everything_but_the_grids(small_synthetic, tmp_path):
    noisy = loader_benchmark.relu_noise_copy(small_synthetic, tmp_path / "noise")
    assert noisy.directory != small_synthetic.directory
    datasets.verify(noisy)  # files.json matches the rewritten record files
    source, copy = small_synthetic.split("train"), noisy.split("train")
    assert len(copy) == len(source)
    zeros = []
    for i in range(len(source)):
        a, b = source[i], copy[i]
        assert int(a["id"]) == int(b["id"])
        np.testing.assert_array_equal(a["change_caption_ids"], b["change_caption_ids"])
        assert b["before"].dtype == a["before"].dtype and b["before"].shape == a["before"].shape
        assert not np.array_equal(a["before"], b["before"])
        zeros.append(np.mean(b["after_distractor"] == 0))
    assert 0.4 < np.mean(zeros) < 0.6  # max(0, N(0, 1)): half zeros
    # Asking again reuses the copy: its record files are not rewritten.
    stamps = {p: p.stat().st_mtime_ns for p in schema.record_files(noisy.directory)}
    again = loader_benchmark.relu_noise_copy(small_synthetic, tmp_path / "noise")
    assert {p: p.stat().st_mtime_ns for p in schema.record_files(again.directory)} == stamps


def test_measure_and_report_rows(small_synthetic):
    built = {"float16": small_synthetic}
    config = {"prefetch": 1, "rounds": 2, "batch_size": 8, "batches": 3, "warmup": 1}
    results = loader_benchmark.measure(built, [0], [0, 1], config)
    assert set(results) == {("float16", 0, 0), ("float16", 0, 1)}
    assert all(len(v) == 2 and min(v) > 0 for v in results.values())
    rows = loader_benchmark.report(built, results)
    sizes = schema.split_bytes(small_synthetic.directory, "train")
    assert rows[0]["decoded_bytes_per_example"] == sizes["record_bytes"] / sizes["records"]
