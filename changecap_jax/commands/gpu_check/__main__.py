"""``python -m changecap_jax gpu_check --out=DIR [--tiny] [--budget_s=600]``: the GPU check.

Times every model's train step at its paper preset (batch 128, float32 and bfloat16, then the
largest power-of-two batch that fits) and greedy decoding of 128 pairs; trains DIRL+CCR on
synthetic pairs made in memory on the GPU and on the CPU and compares the loss curves;
compares ResNet-101 features computed with CUDA and on the CPU. Writes ``gpu_check.json``,
``gpu_check.txt`` and ``loss_curve.csv`` into DIR. Each part gets a share of ``--budget_s``
(changecap_jax/commands/gpu_check/plan.py); what does not fit is skipped with a note. ``--tiny``:
the CPU presets and a few steps, for CI. docs/performance.md "GPU check".
"""

from __future__ import annotations

import csv
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from absl import app, flags

from changecap_jax import cli
from changecap_jax.commands.gpu_check import job, plan, report, synthetic_data
from changecap_jax.io.jsonio import write_json_atomic

FLAGS = flags.FLAGS
# The children's device memory pool: JAX's default 75 % would refuse batches that fit.
GPU_ENV = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"}
MEMORY_MARGIN = 0.9  # the largest batch predicted to fit leaves this share of the card
ENVIRONMENT_S = 60.0  # the environment child's time, at most: jax's and torch's CUDA starts


class Run:
    """The check's state: settings, clock, results so far."""

    def __init__(self, settings: plan.Settings, budget_s: float, tiny: bool,
                 peak_tflops: float | None = None):
        self.s, self.tiny, self.dtypes = settings, tiny, list(plan.DTYPES)
        self.peak_tflops = peak_tflops  # the user's value, else the table's for the card
        self.clock = plan.Clock(budget_s)
        self.results: dict[str, Any] = {
            "tiny": tiny, "budget_s": budget_s, "environment": {}, "bf16_peak_tflops": None,
            "batch": settings.batch, "decode_pairs": settings.decode_pairs, "steps": [],
            "largest_batch": [], "training": {}, "features": {}, "skipped": [], "parts": {}}

    def launch(self, kind: str, spec: dict[str, Any], part_deadline: float, what: str,
               env: dict[str, str] | None = None, min_s: float | None = None
               ) -> dict[str, Any] | None:
        """One child, unless its part has less than ``min_s`` (default: the settings'
        ``min_job_s``) left: then None, noted."""
        left = min(part_deadline - time.monotonic(), self.clock.left())
        if left < max(self.s.min_job_s if min_s is None else min_s, 1.0):
            self.results["skipped"].append(f"{what}: the part's time was spent")
            return None
        defaults = {k: v for k, v in GPU_ENV.items() if k not in os.environ}  # the user's wins
        result = job.launch(kind, spec, left, env={**defaults, **(env or {})})
        print(f"[{self.clock.elapsed():4.0f} s] {what}: {result.get('status')}", flush=True)
        return result


def run_environment(r: Run, deadline: float) -> None:
    # Every later part reads what this finds: it gets up to ENVIRONMENT_S whatever its share.
    deadline = max(deadline, time.monotonic() + min(ENVIRONMENT_S, r.clock.left()))
    env = r.launch("environment", {}, deadline, "environment", min_s=0.0) or {}
    r.results["environment"] = env
    known = plan.bf16_peak_tflops(env.get("device_kind", "")) if env.get("backend") != "cpu" \
        else None
    r.results["bf16_peak_tflops"] = r.peak_tflops or known


def _step_job(r: Run, model: str, dtype: str, batch: int, deadline: float,
              decode: bool) -> dict[str, Any] | None:
    spec = {"model": model, "preset": r.s.presets[model], "dtype": dtype, "batch": batch,
            "decode_pairs": r.s.decode_pairs, "steps": r.s.steps if decode else 3,
            "decode_batches": r.s.decode_batches if decode else 0}
    result = r.launch("steps", spec, deadline, f"step {model} {dtype} batch {batch}")
    if result is None:
        return None
    return report.step_row({**spec, **result}, r.results["bf16_peak_tflops"])


def run_steps(r: Run, deadline: float) -> None:
    for dtype in r.dtypes:
        for model in r.s.presets:
            row = _step_job(r, model, dtype, r.s.batch, deadline, decode=True)
            if row is not None:
                r.results["steps"].append(row)


def _first_batch_to_try(r: Run, row: dict[str, Any]) -> int | None:
    """The largest power of two that the batch-128 peak, scaled, fits in the card."""
    limit = r.results["environment"].get("memory_limit_bytes")
    if not limit or not row.get("peak_memory_bytes"):  # the CPU: no device limit
        return r.s.largest_batch_cap
    per_example = row["peak_memory_bytes"] / row["batch"]
    batch = r.s.batch
    while batch * 2 <= r.s.largest_batch_cap and per_example * batch * 2 <= MEMORY_MARGIN * limit:
        batch *= 2
    return batch if batch > r.s.batch else None


def run_largest_batch(r: Run, deadline: float) -> None:
    done = [row for row in r.results["steps"] if row.get("status") == "ok"]
    # bfloat16 first: the dtype a GPU run would train in.
    for row in sorted(done, key=lambda x: x["dtype"] != "bfloat16"):
        batch = _first_batch_to_try(r, row)
        while batch is not None and batch > r.s.batch:
            result = _step_job(r, row["model"], row["dtype"], batch, deadline, decode=False)
            if result is None:
                return
            r.results["largest_batch"].append(result)
            batch = batch // 2 if result.get("status") == "oom" else None


def compare(losses: list[float], reference: list[float]) -> dict[str, Any]:
    """How far one loss curve is from another, step by step."""
    diffs = [abs(a - b) for a, b in zip(losses, reference, strict=False)]
    at = max(range(len(diffs)), key=diffs.__getitem__)
    return {"steps": len(diffs), "max_abs_diff": diffs[at], "at_step": at,
            "first_step_diff": diffs[0], "last_step_diff": diffs[-1],
            "max_rel_diff": max(d / max(abs(b), 1e-30) for d, b in zip(diffs, reference,
                                                                        strict=False))}


def _training_runs(r: Run) -> dict[str, dict[str, str]]:
    runs = {"default": {}, "cpu": {"JAX_PLATFORMS": "cpu"}}
    if r.results["environment"].get("backend") not in (None, "cpu"):
        # Float32 dots at full precision: what is left of the difference is not TF32's.
        runs["default_highest"] = {"JAX_DEFAULT_MATMUL_PRECISION": "highest"}
    return runs


def run_training(r: Run, deadline: float) -> None:
    t = r.results["training"]
    t.update(batch=r.s.train_batch, steps=r.s.train_steps, runs={}, comparisons={})
    with tempfile.TemporaryDirectory(prefix="gpu_check_pairs_") as tmp:
        path = Path(tmp) / "pairs.npz"
        start = time.monotonic()
        workers = 0 if r.tiny else synthetic_data.default_workers()
        t["data"] = {**synthetic_data.make(r.s.train_examples, path, workers),
                     "made_in_s": time.monotonic() - start}
        spec = {"data": str(path), "batch": r.s.train_batch, "steps": r.s.train_steps}
        for name, env in _training_runs(r).items():
            result = r.launch("training", spec, deadline, f"training ({name})", env)
            if result is not None:
                t["runs"][name] = result
    ok = {k: v for k, v in t["runs"].items() if v.get("status") == "ok"}
    if "cpu" in ok:
        t["comparisons"] = {f"{k} vs cpu": compare(v["losses"], ok["cpu"]["losses"])
                            for k, v in ok.items() if k != "cpu"}


def run_features(r: Run, deadline: float) -> None:
    if r.results["environment"].get("torch", "") is None:
        r.results["features"] = {"status": "skipped", "message": "PyTorch is not installed"}
        r.results["skipped"].append("features: PyTorch is not installed")
        return
    result = r.launch("features", {"images": r.s.feature_images}, deadline, "features")
    r.results["features"] = result or {"status": "skipped", "message": "no time left"}


PARTS = {"environment": run_environment, "steps": run_steps, "training": run_training,
         "features": run_features, "largest_batch": run_largest_batch}


def write_outputs(results: dict[str, Any], out: Path) -> str:
    write_json_atomic(out / "gpu_check.json", results, indent=1)
    runs = {k: v["losses"] for k, v in results["training"].get("runs", {}).items()
            if v.get("status") == "ok"}
    with open(out / "loss_curve.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", *runs])
        for k in range(max(map(len, runs.values()), default=0)):
            writer.writerow([k, *(v[k] if k < len(v) else "" for v in runs.values())])
    text = report.text(results)
    (out / "gpu_check.txt").write_text(text)
    return text


def define_flags() -> None:
    flags.DEFINE_string("out", None, "Folder for gpu_check.json, gpu_check.txt and "
                        "loss_curve.csv.")
    flags.DEFINE_bool("tiny", False, "The CPU presets and a few steps (CI).")
    flags.DEFINE_float("budget_s", 600.0, "Seconds for the whole check; parts that do not fit "
                       "are skipped.")
    flags.DEFINE_list("models", None, "Models to time (default: every one, "
                      f"{', '.join(plan.PAPER_PRESETS)}).")
    flags.DEFINE_list("dtypes", list(plan.DTYPES), "Compute dtypes of the timed steps.")
    flags.DEFINE_list("parts", list(PARTS), "Parts to run, in their fixed order (environment "
                      "always runs).")
    flags.DEFINE_float("peak_tflops", None, "The card's dense bfloat16 peak, TFLOP/s "
                       "(default: from the device name, plan.BF16_PEAK_TFLOPS).")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    unknown = sorted(set(FLAGS.models or ()) - set(plan.PAPER_PRESETS))
    if unknown:
        raise app.UsageError(f"--models: unknown {unknown}; known: {list(plan.PAPER_PRESETS)}")
    for flag, known in (("dtypes", plan.DTYPES), ("parts", PARTS)):
        unknown = sorted(set(FLAGS[flag].value) - set(known))
        if unknown:
            raise app.UsageError(f"--{flag}: unknown {unknown}; known: {list(known)}")
    if FLAGS.budget_s <= 0:
        raise app.UsageError("--budget_s must be positive")
    out = Path(FLAGS.out)
    out.mkdir(parents=True, exist_ok=True)
    r = Run(plan.settings(FLAGS.tiny, FLAGS.models), FLAGS.budget_s, FLAGS.tiny,
            FLAGS.peak_tflops)
    r.dtypes = [d for d in plan.DTYPES if d in FLAGS.dtypes]
    chosen = {"environment", *FLAGS.parts}
    r.clock.shares = {k: v for k, v in r.clock.shares.items() if k in chosen}
    for name in r.clock.shares:
        part, start, deadline = PARTS[name], time.monotonic(), r.clock.part_deadline(name)
        part(r, deadline)
        r.results["parts"][name] = {"budget_s": deadline - start,
                                    "elapsed_s": time.monotonic() - start}
    r.results["elapsed_s"] = r.clock.elapsed()
    print(write_outputs(r.results, out), end="")
    print(f"wrote {out}/gpu_check.json, gpu_check.txt, loss_curve.csv")


if __name__ == "__main__":
    define_flags()
    flags.mark_flag_as_required("out")
    cli.run(main)
