# Sourced by the other scripts: make .venv with roundpipe and the given extras installed.
# Without an NVIDIA GPU it pins torch==2.13.0 (the CPU build); with one, any torch>=2.4.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    TORCH_SPEC="torch>=2.4"
else
    TORCH_SPEC="torch==2.13.0"
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check "$TORCH_SPEC"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[$1]"
