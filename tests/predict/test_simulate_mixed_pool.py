"""``roundpipe simulate --gpus rtx4090x4,rtx3090x4``: the pool spec, a pool of one kind
being exactly ``--gpu NAME --gpus K``, and a mixed pool's prediction beside the pool as
if every card were the slowest and beside the sum of each card alone."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import replace

import pytest

from roundpipe.cli import main
from roundpipe.core.plan import Plan
from roundpipe.planning.rules import stage_footprint
from roundpipe.planning.sim.roundpipe_schedule import steady_iteration_time
from roundpipe.predict.breakdown import Budget
from roundpipe.predict.gpus import gpu_preset
from roundpipe.predict.mixed_pool import GpuPool
from roundpipe.predict.model_specs import ModelSpec
from roundpipe.predict.models import PricedModel, Workload, cost_model

RTX3090, RTX4090, RTX5090 = (gpu_preset(name) for name in ("rtx3090", "rtx4090", "rtx5090"))
SMALL_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
}
"""Big enough that compute, not the PCIe links, sets the pace on these cards."""
WORK_FLAGS = ["--seq-len", "2048", "--batch", "8"]
WORK = Workload(seq_len=2048, batch=8)
MIXED = "rtx4090x4,rtx3090x4"


def _run(*argv: str) -> str:
    """What ``roundpipe simulate ARGV`` prints (it must exit 0)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["simulate", *argv]) == 0
    return out.getvalue()


def _json(*argv: str) -> dict:
    (line,) = _run(*argv, "--json").splitlines()
    return json.loads(line)


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("mixed") / "config.json"
    path.write_text(json.dumps(SMALL_LLAMA))
    return str(path)


@pytest.fixture(scope="module")
def mixed(config: str) -> dict:
    return _json("--config", config, "--gpus", MIXED, *WORK_FLAGS)


@pytest.fixture(scope="module")
def alone(config: str) -> dict[str, dict]:
    """The plain command's RoundPipe row for one card of each kind, and for 8 3090s."""
    rows = {}
    for gpu, count in (("rtx4090", "1"), ("rtx3090", "1"), ("rtx3090", "8")):
        flags = ("--gpu", gpu, "--gpus", count, "--schedule", "roundpipe")
        rows[f"{gpu}x{count}"] = _json("--config", config, *flags, *WORK_FLAGS)
    return rows


def test_a_pool_spec_lists_kinds_in_device_order() -> None:
    pool = GpuPool.parse("rtx4090x4,rtx3090x4")
    assert pool.kinds == ((RTX4090, 4), (RTX3090, 4))
    assert pool.devices == [RTX4090] * 4 + [RTX3090] * 4
    assert (pool.size, pool.mixed, str(pool)) == (8, True, "4x rtx4090 + 4x rtx3090")
    assert pool.to_dict() == [{"gpu": "rtx4090", "count": 4}, {"gpu": "rtx3090", "count": 4}]


def test_a_name_without_a_count_is_one_card_and_case_does_not_matter() -> None:
    pool = GpuPool.parse("RTX5090, rtx4090X3")
    assert pool.kinds == ((RTX5090, 1), (RTX4090, 3))
    assert not GpuPool.parse("rtx4090").mixed and GpuPool.parse("rtx4090").size == 1


@pytest.mark.parametrize(
    ("gpus", "message"),
    [
        ("rtx4090x4,", "'rtx4090x4,' has an empty entry"),
        ("rtx9090x2", "unknown GPU preset 'rtx9090' in 'rtx9090x2'; known presets: rtx3090, "),
        ("rtx4090*4", "unknown GPU preset 'rtx4090*4'"),
        ("rtx4090x0,rtx3090x2", "rtx4090x0 in 'rtx4090x0,rtx3090x2' counts no GPU"),
        ("8.5", "expected a whole number of devices or a pool of presets such as "),
        ("rtx4090x600", "--gpus 600 is more than the simulator steps through"),
    ],
)
def test_a_bad_pool_spec_exits_2_with_a_message(capsys, gpus: str, message: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--model", "Qwen3-1.7B", "--gpus", gpus])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--gpus", MIXED], f"a mixed pool (--gpus {MIXED}) needs a model: give --model"),
        (["--gpu", "rtx3090", "--gpus", "rtx4090x2", "--model", "Qwen3-1.7B"],
         "--gpu rtx3090 and --gpus rtx4090x2 name different cards"),
        (["--gpu", "rtx4090", "--gpus", MIXED, "--model", "Qwen3-1.7B"],
         f"--gpu rtx4090 and the mixed pool --gpus {MIXED} both name cards: drop --gpu"),
        (["--gpus", MIXED, "--model", "Qwen3-1.7B", "--schedule", "gpipe"],
         "a mixed pool is predicted for roundpipe only"),
        (["--gpus", MIXED, "--model", "Qwen3-1.7B", "--nodes", "2"],
         "--nodes is not predicted for a mixed pool"),
        (["--gpus", MIXED, "--model", "Qwen3-1.7B", "--scaling"],
         "--scaling is not predicted for a mixed pool"),
        (["--gpus", MIXED, "--model", "Qwen3-1.7B", "--max-seq-len"],
         "--max-seq-len is not predicted for a mixed pool"),
        (["--gpus", MIXED, "--model", "Qwen3-1.7B", "--method", "dpo"],
         "--method dpo is not predicted for a mixed pool"),
    ],
)  # fmt: skip
def test_what_a_mixed_pool_cannot_answer_exits_2(capsys, flags, message) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("roundpipe: error: ") and message in err


def test_a_pool_of_one_kind_prints_exactly_what_gpu_and_gpus_print(config: str) -> None:
    for output in ([], ["--json"]):
        plain = _run("--config", config, "--gpu", "rtx3090", "--gpus", "2", *WORK_FLAGS, *output)
        assert _run("--config", config, "--gpus", "rtx3090x2", *WORK_FLAGS, *output) == plain
        same = ("--gpu", "rtx3090", "--gpus", "rtx3090x2")
        assert _run("--config", config, *same, *WORK_FLAGS, *output) == plain
    synthetic = _run("--layers", "4", "--gpus", "4")
    assert _run("--layers", "4", "--gpus", "rtx4090x4") == synthetic


def test_the_mixed_json_object_has_its_keys(mixed: dict) -> None:
    assert set(mixed) >= {
        "pool",
        "mixed",
        "as_slowest",
        "cards_alone_tokens_per_s",
        "fraction_of_cards_alone",
    }
    assert mixed["pool"] == [{"gpu": "rtx4090", "count": 4}, {"gpu": "rtx3090", "count": 4}]
    assert set(mixed["mixed"]) >= {"plan", "tokens_per_s", "peak_memory_bytes"}
    assert set(mixed["as_slowest"]) == {"gpu", "plan", "tokens_per_s"}
    assert mixed["as_slowest"]["gpu"] == "rtx3090"


def test_the_mixed_pool_beats_its_slowest_card_and_stays_under_the_cards_alone(
    mixed: dict,
) -> None:
    tokens = mixed["mixed"]["tokens_per_s"]
    assert tokens > mixed["as_slowest"]["tokens_per_s"]
    assert tokens < mixed["cards_alone_tokens_per_s"]
    assert mixed["fraction_of_cards_alone"] == tokens / mixed["cards_alone_tokens_per_s"]


def test_the_references_are_the_plain_commands_predictions(mixed: dict, alone: dict) -> None:
    eight_3090s = alone["rtx3090x8"]
    assert mixed["as_slowest"]["tokens_per_s"] == eight_3090s["tokens_per_s"]
    assert f"plan {mixed['as_slowest']['plan']}," in eight_3090s["detail"]
    one_4090, one_3090 = alone["rtx4090x1"]["tokens_per_s"], alone["rtx3090x1"]["tokens_per_s"]
    assert mixed["cards_alone_tokens_per_s"] == 4 * one_4090 + 4 * one_3090


def test_each_kind_of_card_times_the_layers_it_runs(mixed: dict) -> None:
    """The oracle: the printed plan simulated with each device at its own card's priced
    layers, the links at PCIe 4 (both cards' generation)."""
    spec = ModelSpec.from_config(SMALL_LLAMA)
    round_size = WORK.round_microbatches(8)
    per_card = {
        gpu: cost_model(PricedModel.build(spec, gpu, WORK, 2048), gpu, WORK, 8, round_size)
        for gpu in (RTX4090, RTX3090)
    }
    devices = (per_card[RTX4090].layers,) * 4 + (per_card[RTX3090].layers,) * 4
    costs = replace(per_card[RTX3090], device_layers=devices)
    plan = Plan.parse(mixed["mixed"]["plan"])
    seconds = steady_iteration_time(plan, costs, 8, round_size, round_size=round_size)
    assert "host-memory bound" not in mixed["mixed"]["detail"]
    assert mixed["mixed"]["tokens_per_s"] == pytest.approx(round_size * 2048 / seconds, rel=1e-12)


def test_every_device_peaks_within_its_own_card(mixed: dict) -> None:
    spec = ModelSpec.from_config(SMALL_LLAMA)
    model = PricedModel.build(spec, RTX4090, WORK, 2048)
    costs = cost_model(model, RTX4090, WORK, 8, WORK.round_microbatches(8))
    plan = Plan.parse(mixed["mixed"]["plan"])
    stages = [(r, False) for r in plan.forward_ranges()] + [
        (r, True) for r in plan.backward_ranges()
    ]
    peaks = mixed["mixed"]["peak_memory_bytes"]
    cards = [RTX4090] * 4 + [RTX3090] * 4
    assert len(peaks) == 8
    for device, (peak, card) in enumerate(zip(peaks, cards, strict=True)):
        own = [
            stage_footprint(costs, r, bwd) for j, (r, bwd) in enumerate(stages) if j % 8 == device
        ]
        if not own:  # no job of a round lands on this device
            assert peak == 0
            continue
        assert max(own) <= peak <= Budget(card.memory_bytes).available


def test_the_text_names_the_pool_and_each_device(config: str) -> None:
    lines = _run("--config", config, "--gpus", MIXED, *WORK_FLAGS).splitlines()
    assert "on 4x rtx4090 + 4x rtx3090 (bf16), seq 2048, batch 8" in lines[0]
    assert lines[1].startswith("roundpipe (mixed)") and "tokens/s  [plan " in lines[1]
    devices = [line.split()[:3] for line in lines[2:10]]
    assert devices == [["device", str(d), "rtx4090" if d < 4 else "rtx3090"] for d in range(8)]
    assert lines[10].startswith("as if all rtx3090") and "[8x rtx3090: plan " in lines[10]
    assert lines[11].startswith("cards alone") and "the mixed pool makes" in lines[11]


def test_a_5090_beside_three_4090s_is_predicted(config: str) -> None:
    row = _json("--config", config, "--gpus", "rtx5090x1,rtx4090x3", *WORK_FLAGS)
    assert row["pool"] == [{"gpu": "rtx5090", "count": 1}, {"gpu": "rtx4090", "count": 3}]
    assert row["as_slowest"]["gpu"] == "rtx4090"
    assert row["mixed"]["tokens_per_s"] > 0 and len(row["mixed"]["peak_memory_bytes"]) == 4
    assert row["mixed"]["memory_budget_bytes"][0] == Budget(RTX5090.memory_bytes).available


def test_a_pool_no_plan_fits_says_why(config: str) -> None:
    row = _json("--config", config, "--gpus", "rtx3090,rtx4090", "--seq-len", "262144")
    assert row["mixed"]["plan"] is None and row["mixed"]["tokens_per_s"] == 0.0
    assert row["mixed"]["peak_memory_bytes"] == []
    assert "no plan fits the memory budgets" in row["mixed"]["detail"]
    assert row["fraction_of_cards_alone"] == 0.0
