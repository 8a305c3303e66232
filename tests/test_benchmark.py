"""python -m changecap_jax benchmark: synthetic inputs, XLA cost, JSON, clear refusals.

No timing is asserted: only that the numbers exist, are consistent and are written.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import pytest

from changecap_jax import models
from changecap_jax.commands import benchmark, flop_count
from changecap_jax.commands import synthetic_inputs as si
from changecap_jax.cpu import allocator
from changecap_jax.data.vocab import END_ID, START_ID
from configs import cheers, idc_pcl, subtraction

REPO = Path(__file__).resolve().parents[1]
BATCH = 8  # the test processes see 8 CPU devices (conftest.py)


def test_the_matmul_reference_drops_the_first_run_after_a_step(monkeypatch):
    """The first matmul after a train step runs slow on CPU; the reference rate is the median
    of the runs after it, so a slow first run does not lower it."""
    measure, flops = benchmark.matmul_timer(8)  # compiled and warmed up with the real clock
    assert flops == 2 * 8**3
    ticks = iter([0.0, 10.0,  # the untimed first run: 10 s
                  10.0, 11.0, 11.0, 13.0, 13.0, 14.0])  # then 1 s, 2 s, 1 s
    monkeypatch.setattr(benchmark.time, "perf_counter", lambda: next(ticks))
    assert measure() == 1.0


def test_synthetic_run_flops_match_a_direct_cost_analysis():
    config = subtraction.get_config()  # the fastest model to compile
    config.batch_size = config.eval_batch_size = BATCH
    results = benchmark.run(config, steps=1, decode_batches=0, synthetic_inputs=True,
                            matmul_size=64)
    assert math.isfinite(results["flops"]) and results["flops"] > 0
    assert results["flop_per_s"] > 0 and results["percent_of_matmul"] > 0
    assert results["input_examples_per_s"] is None and results["bottleneck"] is None

    setup = benchmark.synthetic_setup(config, si.input_shapes(config))
    cost = setup.train_step.lower(setup.state, setup.batches[0]).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    assert results["flops"] == pytest.approx(float(cost["flops"]))
    dots = flop_count.dot_flops(setup.train_step, setup.state, setup.batches[0])  # a new trace
    assert dots.flops > 0 and results["dot_flops"] == dots.flops
    assert results["dot_flop_per_s"] == pytest.approx(dots.flops / results["step_s"])


def test_synthetic_step_computes_in_the_configs_compute_dtype():
    """--config.compute_dtype reaches the timed step (the trainer's own cast)."""
    texts = {}
    for dtype in ("float32", "bfloat16"):
        config = subtraction.get_config()
        config.batch_size = config.eval_batch_size = BATCH
        config.compute_dtype = dtype
        setup = benchmark.synthetic_setup(config, si.input_shapes(config))
        texts[dtype] = setup.train_step.lower(setup.state, setup.batches[0]).as_text()
    assert "bf16" in texts["bfloat16"] and "bf16" not in texts["float32"]


def test_command_writes_every_result_to_json(tmp_path):
    out = tmp_path / "sub" / "bench.json"
    # The command starts under the chosen host allocator (cpu/allocator.py; the tests' default
    # leaves it alone).
    env = {**os.environ, "PYTHONPATH": str(REPO), "CHANGECAP_COMPILATION_CACHE": "0",
           "CHANGECAP_HOST_ALLOCATOR": "auto"}
    cmd = [sys.executable, "-m", "changecap_jax", "benchmark", "--config=configs/subtraction.py",
           "--synthetic_inputs", f"--batch_size={BATCH}", f"--eval_batch_size={BATCH}",
           "--steps=1", "--decode_batches=1", "--matmul_size=64", f"--json={out}"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for line in ("train step compile:", "train step median:", "greedy decode median:",
                 "peak memory:", "% of a float32 64x64 matmul", "compilation cache: off",
                 "host memory:",
                 "matmul work (dots of the traced step, every loop iteration counted):"):
        assert line in done.stdout
    results = json.loads(out.read_text())
    for key in ("config", "preset", "batch_size", "devices", "compile_s", "step_s",
                "examples_per_s", "flops", "bytes_accessed", "flop_per_s",
                "matmul_flop_per_s", "percent_of_matmul", "dot_flops", "dot_flop_per_s",
                "dot_percent_of_matmul", "decode_compile_s",
                "decode_s_per_batch", "input_examples_per_s", "bottleneck",
                "peak_memory_bytes", "input_shapes", "compilation_cache",
                "page_faults_per_step", "kernel_cpu_s_per_step"):
        assert key in results, key
    assert results["step_loaded_from_cache"] is None  # the cache is off in this run
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    want = ("tcmalloc" if allocator.tcmalloc_path() else "glibc") if glibc else "default"
    assert results["host_allocator"] == want
    assert results["preset"] == "configs/subtraction.py"
    assert results["config"]["model"]["name"] == "subtraction"
    assert results["devices"]["count"] == BATCH and results["decode_s_per_batch"] > 0
    assert [p.name for p in out.parent.iterdir()] == ["bench.json"]  # no temp file left


def test_batch_has_the_keys_and_formats_each_model_reads():
    config = cheers.get_config()
    shapes = si.input_shapes(config)
    model = models.build(config.model, vocab_size=shapes.vocab_size,
                         max_len=shapes.caption_len)
    batch = si.make_batch(model, 4, shapes.feature_shape, shapes.caption_len,
                          shapes.vocab_size)
    assert batch["before"].shape == (4, *shapes.feature_shape)
    assert batch["entities_distractor"].shape == (4, config.model.num_entities,
                                                  config.model.entity_dim)
    ids = batch["no_change_caption"]
    assert ids.dtype == np.int32 and (ids[:, 0] == START_ID).all()
    for row in ids:
        end = int(np.flatnonzero(row == END_ID)[0])
        assert (row[1:end] >= si.FIRST_WORD_ID).all() and (row[end + 1:] == 0).all()
    si.check_model_reads(model, batch)  # shapes only: nothing compiled


def test_paper_shapes():
    assert si.input_shapes(subtraction.get_config("clevr_change")) == si.InputShapes(
        (14, 14, 1024), 76, 24)
    assert si.input_shapes(subtraction.get_config("clevr_dc")) == si.InputShapes(
        (14, 14, 1024), 87, 40)
    # IDC-PCL reads ResNet layer4 grids of its image_dim channels.
    assert si.input_shapes(idc_pcl.get_config("finetune/clevr_change")).feature_shape == (
        7, 7, 2048)
    with pytest.raises(si.SyntheticInputError, match="--vocab_size and --caption_len"):
        si.input_shapes(subtraction.get_config("spot_the_diff"))
    assert si.input_shapes(subtraction.get_config("spot_the_diff"), vocab_size=10,
                           caption_len=5).vocab_size == 10


class ReadsMore(nn.Module):
    """A model whose batch holds a key the benchmark cannot know."""

    pairs: str = "semantic_only"

    @property
    def streams(self) -> tuple[str, ...]:  # declared, as the model contract asks
        return ("semantic",)

    @nn.compact
    def __call__(self, batch: dict, *, train: bool) -> jax.Array:
        return nn.Dense(2)(batch["before"]) + batch["mystery_input"]


def test_unsupported_models_are_refused_clearly():
    batch = si.make_batch(ReadsMore(), 2, (2, 2, 4), 5, 10)
    with pytest.raises(si.SyntheticInputError, match="mystery_input"):
        si.check_model_reads(ReadsMore(), batch)
    config = subtraction.get_config()
    config.model.name = "nope"
    with pytest.raises(benchmark.BenchmarkError, match="unknown model 'nope'"):
        benchmark.run(config, 1, 0, synthetic_inputs=True)
    with pytest.raises(benchmark.BenchmarkError, match="pretrain"):
        benchmark.run(idc_pcl.get_config("pretrain"), 1, 0, synthetic_inputs=True)
