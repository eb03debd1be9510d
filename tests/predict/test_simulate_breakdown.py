"""``roundpipe simulate`` explains itself: RoundPipe's host RAM and per-GPU memory term by
term (the terms the fit answers sum), the RAM it is judged against and where that came
from, the nearest configuration that fits when one does not, and model names."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from support.predict_models import TINY_LLAMA, json_rows

from roundpipe.cli import main
from roundpipe.planning.rules import stage_footprint
from roundpipe.predict.breakdown import HOST_BYTES_TRAINABLE, MEMORY_HEADROOM, PINNED_CACHE_BYTES
from roundpipe.predict.gpus import GIB, gpu_preset
from roundpipe.predict.model_specs import ModelSpec, model_preset
from roundpipe.predict.models import PricedModel, Workload, cost_model, memory_fit, predict

RTX4090 = gpu_preset("rtx4090")
TINY = {**TINY_LLAMA, "vocab_size": 1000}
TINY_WORK = Workload(seq_len=128, batch=4)
HOST_KEYS = [
    "weights",
    "spare",
    "masters",
    "gradients",
    "optimizer_state",
    "saved_activations",
    "pinned_buffers",
]
DEVICE_KEYS = ["weights", "prefetched_weights", "gradients", "saved_activations"]


def _hf_params(config: dict, lora_rank: int = 0) -> int:
    """Trained parameters as transformers (and PEFT, for LoRA) count them."""
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    if not lora_rank:
        return model.num_parameters()
    peft = pytest.importorskip("peft")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = peft.get_peft_model(model, peft.LoraConfig(r=lora_rank, target_modules=targets))
    return lora.get_nb_trainable_parameters()[0]


def _roundpipe(spec: ModelSpec, work: Workload, gpus: int = 2, host_ram: int | None = None):
    (prediction,) = predict(spec, RTX4090, work, gpus, ("roundpipe",), host_ram=host_ram)
    return prediction


def _write_config(tmp_path: Path, config: dict) -> str:
    path = tmp_path / "my-model.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_host_ram_of_full_fine_tuning_is_20_bytes_per_parameter_plus_inputs_and_buffers():
    spec = ModelSpec.from_config(TINY)
    params = _hf_params(TINY)
    prediction = _roundpipe(spec, TINY_WORK)
    host, plan = prediction.memory.host, prediction.memory.plan
    # docs/design.md#prediction-assumptions: two half copies, fp32 master, gradient, m, v
    assert host.terms() == {
        "weights": 2 * params,
        "spare": 2 * params,
        "masters": 4 * params,
        "gradients": 4 * params,
        "optimizer_state": 8 * params,
        # every backward stage but the fused one keeps its input: seq x hidden halves
        "saved_activations": (len(plan.backward) - 1) * 4 * 128 * 256 * 2,
        "pinned_buffers": PINNED_CACHE_BYTES,
    }
    assert host.total == sum(host.terms().values()) == prediction.host_ram
    per_parameter = host.total - host.saved_activations - host.pinned_buffers
    assert per_parameter == HOST_BYTES_TRAINABLE * params == 20 * params


def test_lora_host_ram_holds_the_base_once_and_state_only_for_the_adapters():
    spec = ModelSpec.from_config(TINY)
    base, adapters = _hf_params(TINY), _hf_params(TINY, lora_rank=8)
    host = _roundpipe(spec, Workload(seq_len=128, batch=4, lora_rank=8)).memory.host
    assert host.weights == 2 * (base + adapters)
    assert (host.spare, host.masters, host.gradients) == (2 * adapters, 4 * adapters, 4 * adapters)
    assert host.optimizer_state == 8 * adapters


def test_device_terms_sum_to_the_predicted_gpu_memory_and_hold_the_planners_footprint():
    spec, work = model_preset("Qwen3-1.7B"), Workload(seq_len=1024, batch=8)
    prediction = _roundpipe(spec, work, gpus=4)
    device, plan = prediction.memory.device, prediction.memory.plan
    assert device.total == sum(device.terms().values()) == prediction.gpu_memory
    model = PricedModel.build(spec, RTX4090, work, work.tokens_per_microbatch)
    costs = cost_model(model, RTX4090, work, 4, work.round_microbatches(4))
    stages = [(r, False) for r in plan.forward_ranges()]
    stages += [(r, True) for r in plan.backward_ranges()]
    # the fullest stage as the planner counts it, beside the biggest stage's weights
    own = max(stage_footprint(costs, r, backward) for r, backward in stages)
    assert device.weights + device.gradients + device.saved_activations == own
    assert device.prefetched_weights == max(costs.layers.stage_param_bytes(r) for r, _ in stages)


def test_fit_verdicts_are_the_sums_against_the_usable_share():
    spec, work = model_preset("Qwen3-1.7B"), Workload(seq_len=512, batch=4)
    for host_gb in (16, 256):
        prediction = _roundpipe(spec, work, host_ram=host_gb * 10**9)
        memory = prediction.memory
        assert memory.gpu.capacity == RTX4090.memory_bytes
        assert memory.gpu.available == int(RTX4090.memory_bytes * MEMORY_HEADROOM)
        assert memory.host_budget.available == int(host_gb * 10**9 * MEMORY_HEADROOM)
        assert prediction.fits == (memory.device.total <= memory.gpu.available)
        assert prediction.host_ram_fits == (memory.host.total <= memory.host_budget.available)
        assert prediction.host_ram_fits == (host_gb == 256)


def test_the_pinned_buffers_are_the_device_pools_idle_cache():
    from roundpipe.devices.host_blocks import DEFAULT_CACHE_BYTES

    assert PINNED_CACHE_BYTES == DEFAULT_CACHE_BYTES


def test_json_gives_both_breakdowns_in_bytes_with_their_source(capsys):
    argv = ["simulate", "--model", "Qwen3-1.7B", "--gpus", "2", "--batch", "4"]
    main([*argv, "--seq-len", "512", "--host-ram", "256", "--json"])
    roundpipe, *baselines = json_rows(capsys)
    host, device = roundpipe["host_ram"], roundpipe["device_memory"]
    assert list(host) == [*HOST_KEYS, "total", "available", "capacity", "usable_fraction", "source"]
    assert list(device) == [*DEVICE_KEYS, "total", "available", "capacity", "usable_fraction"]
    assert host["total"] == sum(host[k] for k in HOST_KEYS)
    assert device["total"] == sum(device[k] for k in DEVICE_KEYS) == roundpipe["gpu_memory"]
    assert (host["capacity"], host["source"]) == (256 * GIB, "--host-ram")
    assert device["capacity"] == RTX4090.memory_bytes and device["usable_fraction"] == 0.9
    assert roundpipe["suggestion"] is None
    assert all(row["host_ram"] is None and row["device_memory"] is None for row in baselines)


def test_without_host_ram_this_machines_ram_is_the_budget_and_the_output_says_so(capsys):
    argv = ["simulate", "--model", "Qwen3-1.7B", "--gpus", "2", "--batch", "4", "--seq-len", "256"]
    main([*argv, "--schedule", "roundpipe", "--json"])
    (row,) = json_rows(capsys)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert (row["host_ram"]["capacity"], row["host_ram"]["source"]) == (ram, "this machine")
    main([*argv, "--schedule", "roundpipe"])
    out = capsys.readouterr().out
    ram_gib = round(ram / GIB, 1)
    line = f"host RAM: this machine's {ram_gib:g} GiB (give --host-ram for the target server)"
    assert line in out.splitlines()


def test_the_text_table_shows_the_json_terms_in_gib(capsys):
    argv = ["simulate", "--model", "Qwen3-1.7B", "--gpus", "2", "--batch", "4", "--seq-len", "512"]
    main([*argv, "--schedule", "roundpipe", "--host-ram", "64", "--json"])
    (row,) = json_rows(capsys)
    main([*argv, "--schedule", "roundpipe", "--host-ram", "64"])
    lines = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()}
    assert lines["optimizer"][2] == f"{row['host_ram']['optimizer_state'] / GIB:.2f}"
    assert lines["total"][1:3] == [
        f"{row['host_ram']['total'] / GIB:.2f}",
        f"{row['device_memory']['total'] / GIB:.2f}",
    ]
    assert lines["usable"][1:3] == [f"{0.9 * 64:.2f}", f"{0.9 * 24:.2f}"]


def _suggestion(capsys, *flags: str) -> dict:
    main(["simulate", *flags, "--schedule", "roundpipe", "--json"])
    (row,) = json_rows(capsys)
    return row["suggestion"]


def _fits(spec: ModelSpec, work: Workload, gpus: int, host_ram: int | None) -> bool:
    return memory_fit(spec, RTX4090, work, gpus, host_ram).fits_all


def test_full_fine_tuning_over_the_host_ram_is_told_the_ram_it_needs_or_lora(capsys):
    flags = ["--model", "Qwen3-1.7B", "--gpus", "2", "--batch", "4", "--seq-len", "512"]
    suggestion = _suggestion(capsys, *flags, "--host-ram", "16")
    spec, work = model_preset("Qwen3-1.7B"), Workload(seq_len=512, batch=4)
    full = memory_fit(spec, RTX4090, work, 2, 16 * GIB)
    assert full.fits and not full.host_fits
    assert suggestion["host_ram_needed"] == math.ceil(full.host.total / 0.9)
    assert (suggestion["option"], suggestion["value"]) == ("--lora", 64)
    assert _fits(spec, Workload(seq_len=512, batch=4, lora_rank=64), 2, 16 * GIB)
    needed = f"needs {suggestion['host_ram_needed'] / GIB:.1f} GiB of host RAM"
    assert needed in suggestion["text"] and "or --lora 64 fits" in suggestion["text"]


def test_lora_over_the_host_ram_gets_the_highest_lower_rank_that_fits(capsys):
    spec = model_preset("Qwen3-1.7B")
    totals = {
        rank: memory_fit(spec, RTX4090, Workload(512, 4, lora_rank=rank), 2).host.total
        for rank in (64, 32)
    }
    host_gib = (totals[64] + totals[32]) / 2 / MEMORY_HEADROOM / GIB  # 64 too big, 32 fits
    flags = ["--model", "Qwen3-1.7B", "--gpus", "2", "--batch", "4", "--seq-len", "512"]
    suggestion = _suggestion(capsys, *flags, "--lora", "64", "--host-ram", f"{host_gib:.3f}")
    assert (suggestion["option"], suggestion["value"]) == ("--lora", 32)
    assert suggestion["host_ram"] == totals[32]
    assert suggestion["host_ram_needed"] == math.ceil(totals[64] / MEMORY_HEADROOM)


def test_big_microbatches_over_the_gpu_get_the_fewest_more_that_fit(capsys):
    spec, gpus = model_preset("Qwen3-1.7B"), 2
    flags = ["--model", "Qwen3-1.7B", "--gpus", str(gpus), "--batch", "16", "--seq-len", "4096"]
    flags += ["--lora", "1", "--microbatches", "1", "--host-ram", "100000"]
    suggestion = _suggestion(capsys, *flags)
    assert suggestion["option"] == "--microbatches"
    count = suggestion["value"]
    assert 16 % count == 0 and count > 1
    for fewer in (d for d in range(1, count) if 16 % d == 0):
        work = Workload(seq_len=4096, batch=16, microbatch_size=16 // fewer, lora_rank=1)
        assert not _fits(spec, work, gpus, None)
    work = Workload(seq_len=4096, batch=16, microbatch_size=16 // count, lora_rank=1)
    assert _fits(spec, work, gpus, None)


def test_a_sequence_too_long_for_the_gpu_gets_the_longest_that_fits(capsys):
    spec = model_preset("Qwen3-1.7B")
    flags = ["--model", "Qwen3-1.7B", "--gpus", "2", "--batch", "1", "--seq-len", "131072"]
    suggestion = _suggestion(capsys, *flags, "--lora", "1", "--host-ram", "100000")
    assert suggestion["option"] == "--seq-len"
    longest = suggestion["value"]
    assert longest % 256 == 0 and longest < 131072
    assert _fits(spec, Workload(longest, 1, lora_rank=1), 2, None)
    assert not _fits(spec, Workload(longest + 256, 1, lora_rank=1), 2, None)


def test_when_nothing_nearby_fits_the_suggestion_says_so(tmp_path, capsys):
    huge = {**TINY, "hidden_size": 16384, "intermediate_size": 131072, "num_attention_heads": 128}
    flags = ["--config", _write_config(tmp_path, huge), "--gpus", "2", "--batch", "2"]
    suggestion = _suggestion(capsys, *flags, "--seq-len", "512", "--host-ram", "100000")
    assert suggestion["option"] is None and suggestion["value"] is None
    assert suggestion["text"].endswith("fits: a GPU with more memory is needed")
    assert suggestion["host_ram_needed"] is None


def test_a_run_without_a_plan_prints_the_finest_plans_breakdown_and_a_suggestion(capsys):
    argv = ["simulate", "--model", "Qwen3-1.7B", "--gpus", "2", "--batch", "1"]
    main([*argv, "--seq-len", "131072", "--schedule", "roundpipe", "--host-ram", "100000"])
    out = capsys.readouterr().out
    assert "roundpipe         does not fit the GPUs: no plan fits" in out
    assert "memory, GiB (finest plan)" in out and "suggestion: --lora 1 fits" not in out
    assert "  suggestion: --seq-len " in out


def test_an_unknown_preset_lists_the_presets_and_points_to_config(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--model", "Qwen9-1B"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown model preset 'Qwen9-1B'" in err and "Qwen3-8B" in err
    assert "give --config path/to/config.json" in err


def test_microbatches_that_do_not_split_the_batch_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--model", "Qwen3-1.7B", "--batch", "16", "--microbatches", "5"])
    assert exit_info.value.code == 2
    assert "--microbatches 5 does not split --batch 16 evenly" in capsys.readouterr().err


def test_a_saved_config_is_named_by_its_architecture_and_size(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=100,
    )
    model = transformers.Qwen3ForCausalLM(config)
    model.save_pretrained(tmp_path)
    assert model.num_parameters() == 86912  # "86.9K"
    main(["simulate", "--config", str(tmp_path / "config.json"), "--max-seq-len", "--json"])
    (row,) = json_rows(capsys)
    assert row["model"] == "Qwen3ForCausalLM 86.9K"


def test_a_config_with_a_name_or_path_is_named_by_it(tmp_path, capsys):
    named = {**TINY, "_name_or_path": "my-org/tiny-llama"}
    main(["simulate", "--config", _write_config(tmp_path, named), "--max-seq-len", "--json"])
    (row,) = json_rows(capsys)
    assert row["model"] == "my-org/tiny-llama"
