"""``roundpipe simulate --method dpo|kto`` prices a preference step: the policy's
forward+backward as SFT over the step's rows, plus forward-only passes (the reference;
KTO's KL rows) that the simulator replays as forward-only rounds, and says how the
reference is obtained (adapters off each step, or precomputed once for a full fine-tune)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from support.predict_models import TINY_LLAMA

from roundpipe.cli import main
from roundpipe.core.op_kinds import OpKind
from roundpipe.core.plan import Plan
from roundpipe.planning.sim.costs import CostModel, LayerCosts
from roundpipe.planning.sim.engine import COMPUTE, D2H, H2D
from roundpipe.planning.sim.forward_pass import forward_pass_time
from roundpipe.planning.sim.rounds import BOOKKEEPING, Config, Simulation
from roundpipe.predict.gpus import gpu_preset
from roundpipe.predict.model_specs import ModelSpec
from roundpipe.predict.models import PricedModel, Workload, cost_model, predict
from roundpipe.predict.preference_costs import (
    PER_EXAMPLES,
    REFERENCE_BYTES_PER_EXAMPLE,
    predict_preference,
)

RTX4090 = gpu_preset("rtx4090")
SPEC = ModelSpec.from_config(TINY_LLAMA)
PAIRS = 4
SEQ = 128
LORA = Workload(seq_len=SEQ, batch=PAIRS, lora_rank=4)
FULL = Workload(seq_len=SEQ, batch=PAIRS)
GPUS = 2
ONLY = ("--schedule", "roundpipe")


def _rows(work: Workload, factor: int) -> Workload:
    return replace(work, batch=factor * work.batch, microbatch_size=factor * work.microbatch_size)


def _forward_pass(work: Workload, plan: Plan) -> float:
    """The oracle of a forward-only pass over ``work``'s batch: the simulator's
    forward-only rounds over the cost model that prices ``work`` for training."""
    model = PricedModel.build(SPEC, RTX4090, work, work.tokens_per_microbatch)
    rounds = work.round_microbatches(GPUS)
    costs = cost_model(model, RTX4090, work, GPUS, rounds)
    round_s = forward_pass_time(plan, costs, GPUS, rounds, round_size=rounds)
    return round_s * work.num_microbatches / rounds


def _run(capsys, tmp_path: Path, *flags: str) -> str:
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY_LLAMA))
    base = ["simulate", "--config", str(config), "--gpus", str(GPUS), "--seq-len", str(SEQ)]
    assert main([*base, "--batch", str(PAIRS), "--host-ram", "64", *flags]) == 0
    return capsys.readouterr().out


def _rows_of(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines()]


# the simulator's forward-only pass


def test_a_forward_only_pass_on_one_device_is_the_sum_of_the_forward_costs() -> None:
    costs = CostModel(LayerCosts.uniform(8, 1.0, 2.0, 3.0, 6.0))
    plan = Plan((4, 4), (1, 4, 4))
    # every microbatch through 8 layers (1 s each) and the head (3 s); backward never runs
    assert forward_pass_time(plan, costs, 1, 6, round_size=6) == 6 * (8 * 1.0 + 3.0)
    assert forward_pass_time(plan, costs, 1, 12, round_size=6) == 12 * (8 * 1.0 + 3.0)


def test_a_forward_only_pass_pipelines_its_stages_over_the_devices() -> None:
    costs = CostModel(LayerCosts.uniform(8, 1.0, 2.0, 3.0, 6.0))
    plan = Plan((4, 4), (1, 4, 4))
    # three jobs on three devices: 6 microbatches of the first stage (4 s each), then
    # the last microbatch through the second stage (4 s) and the head (3 s)
    assert forward_pass_time(plan, costs, 3, 6, round_size=6) == 6 * 4.0 + 4.0 + 3.0


def test_a_forward_only_round_uploads_each_weight_once_and_sends_no_gradient() -> None:
    sizes = (100, 200, 300, 400, 50)
    costs = CostModel(
        LayerCosts((1.0,) * 5, (2.0,) * 5, sizes), h2d_bandwidth=1.0, d2h_bandwidth=1.0
    )
    plan = Plan((2, 2), (1, 2, 2))
    simulation = Simulation(Config(plan, costs, 2, 3, True, forward_only=True))
    simulation.add_iterations(3, 1, 0)
    computes = [op for op in simulation.ops if op.stream == COMPUTE and op.kind not in BOOKKEEPING]
    assert {op.kind for op in computes} == {OpKind.FORWARD.value}
    assert len(computes) == 3 * 3  # three jobs (two forward stages, the fused one) x 3
    uploads = [op for op in simulation.ops if op.stream == H2D and op.kind == "upload"]
    assert sum(op.duration for op in uploads) == sum(sizes)  # bytes at 1 byte/s
    kinds = {op.kind for op in simulation.ops}
    assert not kinds & {"fused", "recompute", "backward", "upload_grad", "take_grads"}
    # activations hand over at no cost here; only a gradient download would take time
    assert all(op.duration == 0 for op in simulation.ops if op.stream == D2H)


# a DPO step


def test_a_dpo_step_is_the_policy_over_both_sequences_plus_a_reference_pass() -> None:
    step = predict_preference(SPEC, RTX4090, LORA, GPUS, "dpo")
    (policy,) = predict(SPEC, RTX4090, _rows(LORA, 2), GPUS, ("roundpipe",))
    assert step.policy == policy  # the policy is SFT over 2B rows, a pair per microbatch
    plan = policy.memory.plan
    reference = _forward_pass(replace(_rows(LORA, 2), lora_rank=0), plan)
    assert step.reference_s == pytest.approx(reference, rel=1e-12)
    assert step.step_s == pytest.approx(policy.iteration_time + reference, rel=1e-12)
    prediction = step.prediction()
    assert prediction.tokens_per_s == pytest.approx(2 * PAIRS * SEQ / step.step_s, rel=1e-12)
    assert step.to_dict()["pairs_per_s"] == pytest.approx(PAIRS / step.step_s, rel=1e-12)


def test_a_dpo_microbatch_holds_whole_pairs() -> None:
    two_pairs = replace(LORA, batch=8, microbatch_size=2)
    step = predict_preference(SPEC, RTX4090, two_pairs, GPUS, "dpo")
    (policy,) = predict(
        SPEC, RTX4090, replace(two_pairs, batch=16, microbatch_size=4), GPUS, ("roundpipe",)
    )
    assert step.policy == policy


def test_a_kto_step_adds_a_kl_pass_of_the_policy_and_a_reference_over_twice_the_rows() -> None:
    step = predict_preference(SPEC, RTX4090, LORA, GPUS, "kto")
    (policy,) = predict(SPEC, RTX4090, LORA, GPUS, ("roundpipe",))
    assert step.policy == policy  # the policy trains on the B examples
    plan = policy.memory.plan
    kl = _forward_pass(LORA, plan)  # the policy, adapters on, over the B KL rows
    reference = _forward_pass(replace(_rows(LORA, 2), lora_rank=0), plan)
    assert step.kl_s == pytest.approx(kl, rel=1e-12)
    assert step.reference_s == pytest.approx(reference, rel=1e-12)
    assert step.step_s == pytest.approx(policy.iteration_time + kl + reference, rel=1e-12)
    assert step.prediction().tokens_per_s == pytest.approx(PAIRS * SEQ / step.step_s, rel=1e-12)


# the reference: adapters off, or precomputed once


def test_a_lora_reference_is_the_base_without_adapters_every_step() -> None:
    step = predict_preference(SPEC, RTX4090, LORA, GPUS, "dpo")
    plan = step.policy.memory.plan
    with_adapters = _forward_pass(_rows(LORA, 2), plan)
    assert 0 < step.reference_s < with_adapters
    row = step.to_dict()
    assert row["reference"] == "adapters_off"
    assert row["reference_precompute_s_per_1000"] is None
    assert row["reference_host_bytes_per_example"] == 0


def test_a_full_fine_tunes_reference_is_precomputed_once_and_priced_per_example() -> None:
    step = predict_preference(SPEC, RTX4090, FULL, GPUS, "dpo")
    plan = step.policy.memory.plan
    assert step.reference_s == 0.0  # nothing per step
    assert step.step_s == step.policy.iteration_time
    one_pass = _forward_pass(_rows(FULL, 2), plan)  # the initial weights over a step's pairs
    assert step.precompute_s == pytest.approx(one_pass / PAIRS * PER_EXAMPLES, rel=1e-12)
    row = step.to_dict()
    assert row["reference"] == "precomputed"
    assert row["reference_host_bytes_per_example"] == REFERENCE_BYTES_PER_EXAMPLE == 8


def test_lora_dpo_needs_the_host_ram_of_lora_sft_on_the_same_rows() -> None:
    for method, rows in (("dpo", _rows(LORA, 2)), ("kto", LORA)):
        step = predict_preference(SPEC, RTX4090, LORA, GPUS, method, host_ram=64 * 2**30)
        (sft,) = predict(SPEC, RTX4090, rows, GPUS, ("roundpipe",), host_ram=64 * 2**30)
        assert step.policy.memory.host == sft.memory.host  # no reference copy
        assert step.policy.memory.device == sft.memory.device


# the command line


def test_method_sft_prints_exactly_what_no_method_prints(capsys, tmp_path) -> None:
    for flags in ((), ("--json",), ("--lora", "4", "--schedule", "roundpipe")):
        assert _run(capsys, tmp_path, *flags, "--method", "sft") == _run(capsys, tmp_path, *flags)


def test_dpo_prints_the_step_split_and_how_the_reference_is_obtained(capsys, tmp_path) -> None:
    out = _run(capsys, tmp_path, "--lora", "4", "--method", "dpo")
    assert f"batch {PAIRS} pairs (DPO: {2 * PAIRS} sequences a step)" in out
    assert "dpo step " in out and "policy " in out and "pairs/s" in out
    assert f"(forward only, {2 * PAIRS} sequences)" in out
    assert "reference: the same pipe with the LoRA adapters off each step" in out
    full = _run(capsys, tmp_path, "--method", "dpo")
    assert "reference 0 s (precomputed)" in full
    assert f"per {PER_EXAMPLES:,} pairs; host RAM 8 bytes per pair" in full


def test_preference_json_has_the_step_split_keys(capsys, tmp_path) -> None:
    (dpo,) = _rows_of(_run(capsys, tmp_path, "--lora", "4", "--method", "dpo", "--json", *ONLY))
    assert dpo["method"] == "dpo" and "kl_s" not in dpo and "examples_per_s" not in dpo
    assert dpo["iteration_time"] == pytest.approx(dpo["policy_s"] + dpo["reference_s"])
    assert dpo["pairs_per_s"] == pytest.approx(PAIRS / dpo["iteration_time"])
    assert dpo["tokens_per_s"] == pytest.approx(2 * PAIRS * SEQ / dpo["iteration_time"])
    (kto,) = _rows_of(_run(capsys, tmp_path, "--lora", "4", "--method", "kto", "--json", *ONLY))
    assert kto["method"] == "kto" and "pairs_per_s" not in kto
    total = kto["policy_s"] + kto["kl_s"] + kto["reference_s"]
    assert kto["iteration_time"] == pytest.approx(total)
    assert kto["examples_per_s"] == pytest.approx(PAIRS / total)


def test_baselines_are_skipped_under_a_preference_method(capsys, tmp_path) -> None:
    rows = _rows_of(_run(capsys, tmp_path, "--method", "dpo", "--json"))
    assert rows[0]["schedule"] == "roundpipe" and rows[0]["method"] == "dpo"
    assert [row["schedule"] for row in rows[1:]] == [
        "gpipe",
        "1f1b",
        "interleaved-1f1b",
        "looped-bfs",
    ]
    assert all(row["skipped"] == "--method dpo is priced for roundpipe only" for row in rows[1:])
    out = _run(capsys, tmp_path, "--method", "kto", "--schedule", "1f1b")
    assert "1f1b              skipped: --method kto is priced for roundpipe only" in out
    assert out.count("roundpipe  ") == 1


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--method", "dpo"], "--method dpo needs a model: give --model or --config"),
        (["--method", "kto", "--layers", "4"], "--method kto needs a model"),
        (["--model", "Qwen3-1.7B", "--method", "dpo", "--max-seq-len"], "drop --max-seq-len"),
        (["--model", "Qwen3-1.7B", "--method", "kto", "--nodes", "2"], "drop --nodes"),
        (["--model", "Qwen3-1.7B", "--method", "dpo", "--scaling"], "drop --scaling"),
        (["--model", "Qwen3-1.7B", "--method", "orpo"], "invalid choice: 'orpo'"),
    ],
)
def test_a_preference_method_is_refused_where_it_is_not_priced(capsys, flags, message) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) <= 2  # usage line + the error
