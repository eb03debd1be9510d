#!/usr/bin/env bash
# Train a tiny character-level language model on 4 emulated devices (no GPU needed).
source "$(dirname "$0")/_venv.sh" plot
exec .venv/bin/python examples/train_tiny_lm.py "$@"
