#!/usr/bin/env bash
# Lint and run the test suite (GPU-only tests skip themselves without CUDA).
source "$(dirname "$0")/_venv.sh" dev
.venv/bin/ruff check roundpipe tests examples bench
.venv/bin/ruff format --check roundpipe tests examples bench
.venv/bin/lint-imports --no-cache  # the layering of docs/design.md#layers, and no import cycles
.venv/bin/mypy  # over roundpipe/ ([tool.mypy] in pyproject.toml)
exec .venv/bin/python -m pytest -q "$@"
