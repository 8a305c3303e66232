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
if ! python3 -c "import ml_collections" 2> /dev/null; then
  echo "error: ml_collections is not installed and gpu_wheels/ has no wheel of it; on a machine" \
    "with PyPI: python3 -m pip download --no-deps -d gpu_wheels --python-version 3.12" \
    "--platform manylinux2014_x86_64 --only-binary=:all: ml_collections==1.1.0" >&2
  exit 2
fi
exec python3 -m changecap_jax gpu_check --out="$out" "$@"
