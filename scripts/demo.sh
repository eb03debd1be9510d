#!/usr/bin/env bash
# Fine-tune a tiny Qwen3-architecture model on a small chat dataset shipped in the repo,
# on emulated devices (CUDA when present): `roundpipe train --demo`. No downloads.
source "$(dirname "$0")/_venv.sh" train
exec .venv/bin/roundpipe train --demo "$@"
