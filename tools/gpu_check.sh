#!/usr/bin/env bash
# The GPU check on a GPU host, from the repository root (docs/performance.md "GPU check"):
#   bash tools/gpu_check.sh OUT_DIR [gpu_check flags, e.g. --budget_s=600]
# Installs the wheels shipped in gpu_wheels/ (the packages the host lacks; nothing can be
# downloaded there) into a folder of their own on PYTHONPATH, then runs
# python3 -m changecap_jax gpu_check.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: bash tools/gpu_check.sh OUT_DIR [flags]}"
shift
if compgen -G "gpu_wheels/*.whl" > /dev/null; then
  # --target: the host's own packages stay as they are (and a system Python that refuses
  # pip installs, PEP 668, still takes these); --no-deps: their dependencies are there.
  site="$(mktemp -d)"
  python3 -m pip install --quiet --no-index --no-deps --target "$site" gpu_wheels/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
exec python3 -m changecap_jax gpu_check --out="$out" "$@"
