#!/usr/bin/env bash
# Run the test suite (or the pytest arguments given) under another torch, by default
# 2.11.0, the oldest torch pyproject.toml declares: a side venv .venv-torch<VERSION>
# with that torch from the package index (PyPI's build is the CUDA one, several GB the
# first time; it runs on CPUs) and roundpipe's dev extras.
#   scripts/test_torch.sh                      # the whole suite under torch 2.11.0
#   scripts/test_torch.sh 2.11.0 tests/hf -x   # a slice
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${1:-2.11.0}"
shift || true
VENV=".venv-torch$VERSION"
PIP_INSTALL=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
HAVE="$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' \
    2>/dev/null || true)"
if [ "$HAVE" != "$VERSION" ]; then
    echo "torch: installing torch==$VERSION into $VENV" >&2
    "${PIP_INSTALL[@]}" "torch==$VERSION"
fi
"${PIP_INSTALL[@]}" -e ".[dev]"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
