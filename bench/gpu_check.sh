#!/usr/bin/env bash
# The prepared GPU check: CUDA tests against PyTorch, NF4 dequantize on CUDA against the
# CPU bit for bit, a short throughput probe, then one step of a 2-layer Llama-3.1-8B-shaped
# model at the longest sequence predicted for a 24 GiB card (the allocator capped to it),
# its measured peak beside the prediction (docs/design.md#long-context).
# Run on a machine with an NVIDIA GPU and torch, pytest, hypothesis preinstalled:
#   bench/gpu_check.sh
# It installs nothing (the GPU machines reach no network): the repository is put on
# PYTHONPATH instead.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
timeout 420 python3 -m pytest -q -m cuda tests/test_cuda.py tests/test_host_block_pool.py \
    -p no:cacheprovider -o addopts=""
status=$?
timeout 120 python3 bench/gpu_nf4_check.py --device cuda:0 || status=1
timeout 120 python3 bench/gpu_probe.py --devices cuda:0,0,0 --steps 12
timeout 240 python3 bench/long_context.py --gpu cuda:0 --layers 2 --budget-gib 24 || status=1
exit $status
