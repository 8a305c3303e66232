"""One measurement in a child process: ``python -m changecap_jax.commands.gpu_check.job SPEC``.

SPEC is a JSON file ``{"kind": ..., "out": RESULT.json, ...}``; the child writes its result
there. :func:`launch` (the parent's side) starts one with a timeout and reads the result back.
A child that runs out of device memory writes ``{"status": "oom"}``; one that fails otherwise
writes the error's last line; one past its timeout is killed. Each kind's module is imported
by the child alone, so the parent never imports JAX or PyTorch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# kind -> the module whose run_job(spec) measures it (imported in the child).
KINDS = {"environment": "changecap_jax.commands.gpu_check.environment",
         "steps": "changecap_jax.commands.gpu_check.steps",
         "training": "changecap_jax.commands.gpu_check.training",
         "features": "changecap_jax.commands.gpu_check.features"}
# The repository root: the children import configs/ from there, wherever the parent started.
ROOT = Path(__file__).resolve().parents[3]
OOM_MARKERS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory")
STDERR_TAIL = 1500  # characters of a failed child's stderr kept in the result


def launch(kind: str, spec: Mapping[str, Any], timeout_s: float,
           env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Runs one child; its result, or ``{"status": "timeout" | "error", "message": ...}``."""
    with tempfile.TemporaryDirectory(prefix="gpu_check_job_") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps({**spec, "kind": kind, "out": str(out_path)}))
        cmd = [sys.executable, "-m", "changecap_jax.commands.gpu_check.job", str(spec_path)]
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        try:
            done = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": path, **(env or {})},
                                  timeout=timeout_s,
                                  capture_output=True, text=True, check=False)
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "message": f"not done after {timeout_s:.0f} s"}
        if out_path.exists():
            return json.loads(out_path.read_text())
        tail = (done.stderr or done.stdout or "").strip()[-STDERR_TAIL:]
        return {"status": "error", "message": f"exit status {done.returncode}: {tail}"}


def _failure(error: BaseException) -> dict[str, Any]:
    text = "".join(traceback.format_exception_only(error)).strip()
    status = "oom" if any(m in text for m in OOM_MARKERS) else "error"
    return {"status": status, "message": text.splitlines()[-1][:500] if text else repr(error)}


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[1]).read_text())
    import importlib

    try:
        result = {"status": "ok", **importlib.import_module(KINDS[spec["kind"]]).run_job(spec)}
    except Exception as e:  # the parent reports it and goes on with the next job
        result = _failure(e)
        traceback.print_exc()
    Path(spec["out"]).write_text(json.dumps(result))
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
