#!/usr/bin/env bash
# The prepared GPU check, one bounded run that tells everything: the machine, CUDA tests
# against PyTorch, the same with every stream op delayed (race windows widened: a
# missing wait then reads stale or reused memory), a curated slice of the emulator's
# tests on CUDA workers (from_hf against transformers, training against PyTorch), NF4
# dequantize on CUDA against the CPU bit for bit, a short throughput probe, then one
# step of a 2-layer Llama-3.1-8B-shaped model at the longest sequence predicted for a
# 24 GiB card (the allocator capped to it), its measured peak beside the prediction
# (docs/design.md#long-context), and three exact steps on a mixed pool where the machine
# has GPUs of two kinds (skipped otherwise, saying so; docs/design.md#mixed-pools).
#
#   bench/gpu_check.sh              # on a machine with an NVIDIA GPU
#   bench/gpu_check.sh --dry-run    # every step on emulated devices or skipped, with why
#
# It installs nothing (the GPU machines reach no network): the repository is put on
# PYTHONPATH. Each step runs under `timeout -s ABRT` (a hang dumps every thread's stack:
# PYTHONFAULTHANDLER), cheapest and most telling first, within 9.5 minutes in all; its
# output goes to $OUT/<step>.log (OUT defaults to a new temporary folder) and the screen,
# and a closing table gives each step's exit status, seconds and key line. Any step's
# failure fails the script.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONFAULTHANDLER=1
PY="${PYTHON:-python3}"  # the interpreter with torch (the GPU box's python3)
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
DRY=0
if [ "${1:-}" = "--dry-run" ]; then
    DRY=1
elif [ $# -gt 0 ]; then
    echo "usage: bench/gpu_check.sh [--dry-run]" >&2
    exit 2
fi
PYTEST=("$PY" -m pytest -p no:cacheprovider -o addopts="" -o faulthandler_timeout=120
        -rfEs --tb=short --durations=10 -q)
CUDA_TESTS=(tests/devices/test_cuda.py tests/devices/test_host_block_pool.py)
# the emulator's tests whose oracle holds on a GPU within their tolerances
CUDA_SLICE=(tests/hf/test_hf_from_hf.py tests/model/test_training_matches_pytorch.py
            tests/hf/test_token_accuracy.py)
ROWS=()
STATUS=0

# step NAME SECONDS COMMAND...: run COMMAND under the budget, its output to $OUT/NAME.log
step() {
    local name=$1 budget=$2
    shift 2
    echo "=== $name (at most ${budget}s): $*"
    local start=$SECONDS
    timeout -s ABRT -k 10 "$budget" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    local key
    key=$(grep -v '^\s*$' "$OUT/$name.log" | tail -n 1 | cut -c 1-70)
    ROWS+=("$(printf '%-14s %4s %6ss  %s' "$name" "$rc" "$((SECONDS - start))" "$key")")
    [ "$rc" -eq 0 ] || STATUS=1
}

# skip NAME WHY: a step the dry run cannot take
skip() {
    echo "skipped: $2" >"$OUT/$1.log"
    ROWS+=("$(printf '%-14s %4s %6ss  %s' "$1" "-" "0" "skipped: $2")")
}

if [ "$DRY" -eq 1 ]; then
    skip machine "no GPU in a dry run (nvidia-smi)"
else
    step machine 10 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
fi
step versions 20 "$PY" -c "import sys, torch; print('python', sys.version.split()[0], \
'torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
if [ "$DRY" -eq 1 ]; then
    step cuda-tests 120 "${PYTEST[@]}" "${CUDA_TESTS[@]}"
    skip race-windows "it delays CUDA stream ops (ROUNDPIPE_CUDA_DELAY_CYCLES)"
    skip cuda-slice "it runs emulator tests on CUDA workers (ROUNDPIPE_TESTS_ON_CUDA)"
    step nf4 150 "$PY" bench/gpu_nf4_check.py --device cpu  # ~60 s of CPU work and imports
    skip probe "it times CUDA kernels against PyTorch on the same GPU"
    skip long-context "it measures a CUDA allocator's peak"
    step mixed-pool 60 "$PY" bench/gpu_mixed_check.py --devices emulated:2@1,0.5
else
    step cuda-tests 150 "${PYTEST[@]}" -m cuda "${CUDA_TESTS[@]}"
    ROUNDPIPE_CUDA_DELAY_CYCLES=2000000 step race-windows 60 "${PYTEST[@]}" -m cuda \
        -k "gradients_match or async or dropout or host_block" "${CUDA_TESTS[@]}"
    ROUNDPIPE_TESTS_ON_CUDA=1 step cuda-slice 90 "${PYTEST[@]}" -x "${CUDA_SLICE[@]}"
    step nf4 60 "$PY" bench/gpu_nf4_check.py --device cuda:0
    step probe 60 "$PY" bench/gpu_probe.py --devices cuda:0,0,0 --steps 12
    step long-context 90 "$PY" bench/long_context.py --gpu cuda:0 --layers 2 --budget-gib 24
    step mixed-pool 30 "$PY" bench/gpu_mixed_check.py  # skipped unless two different GPUs
fi

echo
echo "=== summary (logs in $OUT)"
printf '%-14s %4s %7s  %s\n' step rc time "last line"
printf '%s\n' "${ROWS[@]}"
exit $STATUS
