"""``bench/preference.py --quick``: the DPO-against-SFT benchmark runs end to end (a
small model, the predictor for one model, both memory children) and prints every row
of its three tables, so the script cannot rot between the runs that fill the README."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NUMBER = r"(\d+(?:\.\d+)?)"


def test_the_quick_run_prints_speed_prediction_and_memory_rows():
    done = subprocess.run(
        [sys.executable, "bench/preference.py", "--quick"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()

    def rows(name: str, numbers: int) -> list[list[float]]:
        pattern = re.compile(rf"{re.escape(name)}" + rf"\s+{NUMBER}" * numbers + r"\s*$")
        return [[float(v) for v in m.groups()] for line in lines if (m := pattern.match(line))]

    for method in ("sft", "dpo"):
        speed, memory = rows(method, 2), rows(method, 4)
        assert len(speed) == 1 and all(v > 0 for v in speed[0]), method  # ms/step, tokens/s
        assert len(memory) == 1 and all(v > 0 for v in memory[0]), method
    (predicted,) = rows("Qwen3-8B", 3)
    sft, dpo, ratio = predicted
    assert ratio == pytest.approx(dpo / sft, abs=2e-3) and ratio < 1  # the extra reference pass
    assert re.search(rf"dpo/sft tokens/s: {NUMBER} \(emulated\)", done.stdout)
    assert re.search(rf"dpo/sft: RSS {NUMBER}, host {NUMBER}", done.stdout)
