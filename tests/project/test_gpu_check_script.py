"""``bench/gpu_check.sh --dry-run``: the GPU check's steps run on the CPU (or are skipped,
saying why), each bounded, logged to ``$OUT/<step>.log`` and summed up in a closing
table, so the script cannot rot between the rare runs on a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_dry_run_takes_or_skips_every_step_and_tables_them(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "OUT": str(tmp_path / "out")}
    done = subprocess.run(
        ["bash", "bench/gpu_check.sh", "--dry-run"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    table = done.stdout.split("=== summary")[1].splitlines()[2:]
    rows = {line.split()[0]: line.split()[1] for line in table if line.strip()}
    assert rows == {"machine": "-", "versions": "0", "cuda-tests": "0", "race-windows": "-",
                    "cuda-slice": "-", "nf4": "0", "probe": "-", "long-context": "-",
                    "mixed-pool": "0"}  # fmt: skip
    logs = {p.stem for p in (tmp_path / "out").glob("*.log")}
    assert logs == set(rows)
    assert "skipped: no GPU" in (tmp_path / "out" / "machine.log").read_text()


def test_a_failing_step_fails_the_script_and_an_unknown_argument_is_refused(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "PYTHON": "/bin/false", "OUT": str(tmp_path / "out")}
    done = subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1 and "versions          1" in done.stdout
    wrong = subprocess.run(["bash", "bench/gpu_check.sh", "--fast"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert wrong.returncode == 2 and "usage: bench/gpu_check.sh [--dry-run]" in wrong.stderr
