"""The GPU check's results as one JSON document and a short text table."""

from __future__ import annotations

from typing import Any

GIB = 2 ** 30


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def step_row(job: dict[str, Any], peak_tflops: float | None) -> dict[str, Any]:
    """A steps job's result with its achieved TFLOP/s and share of the card's bf16 peak."""
    row = dict(job)
    ok = row.get("status") == "ok" and row.get("flops") is not None
    row["tflop_per_s"] = row["flops"] / row["step_s"] / 1e12 if ok else None
    row["percent_of_bf16_peak"] = (100.0 * row["tflop_per_s"] / peak_tflops
                                   if row["tflop_per_s"] is not None and peak_tflops else None)
    return row


def _step_lines(rows: list[dict[str, Any]], title: str) -> list[str]:
    lines = [title, f"{'model':<12}{'dtype':<10}{'batch':>6}{'step ms':>10}{'ex/s':>9}"
             f"{'TFLOP/s':>9}{'%peak':>7}{'peak GiB':>10}{'compile s':>10}{'decode ms':>10}"]
    for r in rows:
        head = f"{r['model']:<12}{r['dtype']:<10}{r['batch']:>6}"
        if r.get("status") != "ok":
            lines.append(f"{head}  {r.get('status')}: {r.get('message', '')[:80]}")
            continue
        mem = r["peak_memory_bytes"] / GIB if r.get("peak_memory_bytes") else None
        decode = r.get("decode_s_per_batch")
        lines.append(f"{head}{r['step_s'] * 1e3:>10.1f}{r['examples_per_s']:>9.1f}"
                     f"{_num(r['tflop_per_s'], '.2f'):>9}"
                     f"{_num(r['percent_of_bf16_peak'], '.1f'):>7}{_num(mem, '.2f'):>10}"
                     f"{r['compile_s']:>10.1f}{_num(decode and decode * 1e3, '.1f'):>10}")
    return lines


def _training_lines(t: dict[str, Any]) -> list[str]:
    if not t.get("runs"):
        return []
    lines = [f"training DIRL+CCR (synthetic preset, in-memory pairs, batch {t['batch']}, "
             f"{t['steps']} steps), loss first / last:"]
    for name, run in t["runs"].items():
        if run.get("status") != "ok":
            lines.append(f"  {name}: {run.get('status')}: {run.get('message', '')[:80]}")
            continue
        lines.append(f"  {name} ({run['backend']}, precision {run['matmul_precision']}): "
                     f"{run['losses'][0]:.4f} / {run['losses'][-1]:.4f}, "
                     f"{_num(run['step_s'] and run['step_s'] * 1e3, '.1f')} ms/step")
    for name, c in t.get("comparisons", {}).items():
        lines.append(f"  {name}: largest |loss difference| {c['max_abs_diff']:.2e} (step "
                     f"{c['at_step']}), first step {c['first_step_diff']:.2e}, last "
                     f"{c['last_step_diff']:.2e}")
    return lines


def _feature_lines(f: dict[str, Any]) -> list[str]:
    if not f:  # the part was not chosen (--parts)
        return []
    if f.get("status") != "ok":
        return [f"ResNet-101 features: {f.get('status')}: {f.get('message', '')[:100]}"]
    if not f.get("cuda"):
        return [f"ResNet-101 features: {f['images']} image(s) on the CPU; no CUDA device, "
                "nothing to compare"]
    return [f"ResNet-101 features, {f['images']} images, CUDA vs CPU: largest difference "
            f"{f[k]['max_abs_diff']:.2e} ({f[k]['max_rel_diff']:.2e} of the largest value) "
            f"with TF32 {k[5:]}" for k in ("tf32_on", "tf32_off")]


def text(results: dict[str, Any]) -> str:
    env = results["environment"]
    host = (f"{env.get('device_count')} x {env.get('device_kind')} ({env.get('backend')}), "
            f"jax {env.get('jax')}" if env.get("status") == "ok"
            else f"environment {env.get('status')}: {env.get('message', '')[:80]}")
    lines = [f"GPU check{' (tiny)' if results['tiny'] else ''}: {host}; bf16 peak "
             f"{_num(results['bf16_peak_tflops'], '.0f')} TFLOP/s; "
             f"{results['elapsed_s']:.0f} s of a {results['budget_s']:.0f} s budget", ""]
    lines += _step_lines(results["steps"], "train step (random inputs of the preset's shapes; "
                         f"decode = greedy, {results['decode_pairs']} pairs):")
    if results["largest_batch"]:
        lines += ["", *_step_lines(results["largest_batch"], "largest batch tried:")]
    lines += ["", *_training_lines(results["training"]), *_feature_lines(results["features"])]
    if results["skipped"]:
        lines += ["", "skipped:", *(f"  {s}" for s in results["skipped"])]
    return "\n".join(lines) + "\n"
