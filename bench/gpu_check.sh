#!/usr/bin/env bash
# The prepared GPU check: CUDA tests against PyTorch, then a short throughput probe.
# Run on a machine with an NVIDIA GPU:  bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet -e ".[dev]" 2>/dev/null || python3 -m pip install --quiet pytest -e .
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 -m pytest -q -m cuda tests/test_cuda.py -p no:cacheprovider -o addopts=""
status=$?
timeout 300 python3 bench/gpu_probe.py --devices cuda:0,0,0 --steps 12
exit $status
