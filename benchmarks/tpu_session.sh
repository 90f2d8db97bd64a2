#!/usr/bin/env bash
# Everything worth measuring on a lent TPU v5e chip (16 GiB of HBM, 40 GiB of host RAM), in one call of
# under 10 minutes:
#
#   bash benchmarks/tpu_session.sh [OUT_DIR]
#
# CASES=<comma list> replaces the step cases (CASES= runs none: the checkpoint case alone).
#
# The TPU machine has jax 0.10.2 with libtpu but not flax, optax or einops, and no network: they install
# from the machine's own package index into /tmp/site, added at the end of PYTHONPATH so that its JAX
# stays first. The `spillway.*` namespace is laid over the checkout with symlinks (as gpu_session.sh
# does). Then benchmarks/tpu_offload.py's cases, most wanted first (BENCHMARKS.md, "On a TPU"): the
# 4-layer cut's device-state row with its host peak (what the TPU runtime itself holds in host memory,
# never read), its host-state rows, and one checkpoint save in pieces and restore of its host state
# (benchmarks/checkpoint_host_peak.py). The 8-layer cut's host-state step peaked at 37.2 of the 40 GiB;
# its checkpoint case and the whole 1B ran out of host RAM (2026-12-07), so neither is here.
set -uo pipefail
cd "$(dirname "$0")/.."
out_dir=${1:-${OUT:-/tmp/spillway-tpu}}
mkdir -p "$out_dir"
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/site"   # also what an earlier call on a warm machine installed
if ! "$python" -c "import flax, optax, einops" 2>/dev/null; then
  PIP_CONFIG_FILE=/dev/null "$python" -m pip install --isolated -q --only-binary=:all: \
    --index-url file:///opt/pypi/simple --target /tmp/site flax==0.12.8 optax==0.2.8 einops zstandard 2>&1 \
    | grep -v notice
fi
shim=$(mktemp -d)
mkdir "$shim/spillway"
for package in layers models recipes data; do ln -s "$PWD/$package" "$shim/spillway/$package"; done
export PYTHONPATH="$shim:$PWD${PYTHONPATH:+:$PYTHONPATH}"
quiet() { grep -v -E "hugepage|warnings.warn"; }

date -u
"$python" -m benchmarks.versions jax jaxlib libtpu flax optax orbax-checkpoint einops numpy 2>&1 | quiet
cases=${CASES-1b_4layers/device/ga8,1b_4layers/host/ga8,1b_4layers/host_layers_in_fwd_hbm/ga8}
if [ -n "$cases" ]; then
  timeout 360 "$python" -m benchmarks.tpu_offload --out "$out_dir/tpu_rows.json" --cases "$cases" 2>&1 | quiet
fi
timeout -s ABRT 300 "$python" -X faulthandler -m benchmarks.checkpoint_host_peak --set model.num_layers=4 --mode pieces 2>&1 | quiet \
  || echo "checkpoint host peak: failed or timed out (exit $?)"
