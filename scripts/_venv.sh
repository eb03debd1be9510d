# Sourced by the other scripts: make .venv with roundpipe and the given extras installed.
# Without an NVIDIA GPU it pins torch==2.13.0, the CPU build from the PyTorch CPU index
# (the default index's torch==2.13.0 only where that index cannot be reached: there it
# is the CUDA build and several GB of NVIDIA libraries); with one, any torch>=2.11.
# A .venv that already has torch 2.13.0 keeps it, so a re-run needs no network.
# ROUNDPIPE_TORCH_CPU_INDEX and ROUNDPIPE_TORCH_INDEX_TIMEOUT (seconds) override the CPU
# index and how long to wait for it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
TORCH_CPU_INDEX="${ROUNDPIPE_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
TORCH_INDEX_TIMEOUT="${ROUNDPIPE_TORCH_INDEX_TIMEOUT:-5}"
PIP_INSTALL=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

# Prints why the package index "$1" cannot be reached, or nothing where it answers; gives
# up after TORCH_INDEX_TIMEOUT seconds, name lookup included.
_unreachable_reason() {
    .venv/bin/python - "$1/torch/" "$TORCH_INDEX_TIMEOUT" <<'EOF'
import os, sys, threading, urllib.error, urllib.request

url, timeout = sys.argv[1], float(sys.argv[2])
reason = [f"no answer in {timeout:g} s"]

def probe():
    try:
        urllib.request.urlopen(url, timeout=timeout).close()
        reason[0] = ""
    except urllib.error.HTTPError as error:
        reason[0] = str(error)
    except Exception as error:
        error = getattr(error, "reason", error)
        if not isinstance(error, TimeoutError):  # else the socket's timeout beat join's
            reason[0] = str(error)

thread = threading.Thread(target=probe, daemon=True)
thread.start()
thread.join(timeout)
print(reason[0], end="", flush=True)
os._exit(0)  # without waiting for a lookup that hangs
EOF
}

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
INSTALLED_TORCH="$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("torch"))' \
    2>/dev/null || true)"
if [[ "$INSTALLED_TORCH" == 2.13.0 || "$INSTALLED_TORCH" == 2.13.0+* ]]; then
    echo "torch: $INSTALLED_TORCH is already in .venv; not installing it again" >&2
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    echo "torch: nvidia-smi sees an NVIDIA GPU; installing torch>=2.11 from the default index" >&2
    "${PIP_INSTALL[@]}" "torch>=2.11"
else
    UNREACHABLE="$(_unreachable_reason "$TORCH_CPU_INDEX")"
    if [ -z "$UNREACHABLE" ]; then
        echo "torch: no NVIDIA GPU; installing torch==2.13.0, the CPU build, from" \
            "$TORCH_CPU_INDEX" >&2
        "${PIP_INSTALL[@]}" --index-url "$TORCH_CPU_INDEX" torch==2.13.0
    else
        echo "torch: no NVIDIA GPU, and the CPU index $TORCH_CPU_INDEX cannot be reached" \
            "($UNREACHABLE); installing torch==2.13.0 from the default index" >&2
        "${PIP_INSTALL[@]}" torch==2.13.0
    fi
fi
"${PIP_INSTALL[@]}" -e ".[$1]"
