"""The ``roundpipe simulate`` command line, synthetic and model-level modes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from roundpipe.cli import main
from roundpipe.planning.partition import auto_plan, predict_iteration_time
from roundpipe.planning.sim.costs import CostModel, LayerCosts
from roundpipe.predict.gpus import gpu_preset
from roundpipe.predict.models import PricedModel, Workload, cost_model, model_preset, roundpipe_plan

SYNTHETIC = [
    "simulate",
    "--gpus",
    "4",
    "--microbatches",
    "8",
    "--layers",
    "12",
    "--fwd-ms",
    "1",
    "--bwd-ms",
    "2",
    "--head-fwd-ms",
    "3",
    "--head-bwd-ms",
    "6",
    "--comm-ms",
    "0.2",
]
BUBBLE_PARTS = ("fill", "switch", "drain", "steady")


def _json_lines(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_json_prints_one_object_per_schedule_with_bubble_parts(capsys) -> None:
    assert main([*SYNTHETIC, "--schedule", "all", "--json"]) == 0
    rows = _json_lines(capsys)
    assert [r["schedule"] for r in rows] == [
        "roundpipe",
        "gpipe",
        "1f1b",
        "interleaved-1f1b",
        "looped-bfs",
    ]
    for row in rows:
        assert sum(row[part] for part in BUBBLE_PARTS) == pytest.approx(row["bubble_ratio"])
        assert row["makespan"] > 0 and row["steady_bubble_ratio"] is not None


def test_roundpipe_beats_1f1b_in_steady_state(capsys) -> None:
    main([*SYNTHETIC, "--json"])
    rows = {r["schedule"]: r for r in _json_lines(capsys)}
    assert rows["roundpipe"]["iteration_time"] < rows["1f1b"]["iteration_time"]


def test_roundpipe_partition_counts_transformer_layers_fused_with_the_head(capsys) -> None:
    main([*SYNTHETIC, "--schedule", "roundpipe", "--partition", "4,4,4|0,3,3,3,3", "--json"])
    (row,) = _json_lines(capsys)
    # In the simulator the head is its own unit: a fused stage of 0 layers + head.
    assert "plan 4,4,4|1,3,3,3,3" in row["detail"]


def test_step_sync_plans_and_reports_the_isolated_iteration(capsys) -> None:
    """``--step`` (default async) picks the automatic plan's objective and the timing
    reported; the JSON says which."""
    main([*SYNTHETIC, "--schedule", "roundpipe", "--json"])
    main([*SYNTHETIC, "--schedule", "roundpipe", "--json", "--step", "async"])
    main([*SYNTHETIC, "--schedule", "roundpipe", "--json", "--step", "sync"])
    default, steady, sync = _json_lines(capsys)
    assert default == steady and steady["step"] == "async" and sync["step"] == "sync"
    costs = CostModel(LayerCosts.uniform(12, 1e-3, 2e-3, 3e-3, 6e-3), comm=0.2e-3)
    plans = {
        objective: auto_plan(costs, 4, 8, objective=objective)
        for objective in ("steady", "makespan")
    }
    assert plans["steady"] != plans["makespan"]
    assert f"plan {plans['steady']}," in steady["detail"]
    assert f"plan {plans['makespan']}," in sync["detail"]
    isolated = predict_iteration_time(plans["makespan"], costs, 4, 8, objective="makespan")
    assert sync["iteration_time"] == pytest.approx(isolated, rel=1e-12)
    # synthetic layers have no weights and no optimizer: nothing ends after the compute
    assert sync["iteration_time"] == pytest.approx(sync["makespan"], rel=1e-12)
    assert steady["iteration_time"] < steady["makespan"]  # iterations overlap


def test_step_sync_in_model_mode_plans_and_times_the_isolated_call(capsys) -> None:
    """A batch of one round (32 microbatches on 8 GPUs): with synchronous steps the
    iteration is that call from idle until the whole step is done."""
    argv = ["simulate", "--model", "Qwen3-1.7B", "--gpu", "rtx4090", "--gpus", "8"]
    argv += ["--batch", "32", "--seq-len", "2048", "--schedule", "roundpipe", "--json"]
    main(argv)
    main([*argv, "--step", "sync"])
    steady, sync = _json_lines(capsys)
    assert steady["step"] == "async" and sync["step"] == "sync"
    gpu, work = gpu_preset("rtx4090"), Workload(2048, 32, step="sync")
    model = PricedModel.build(model_preset("Qwen3-1.7B"), gpu, work, 2048)
    costs = cost_model(model, gpu, work, 8, 32)
    plan = roundpipe_plan(costs, gpu, 8, 32, "makespan")
    assert f"plan {plan}," in sync["detail"] and "synchronous steps" in sync["detail"]
    isolated = predict_iteration_time(plan, costs, 8, 32, round_size=32, objective="makespan")
    assert sync["iteration_time"] == pytest.approx(isolated, rel=1e-9)
    assert sync["tokens_per_s"] < steady["tokens_per_s"]  # nothing overlaps the step


def test_step_sync_is_refused_across_nodes(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--model", "Qwen3-1.7B", "--step", "sync", "--nodes", "2"])
    assert exit_info.value.code == 2
    assert "--step sync is not modelled across nodes" in capsys.readouterr().err


def test_baseline_partition_gives_layers_per_stage_and_the_head_joins_the_last(capsys) -> None:
    main([*SYNTHETIC, "--schedule", "1f1b", "--partition", "4,3,3,2", "--json"])
    (row,) = _json_lines(capsys)
    assert row["detail"] == "stages 4,3,3,3"


def test_no_recompute_shortens_the_baselines(capsys) -> None:
    main([*SYNTHETIC, "--schedule", "gpipe", "--json"])
    main([*SYNTHETIC, "--schedule", "gpipe", "--json", "--no-recompute"])
    with_recompute, without = _json_lines(capsys)
    assert without["makespan"] < with_recompute["makespan"]


def test_a_bad_partition_exits_with_a_message(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*SYNTHETIC, "--schedule", "roundpipe", "--partition", "4,4|0,3,3,3,3"])
    assert exit_info.value.code == 2
    assert "forward stages cover" in capsys.readouterr().err


def test_trace_and_gantt_are_written_per_schedule(tmp_path: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    trace, gantt = tmp_path / "run.json", tmp_path / "run.png"
    args = ["--schedule", "all", "--trace", str(trace), "--gantt", str(gantt)]
    main([*SYNTHETIC, *args])
    assert json.loads((tmp_path / "run.roundpipe.json").read_text())["traceEvents"]
    assert (tmp_path / "run.1f1b.png").read_bytes()[:4] == b"\x89PNG"


def test_model_mode_predicts_tokens_per_second_and_memory(capsys) -> None:
    argv = ["simulate", "--model", "Qwen3-1.7B", "--gpu", "rtx4090", "--seq-len", "2048"]
    main([*argv, "--batch", "4", "--gpus", "4", "--schedule", "roundpipe", "--json"])
    (row,) = _json_lines(capsys)
    assert row["tokens_per_s"] > 0 and row["fits"] and row["host_ram"]["total"] > 0


def test_model_mode_reads_a_hugging_face_config_file(tmp_path: Path, capsys) -> None:
    config = {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "vocab_size": 1000,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    main(["simulate", "--config", str(path), "--gpus", "2", "--batch", "2", "--seq-len", "128"])
    out = capsys.readouterr().out
    assert "roundpipe" in out and "tokens/s" in out


def test_python_dash_m_runs_the_command_line() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "roundpipe", "simulate", "--help"],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    for flag in ("--schedule", "--round-size", "--partition", "--model", "--gpu", "--trace"):
        assert flag in completed.stdout
