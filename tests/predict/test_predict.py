"""Model-level predictions: calibration against the published RoundPipe measurements,
MoE and LoRA accounting, fit answers for GPU memory and host RAM, and bad inputs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from roundpipe.cli import main
from roundpipe.core.tiling import DEFAULT_SEQ_CHUNK_TOKENS
from roundpipe.predict import unit_costs
from roundpipe.predict.gpus import gpu_preset
from roundpipe.predict.host_settings import LeanSettings
from roundpipe.predict.model_specs import ModelSpec, model_preset
from roundpipe.predict.models import Workload, max_seq_len, predict
from roundpipe.predict.unit_costs import Kernels, layer_cost

# The RoundPipe paper on 8x RTX 4090, PCIe 4.0, fp16 with fp16 accumulation, 2048-token
# sequences: (model, global batch, LoRA rank, tokens/s, longest sequence). The 235B
# LoRA batch is not published: 64 sequences, rank 16; its adapters leave the routed
# experts (lora_experts=False: peft before 0.22).
PUBLISHED = [
    ("Qwen3-1.7B", 512, 0, 65.4e3, 73e3),
    ("Llama-3.1-8B", 256, 0, 24.3e3, 49e3),
    ("gpt-oss-20b", 128, 0, 18.1e3, 39e3),
    ("Qwen3-32B", 128, 0, 5.5e3, 28e3),
    ("Qwen3-235B-A22B", 64, 16, 1.82e3, 31e3),
]
RTX4090 = gpu_preset("rtx4090")


def _paper_run(name: str, batch: int, rank: int):
    work = Workload(
        seq_len=2048, batch=batch, precision="fp16-acc16", lora_rank=rank, lora_experts=False
    )
    (prediction,) = predict(model_preset(name), RTX4090, work, 8, ("roundpipe",))
    return prediction


@pytest.fixture(scope="module")
def paper_runs() -> dict:
    return {name: _paper_run(name, batch, rank) for name, batch, rank, _, _ in PUBLISHED}


@pytest.mark.parametrize(("name", "tokens_per_s"), [(p[0], p[3]) for p in PUBLISHED])
def test_throughput_is_within_15_percent_of_the_published(paper_runs, name, tokens_per_s):
    assert paper_runs[name].tokens_per_s == pytest.approx(tokens_per_s, rel=0.15)


def _paper_work(rank: int, **settings) -> Workload:
    return Workload(2048, 1, precision="fp16-acc16", lora_rank=rank, lora_experts=False, **settings)


@pytest.mark.parametrize(("name", "rank", "longest"), [(p[0], p[2], p[4]) for p in PUBLISHED])
def test_the_untiled_max_sequence_length_is_within_20_percent_of_the_published(name, rank, longest):
    paper = max_seq_len(model_preset(name), RTX4090, _paper_work(rank), seq_chunk_tokens=None)
    assert paper.max_seq_len == pytest.approx(longest, rel=0.20)


# The goal of docs/design.md#long-context: four times the paper's longest sequences on
# the same 24 GB cards (the 235B LoRA base in NF4, LeanSettings(quantize="nf4")).
@pytest.mark.parametrize(
    ("name", "rank", "longest", "quantize"),
    [(p[0], p[2], p[4], "nf4" if p[2] else None) for p in PUBLISHED],
)
def test_tiled_layers_train_four_times_the_published_length(name, rank, longest, quantize):
    work = _paper_work(rank, settings=LeanSettings(quantize=quantize))
    ours = max_seq_len(model_preset(name), RTX4090, work)
    assert ours.max_seq_len >= 4 * longest
    assert ours.bound_by == "gpu" and ours.seq_chunk_tokens == DEFAULT_SEQ_CHUNK_TOKENS
    # what the host holds for it: every layer's input of the sequence
    spec = model_preset(name)
    inputs = (spec.num_layers + 1) * ours.max_seq_len * spec.hidden_size * 2
    assert ours.saved_activations == inputs
    assert ours.host_ram > inputs


def test_the_host_ram_can_bound_the_length() -> None:
    spec, work = model_preset("Llama-3.1-8B"), _paper_work(0)
    free = max_seq_len(spec, RTX4090, work)
    tight = max_seq_len(spec, RTX4090, work, host_ram=int(free.host_ram / 0.9 * 0.8))
    assert tight.bound_by == "host_ram" and tight.limit == "host RAM"
    assert 0 < tight.max_seq_len < free.max_seq_len
    assert tight.host_ram <= 0.8 * free.host_ram
    none = max_seq_len(spec, RTX4090, work, host_ram=10**9)  # not even the model fits
    assert none.max_seq_len == 0 and none.bound_by == "host_ram"


def test_a_wrong_matmul_efficiency_moves_a_prediction_out_of_tolerance(monkeypatch) -> None:
    monkeypatch.setattr(unit_costs, "MATMUL_EFFICIENCY", 0.55)
    assert _paper_run("Qwen3-32B", 128, 0).tokens_per_s < 5.5e3 * 0.85


def test_gpt_oss_counts_21b_total_and_3_6b_active_parameters() -> None:
    spec = model_preset("gpt-oss-20b")
    assert spec.num_params == pytest.approx(20.9e9, rel=0.02)
    assert spec.active_params == pytest.approx(3.6e9, rel=0.03)


def test_moe_compute_follows_active_and_uploads_follow_total_parameters() -> None:
    spec = model_preset("Qwen3-30B-A3B")
    dense_twin = ModelSpec("twin", 2048, 768 * 8, 48, 32, 4, 128, 151936, qk_norm=True)
    assert spec.active_layer_params == pytest.approx(dense_twin.layer_params, rel=0.01)
    moe = layer_cost(spec, Kernels(RTX4090, "bf16"), 2048, 2048, None, 0)
    dense = layer_cost(dense_twin, Kernels(RTX4090, "bf16"), 2048, 2048, None, 0)
    assert moe.param_bytes > 10 * dense.param_bytes
    assert moe.forward < 10 * dense.forward


def test_lora_drops_host_state_and_device_gradients_and_cheapens_the_backward() -> None:
    spec, gpu = model_preset("Qwen3-8B"), RTX4090
    full_layer = layer_cost(spec, Kernels(gpu, "bf16"), 2048, 2048, None, 0)
    lora_layer = layer_cost(spec, Kernels(gpu, "bf16"), 2048, 2048, None, 16)
    assert lora_layer.backward < 0.75 * full_layer.backward
    full, lora = (
        predict(spec, gpu, Workload(2048, 16, lora_rank=rank), 8, ("roundpipe",))[0]
        for rank in (0, 16)
    )
    # 20 B per trained parameter (masters, Adam, two weight versions) vs 2 B frozen
    assert lora.host_ram < full.host_ram / 8
    assert lora.gpu_memory < full.gpu_memory
    assert lora.tokens_per_s > full.tokens_per_s


def test_host_ram_fit_is_answered_both_ways() -> None:
    spec, work = model_preset("Qwen3-1.7B"), Workload(512, 4)
    small, large = (
        predict(spec, RTX4090, work, 2, ("roundpipe",), host_ram=gb * 10**9)[0] for gb in (16, 256)
    )
    assert not small.host_ram_fits and large.host_ram_fits
    assert small.host_ram == large.host_ram > 16e9


def test_longer_sequences_stop_fitting_past_the_max_length() -> None:
    spec, work = model_preset("Qwen3-8B"), Workload(2048, 1)
    longest = max_seq_len(spec, RTX4090, work).max_seq_len
    assert max_seq_len(spec, gpu_preset("h200"), work).max_seq_len > 4 * longest


def _rows(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_the_command_line_prints_fit_answers_for_gpu_and_host(capsys) -> None:
    argv = ["simulate", "--model", "Qwen3-1.7B", "--gpus", "2", "--batch", "2"]
    main([*argv, "--seq-len", "512", "--schedule", "roundpipe", "--host-ram", "8"])
    out = capsys.readouterr().out
    assert "GPU fits: needs" in out and "host RAM does not fit: needs" in out


def test_max_seq_len_flag_answers_only_the_length(capsys) -> None:
    main(["simulate", "--model", "Qwen3-1.7B", "--max-seq-len", "--json"])
    (row,) = _rows(capsys)
    assert row["max_seq_len"] > 0


def _write(tmp_path: Path, config: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_a_dense_config_file_is_read(tmp_path: Path, capsys) -> None:
    config = {
        "model_type": "llama",
        "hidden_size": 512,
        "intermediate_size": 1024,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "vocab_size": 1000,
    }
    argv = ["simulate", "--config", _write(tmp_path, config), "--gpus", "2", "--batch", "2"]
    main([*argv, "--seq-len", "256", "--schedule", "roundpipe", "--json"])
    (row,) = _rows(capsys)
    assert row["tokens_per_s"] > 0 and row["fits"]


def test_a_moe_config_file_is_priced_by_total_and_active_parameters(tmp_path: Path) -> None:
    config = {
        "model_type": "gpt_oss",
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 24,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 32,
        "experts_per_token": 4,
        "vocab_size": 201088,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
    }
    spec = ModelSpec.from_config(json.loads(Path(_write(tmp_path, config)).read_text()))
    assert spec.num_params == pytest.approx(model_preset("gpt-oss-20b").num_params, rel=1e-6)
    assert spec.active_params == pytest.approx(3.6e9, rel=0.03)
    assert spec.window_layers == 12


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--mfu", "0"], "--mfu is a fraction"),
        (["--mfu", "1.2"], "--mfu is a fraction"),
        (["--gpus", "0"], "--gpus must be positive"),
        (["--seq-len", "-5"], "--seq-len must be positive"),
        (["--batch", "0"], "--batch must be positive"),
        (["--lora", "0"], "--lora must be positive"),
        (["--host-ram", "0"], "--host-ram must be positive"),
        (["--gpu", "rtx9090"], "unknown GPU preset 'rtx9090'"),
        (["--host-ram", "nan"], "--host-ram must be a finite number, got nan"),
        (["--mfu", "nan"], "--mfu must be a finite number, got nan"),
    ],
)
def test_bad_inputs_exit_2_with_a_message(capsys, flags, message) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--model", "Qwen3-1.7B", *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("roundpipe: error: ") and message in err


def test_gantt_without_matplotlib_names_the_extra(monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--layers", "4", "--gantt", str(tmp_path / "g.png")])
    assert exit_info.value.code == 2
    assert "pip install 'roundpipe-ft[plot]'" in capsys.readouterr().err


def test_tiled_layers_pay_their_recomputes_in_the_backward() -> None:
    """Tiled, the MLP's forward runs once more per chunk; with sinks or a window the
    attention's pieces are recomputed too (roundpipe.hf.attention)."""
    kernels = Kernels(RTX4090, "bf16")
    for name, attention_recomputed in (("Llama-3.1-8B", False), ("gpt-oss-20b", True)):
        spec = model_preset(name)
        plain = layer_cost(spec, kernels, 65536, 65536, None, 0)
        tiled = layer_cost(spec, kernels, 65536, 65536, None, 0, seq_chunk=4096)
        width = spec.intermediate_size or spec.experts_per_token * spec.moe_intermediate_size
        extra = 65536 * 6 * spec.hidden_size * width / kernels.matmul_speed
        if attention_recomputed:
            attention = 4 * 65536 * (65536 + 1) / 2 * spec.q_width
            extra += attention / kernels.attention_speed
        assert tiled.forward == plain.forward
        assert tiled.backward - plain.backward == pytest.approx(extra, rel=1e-9)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--fwd-ms", "nan"], "--fwd-ms must be a finite number, got nan"),
        (["--comm-ms", "inf"], "--comm-ms must be a finite number, got inf"),
        (["--bwd-ms", "-1"], "--bwd-ms must be zero or more, got -1.0"),
        (["--layers", "1000000000"], "--layers 1000000000 is more than the simulator steps"),
        (["--gpus", "100000"], "--gpus 100000 is more than the simulator steps"),
    ],
)
def test_garbage_and_unbounded_schedules_are_refused_at_once(capsys, flags, message) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
