"""``bench/mixed_pool.py --quick``: the mixed-pool benchmark runs end to end (pinned
plans, equal pools of each kind, each kind alone, the runtime's own plan, the simulator)
and reports every figure, so the script cannot rot between the runs that fill
bench/README.md. Its figures are timings: judged there, not here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from roundpipe import Plan

REPO = Path(__file__).resolve().parents[2]


def test_the_quick_run_reports_every_figure_for_a_mixed_pool():
    done = subprocess.run(
        [sys.executable, "bench/mixed_pool.py", "--quick", "--json", "--pools", "1,0.5"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (result,) = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert result["speeds"] == [1.0, 0.5] and result["microbatches"] == 3
    for key in ("mixed_ms", "equal_plan_ms", "runtime_plan_ms", "simulated_ms"):
        assert result[key] > 0, key
    for key in ("mixed_plan", "equal_plan", "runtime_plan"):
        Plan.parse(result[key]).validate(9)  # 8 layers and the head
    assert Plan.parse(result["mixed_plan"]).placed or result["mixed_plan"] == result["equal_plan"]
    assert set(result["equal_pool_ms"]) == {"1.0", "0.5"}
    assert result["fraction_of_devices_worth"] > 0 and result["fraction_of_devices_alone"] > 0
