"""python -m changecap_jax gpu_check: its plan, its JSON and table, the largest-batch search,
and a tiny real run on the CPU (a step child, the training and the features in-process).

No timing is asserted: the check runs on a GPU host; here only its plumbing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from changecap_jax.commands.gpu_check import __main__ as gpu_check
from changecap_jax.commands.gpu_check import job, plan, report, synthetic_data, training

REPO = Path(__file__).resolve().parents[1]
GIB = 2 ** 30


def test_peaks_and_part_shares():
    assert plan.bf16_peak_tflops("NVIDIA H200") == 989.0
    assert plan.bf16_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert plan.bf16_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert plan.bf16_peak_tflops("cpu") is None
    clock = plan.Clock(100.0, {"a": 1.0, "b": 3.0})
    # "a" gets its share of the time left; "b", the last part, all that is left then.
    assert clock.part_deadline("a") - clock.start == pytest.approx(25.0, abs=0.5)
    assert clock.part_deadline("b") - clock.start == pytest.approx(100.0, abs=0.5)


def _canned(kind, spec, timeout_s, env=None):
    """Children's answers as a GPU host with 100 GiB would give them."""
    if kind == "environment":
        return {"status": "ok", "jax": "0.11.2", "backend": "gpu", "device_count": 1,
                "device_kind": "NVIDIA H200", "memory_limit_bytes": 100 * GIB, "torch": "2.11"}
    if kind == "steps":
        if spec["batch"] >= 1024:
            return {"status": "oom", "message": "RESOURCE_EXHAUSTED: Out of memory"}
        step_s = 0.1 * spec["batch"] / 128
        return {"status": "ok", "compile_s": 20.0, "step_s": step_s, "flops": 5e13,
                "peak_memory_bytes": 10 * GIB * spec["batch"] // 128,
                "examples_per_s": spec["batch"] / step_s,
                "decode_s_per_batch": 0.5 if spec["decode_batches"] else None}
    if kind == "training":
        losses = [5.0, 4.0, 3.0] if env.get("JAX_PLATFORMS") == "cpu" else [5.0, 4.001, 3.01]
        return {"status": "ok", "backend": env.get("JAX_PLATFORMS", "gpu"), "losses": losses,
                "matmul_precision": env.get("JAX_DEFAULT_MATMUL_PRECISION"), "step_s": 0.01}
    return {"status": "ok", "images": 8, "cuda": True, "device": "NVIDIA H200",
            **{k: {"max_abs_diff": 1e-3, "max_rel_diff": 1e-5} for k in ("tf32_on", "tf32_off")}}


def test_every_part_lands_in_the_json_and_the_table(monkeypatch, tmp_path):
    launched = []
    monkeypatch.setattr(job, "launch",
                        lambda *a, **kw: launched.append(a[:2]) or _canned(*a, **kw))
    settings = plan.settings(tiny=False, models=["dirl"])
    settings.train_examples = 4  # made for real, in this process
    r = gpu_check.Run(settings, budget_s=600.0, tiny=False)
    for name, part in gpu_check.PARTS.items():
        part(r, r.clock.part_deadline(name))
    r.results["elapsed_s"] = r.clock.elapsed()
    text = gpu_check.write_outputs(r.results, tmp_path)

    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert results["bf16_peak_tflops"] == 989.0
    assert [(s["dtype"], s["batch"]) for s in results["steps"]] == [("bfloat16", 128),
                                                                     ("float32", 128)]
    step = results["steps"][0]
    assert step["tflop_per_s"] == pytest.approx(5e13 / 0.1 / 1e12)
    assert step["percent_of_bf16_peak"] == pytest.approx(100 * 500 / 989)
    # 10 GiB at 128: 1024 predicted to fit 90 GiB; out of memory there, so 512.
    assert [(s["dtype"], s["batch"], s["status"]) for s in results["largest_batch"]] == [
        ("bfloat16", 1024, "oom"), ("bfloat16", 512, "ok"),
        ("float32", 1024, "oom"), ("float32", 512, "ok")]
    training = results["training"]
    assert set(training["runs"]) == {"default", "cpu", "default_highest"}
    assert training["runs"]["cpu"]["losses"] == [5.0, 4.0, 3.0]
    assert training["comparisons"]["default vs cpu"]["max_abs_diff"] == pytest.approx(0.01)
    assert training["comparisons"]["default vs cpu"]["at_step"] == 2
    assert results["features"]["tf32_on"]["max_abs_diff"] == 1e-3
    assert results["skipped"] == []
    assert (tmp_path / "gpu_check.txt").read_text() == text
    for line in ("NVIDIA H200", "dirl        bfloat16     128     100.0", "oom",
                 "default vs cpu: largest |loss difference| 1.00e-02 (step 2)",
                 "with TF32 off"):
        assert line in text
    curve = (tmp_path / "loss_curve.csv").read_text().splitlines()
    assert curve[0] == "step,default,cpu,default_highest" and len(curve) == 4


def test_a_spent_part_skips_its_jobs_with_a_note(monkeypatch, tmp_path):
    monkeypatch.setattr(job, "launch", _canned)
    r = gpu_check.Run(plan.settings(tiny=False, models=["scorer"]), budget_s=600.0, tiny=False)
    gpu_check.run_steps(r, deadline=r.clock.start)  # no time left in the part
    assert r.results["steps"] == []
    assert r.results["skipped"] == ["step scorer bfloat16 batch 128: the part's time was spent",
                                    "step scorer float32 batch 128: the part's time was spent"]


def test_a_child_that_fails_or_overruns_is_reported(tmp_path):
    spec, out = tmp_path / "spec.json", tmp_path / "result.json"
    spec.write_text(json.dumps({"kind": "steps", "out": str(out), "model": "nonexistent",
                                "preset": "synthetic"}))
    assert job.main(["job", str(spec)]) == 1  # the child's side, in this process
    result = json.loads(out.read_text())
    assert result["status"] == "error" and "configs.nonexistent" in result["message"]
    assert job.launch("steps", {}, timeout_s=0.01)["status"] == "timeout"
    assert job._failure(RuntimeError("RESOURCE_EXHAUSTED: Out of memory"))["status"] == "oom"


def test_the_import_paths_need_nothing_the_gpu_host_lacks():
    """The parent imports neither JAX nor PyTorch (the children have the device to
    themselves); the children's modules need none of TFDS, grain, pycocoevalcap and
    tensorboardX, which the GPU host does not have (docs/performance.md "GPU check")."""
    probe = (
        "import sys\n"
        "import changecap_jax.commands.gpu_check.__main__\n"
        "print(sorted(m for m in ('jax', 'torch') if m in sys.modules))\n"
        "import configs.dirl, changecap_jax.commands.benchmark\n"
        "from changecap_jax.commands.gpu_check import environment, steps, training, features\n"
        "print(sorted(m for m in ('tensorflow_datasets', 'grain', 'pycocoevalcap', 'tensorboardX',"
        " 'changecap_jax.trainers.captioning', 'changecap_jax.experiment') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["[]", "[]"]


def test_tiny_command_times_a_step_in_a_child(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "CHANGECAP_COMPILATION_CACHE": "0"}
    cmd = [sys.executable, "-m", "changecap_jax", "gpu_check", "--tiny", f"--out={tmp_path}",
           "--models=subtraction", "--dtypes=float32", "--parts=steps"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert results["environment"]["backend"] == "cpu"
    [step] = results["steps"]
    assert step["status"] == "ok" and step["model"] == "subtraction" and step["batch"] == 8
    for field in ("step_s", "examples_per_s", "flops", "tflop_per_s", "peak_memory_bytes",
                  "compile_s", "decode_s_per_batch", "xla_temp_size_in_bytes"):
        assert step[field] is not None, field
    assert set(results["parts"]) == {"environment", "steps"}
    assert "subtraction float32        8" in (tmp_path / "gpu_check.txt").read_text()


def test_training_on_in_memory_pairs_gives_a_loss_per_step(tmp_path):
    path = tmp_path / "pairs.npz"
    made = synthetic_data.make(4, path)
    data = synthetic_data.load(path)
    assert data["before"].shape == (4, *made["feature_shape"])
    assert data["change_ids"].shape[-1] == made["caption_len"]
    first = synthetic_data.training_batch(data, 0, 4, swap_prob=0.5)
    again = synthetic_data.training_batch(data, 0, 4, swap_prob=0.5)
    assert all(np.array_equal(first[k], again[k]) for k in first)  # seeded by the step alone
    result = training.run_job({"data": str(path), "batch": 4, "steps": 2})
    assert len(result["losses"]) == 2 and all(np.isfinite(result["losses"]))


@pytest.mark.torch
def test_features_on_the_cpu_alone_compare_nothing():
    pytest.importorskip("torch")
    from changecap_jax.commands.gpu_check import features

    result = features.run_job({"images": 1})
    assert result["shape"] == [1024, 14, 14]
    if not result["cuda"]:
        assert "tf32_on" not in result
        assert "no CUDA device" in report._feature_lines({"status": "ok", **result})[0]
