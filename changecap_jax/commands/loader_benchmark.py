"""Examples per second of the training loader alone, by worker count and stored dtype.

    python -m changecap_jax loader_benchmark --data_dir=/tmp/loader_bench \\
        [--feature_shape=14,14,1024] [--num_train=256] [--dtypes=float32,float16] \\
        [--workers=0,1,2] [--threads=1,2] [--prefetch=2] [--batch_size=16] [--batches=30] \\
        [--rounds=5] [--content=relu_noise|synthetic]

Builds (once) a synthetic dataset per dtype at the given feature shape (default: the
CLEVR-Change paper grid, 3 images of 14x14x1024 per example), then, ``--rounds`` times,
measures every (dtype, workers, threads) configuration in turn, so slow phases of a shared machine
spread over all of them: a fresh loader, ``--warmup`` batches (worker start-up, buffers
drained), then ``--batches`` timed batches. Prints the median examples/s of each
configuration and the bytes each example takes. Nothing else runs: no model, no device
transfer; the files are read from the page cache after the build.

``--content``: array_record compresses every record (zstd), and reading is mostly its
decompression. The synthetic grids are smooth and compress about 6x; ResNet features do
not. ``relu_noise`` (default) reads a copy of the dataset whose grids are max(0, N(0, 1)):
half zeros and full-precision values, about 1.8x compressible, and about 2.5x slower to read
than the synthetic grids, like real post-ReLU features. ``synthetic`` reads the grids as built.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from absl import flags
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

from changecap_jax import cli
from changecap_jax.data import datasets, pipeline, schema

FLAGS = flags.FLAGS
flags.DEFINE_string("data_dir", "/tmp/changecap_loader_bench", "Where the datasets are built.")
flags.DEFINE_list("feature_shape", ["14", "14", "1024"], "Feature grid H,W,C.")
flags.DEFINE_integer("num_train", 256, "Training examples of each benchmark dataset.")
flags.DEFINE_list("dtypes", ["float32", "float16"], "Stored feature dtypes to compare.")
flags.DEFINE_list("workers", ["0", "1", "2"], "Worker counts to compare.")
flags.DEFINE_list("threads", ["1"], "Reading threads per process (config.data.threads) "
                  "to compare.")
flags.DEFINE_integer("prefetch", 2, "Batches read ahead per stage (config.data.prefetch).")
flags.DEFINE_integer("batch_size", 16, "Examples per batch.")
flags.DEFINE_integer("batches", 30, "Timed batches per measurement.")
flags.DEFINE_integer("warmup", -1, "Batches before timing; -1: enough to start the workers "
                     "and drain the buffers they filled meanwhile.")
flags.DEFINE_integer("rounds", 5, "Measurements per configuration (alternated).")
flags.DEFINE_string("json_out", "", "Also write the results here.")
flags.DEFINE_enum("content", "relu_noise", ["relu_noise", "synthetic"],
                  "Grid values read: post-ReLU Gaussian noise (compresses like real features) "
                  "or the synthetic dataset's own (compress ~6x).")


def build_datasets(data_dir: str, shape: tuple[int, int, int], num_train: int,
                   dtypes: list[str]) -> dict[str, Any]:
    """dtype -> the prepared synthetic dataset (built on first use; val/test are tiny)."""
    return {dtype: datasets.prepare("synthetic", data_dir, "moderate", {
        "num_train": num_train, "num_val": 2, "num_test": 2, "feature_shape": shape,
        "feature_dtype": dtype}) for dtype in dtypes}


def relu_noise_copy(dataset: Any, root: Path, seed: int = 0) -> Any:
    """A copy of a built synthetic dataset under ``root`` whose feature grids are
    max(0, N(0, 1)) in the stored dtype; files.json is rewritten. Reused when present."""
    config_dir = dataset.directory.parent  # <root>/synthetic_change/<config>/<version>
    target = root / config_dir.parent.name / config_dir.name / dataset.directory.name
    if not (target / schema.FILES_FILE).exists():
        tmp = target.with_name(target.name + ".incomplete")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(dataset.directory, tmp, ignore=shutil.ignore_patterns("raw"))
        features = dataset.builder.info.features
        dtype = schema.FEATURE_DTYPES[dataset.meta.feature_dtype]
        rng = np.random.default_rng(seed)
        files = {}
        for path in schema.record_files(tmp):
            reader = ArrayRecordReader(str(path))
            records = [features.deserialize_example_np(r) for r in reader.read_all()]
            reader.close()
            writer = ArrayRecordWriter(str(path), "group_size:1")  # TFDS's writer options
            for record in records:
                for key in ("before", "after_semantic", "after_distractor"):
                    grid = rng.standard_normal(record[key].shape, dtype=np.float32)
                    record[key] = np.maximum(grid, 0.0).astype(dtype)
                writer.write(features.serialize_example(record))
            writer.close()
            files[path.name] = {"bytes": path.stat().st_size, "sha256": schema.file_digest(path)}
        (tmp / schema.FILES_FILE).write_text(json.dumps(files, indent=1))
        meta = schema.DatasetMeta.load(tmp / schema.META_FILE)
        meta.raw_dir = None  # the rendered images were not copied
        meta.save(tmp / schema.META_FILE)
        tmp.rename(target)
    return datasets.prepare("synthetic", root, dataset.builder.builder_config.distractors,
                            dataset_options(dataset), build_if_missing=False)


def dataset_options(dataset: Any) -> dict[str, Any]:
    """The synthetic dataset options that name ``dataset``'s variant."""
    cfg = dataset.builder.builder_config
    return {"num_train": cfg.num_train, "num_val": cfg.num_val, "num_test": cfg.num_test,
            "feature_shape": tuple(cfg.feature_shape), "feature_dtype": cfg.feature_dtype,
            "seed": cfg.seed}


def examples_per_second(source: Any, read: Any, batch_size: int, batches: int,
                        warmup: int) -> float:
    """One measurement: a fresh loader, ``warmup`` batches, then ``batches`` timed ones."""
    iterator = iter(pipeline.train_loader(source, global_batch_size=batch_size, seed=0,
                                          read=read))
    try:
        for _ in range(warmup):
            next(iterator)
        start = time.perf_counter()
        for _ in range(batches):
            next(iterator)
        return batches * batch_size / (time.perf_counter() - start)
    finally:
        iterator.close()


def measure(built: dict[str, Any], workers: list[int], threads: list[int],
            config: dict[str, Any]) -> dict[tuple[str, int, int], list[float]]:
    """(dtype, workers, threads) -> examples/s of each round; the configurations alternate
    (reversed every other round)."""
    results: dict[tuple[str, int, int], list[float]] = {}
    sources = {dtype: dataset.split("train") for dtype, dataset in built.items()}
    order = [(d, w, t) for d in sources for w in workers for t in threads]
    for r in range(config["rounds"]):
        for dtype, w, t in order if r % 2 == 0 else order[::-1]:
            read = pipeline.ReadAhead(workers=w, threads=t, prefetch=config["prefetch"])
            warmup = config["warmup"]
            if warmup < 0:
                warmup = (2 * config["prefetch"] + t) * max(w, 1) + 2
            value = examples_per_second(sources[dtype], read, config["batch_size"],
                                        config["batches"], warmup)
            results.setdefault((dtype, w, t), []).append(value)
            print(f"round {r + 1}: {dtype:8s} workers={w} threads={t}: {value:7.1f} "
                  "examples/s", flush=True)
    return results


def report(built: dict[str, Any], results: dict[tuple[str, int, int], list[float]]
           ) -> list[dict[str, Any]]:
    """Prints the table of medians; returns its rows."""
    sizes = {}
    for dtype, dataset in built.items():
        b = schema.split_bytes(dataset.directory, "train")
        sizes[dtype] = (b["record_bytes"] / b["records"], b["file_bytes"] / b["records"])
    rows = []
    print("\ndtype     workers threads  examples/s (median)  MB/s decoded  "
          "MB/example decoded / on disk")
    for (dtype, w, t), values in sorted(results.items()):
        median = statistics.median(values)
        decoded, disk = sizes[dtype]
        rows.append({"dtype": dtype, "workers": w, "threads": t, "examples_per_s": median,
                     "all": values, "decoded_bytes_per_example": decoded,
                     "disk_bytes_per_example": disk})
        print(f"{dtype:8s}  {w:7d} {t:7d}  {median:19.1f}  {median * decoded / 1e6:12.1f}  "
              f"{decoded / 1e6:.2f} / {disk / 1e6:.2f}")
    return rows


def main(argv: list[str]) -> None:
    del argv
    shape = tuple(int(v) for v in FLAGS.feature_shape)
    built = build_datasets(FLAGS.data_dir, shape, FLAGS.num_train, list(FLAGS.dtypes))
    if FLAGS.content == "relu_noise":
        built = {dtype: relu_noise_copy(d, Path(FLAGS.data_dir) / "relu_noise")
                 for dtype, d in built.items()}
    config = {"prefetch": FLAGS.prefetch, "rounds": FLAGS.rounds,
              "batch_size": FLAGS.batch_size, "batches": FLAGS.batches,
              "warmup": FLAGS.warmup, "content": FLAGS.content}
    results = measure(built, [int(w) for w in FLAGS.workers],
                      [int(t) for t in FLAGS.threads], config)
    rows = report(built, results)
    if FLAGS.json_out:
        Path(FLAGS.json_out).write_text(json.dumps({"config": config, "shape": shape,
                                                    "rows": rows}, indent=1))


if __name__ == "__main__":
    cli.run(main)
