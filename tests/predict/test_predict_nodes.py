"""RoundPipe across nodes (data parallel): one node is today's prediction, efficiency
falls with K at a fixed global batch, the network's speed and the wire dtype move the
figures the right way, LoRA reduces only its adapters, host state shards K-fold."""

from __future__ import annotations

import json

import pytest

from roundpipe.cli import main
from roundpipe.predict.breakdown import SHARDED_HOST_BYTES
from roundpipe.predict.gpus import gpu_preset
from roundpipe.predict.model_specs import model_preset
from roundpipe.predict.models import Workload, predict
from roundpipe.predict.nodes import Network, predict_nodes, scaling_table

SPEC, GPU, GPUS = model_preset("Qwen3-1.7B"), gpu_preset("rtx4090"), 2
WORK = Workload(seq_len=256, batch=32)


def _nodes(nodes: int, gbps: float = 10.0, dtype: str = "fp32", work: Workload = WORK):
    return predict_nodes(SPEC, GPU, work, GPUS, Network(nodes, gbps, dtype), host_ram=None)


def test_one_node_is_todays_prediction_exactly() -> None:
    (today,) = predict(SPEC, GPU, WORK, GPUS, ("roundpipe",))
    one = _nodes(1)
    assert one.tokens_per_s == today.tokens_per_s
    assert one.host_ram_per_node == today.host_ram
    assert one.scaling_efficiency == 1.0 and one.comm_time == one.exposed_comm == 0.0


def test_efficiency_is_at_most_one_and_falls_as_nodes_grow_at_a_fixed_global_batch() -> None:
    rows = scaling_table(SPEC, GPU, WORK, GPUS, Network(gbps=10.0))
    assert [r.nodes for r in rows] == [1, 2, 4, 8, 16, 32]  # 64 does not split 32
    efficiencies = [r.scaling_efficiency for r in rows]
    assert all(e <= 1.0 for e in efficiencies)
    assert efficiencies == sorted(efficiencies, reverse=True)
    assert efficiencies[-1] < 0.9


def test_a_faster_network_never_lowers_tokens_per_s() -> None:
    speeds = [_nodes(4, gbps).tokens_per_s for gbps in (1, 10, 100, 1000)]
    assert speeds == sorted(speeds)
    assert speeds[0] < speeds[-1]


def test_bf16_gradient_reduction_moves_half_the_bytes_of_fp32() -> None:
    fp32, bf16 = _nodes(4, dtype="fp32"), _nodes(4, dtype="bf16")
    assert bf16.reduce_bytes == pytest.approx(fp32.reduce_bytes / 2, rel=1e-6)
    assert bf16.gather_bytes == fp32.gather_bytes
    assert bf16.comm_time < fp32.comm_time and bf16.tokens_per_s >= fp32.tokens_per_s


def test_lora_reduces_and_gathers_only_the_adapters() -> None:
    lora = _nodes(4, work=Workload(seq_len=256, batch=32, lora_rank=8))
    adapters = SPEC.lora_params(8)
    assert lora.reduce_bytes == int(3 / 4 * adapters * 4)
    assert lora.gather_bytes == int(3 / 4 * adapters * 2)
    assert lora.reduce_bytes < _nodes(4).reduce_bytes / 50


@pytest.mark.parametrize("nodes", [2, 8])
def test_host_ram_for_masters_and_adam_state_falls_k_fold(nodes: int) -> None:
    one, many = _nodes(1), _nodes(nodes)
    sharded = SPEC.num_params * SHARDED_HOST_BYTES
    # the saved stage inputs of a round (smaller rounds on a node's smaller batch) are
    # a few percent of the drop
    assert one.host_ram_per_node - many.host_ram_per_node == pytest.approx(
        sharded * (1 - 1 / nodes), rel=0.05
    )


def test_the_command_line_prints_the_node_keys_in_the_roundpipe_object(capsys) -> None:
    argv = ["simulate", "--model", "Qwen3-1.7B", "--gpus", "2", "--seq-len", "256"]
    main([*argv, "--batch", "32", "--schedule", "roundpipe", "--json", "--host-ram", "64"])
    (today,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    main([*argv, "--batch", "32", "--json", "--host-ram", "64", "--nodes", "1"])
    (one,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert one["tokens_per_s"] == today["tokens_per_s"] and one["schedule"] == "roundpipe"
    main([*argv, "--batch", "32", "--json", "--nodes", "4", "--network-gbps", "25"])
    (four,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for key in ("nodes", "network_gbps", "tokens_per_s", "scaling_efficiency", "exposed_comm"):
        assert key in four
    assert four["nodes"] == 4 and four["network_gbps"] == 25.0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nodes", "0"], "--nodes must be positive, got 0"),
        (["--nodes", "2", "--network-gbps", "0"], "--network-gbps must be positive"),
        (["--nodes", "3", "--batch", "16"], "--batch 16 does not split evenly over 3 nodes"),
    ],
)
def test_bad_node_inputs_exit_2_with_a_message(capsys, flags, message) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--model", "Qwen3-1.7B", "--seq-len", "256", *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("roundpipe: error: ") and message in err
