"""The routed experts' adapters peft 0.22 adds under all-linear: the model types it
converts, as the installed peft lists them; what they cost (the folded expert stacks);
and the count a peft without the conversion makes."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from roundpipe.cli import main
from roundpipe.predict import peft_targets
from roundpipe.predict.gpus import gpu_preset
from roundpipe.predict.layer_kinds import MOE
from roundpipe.predict.model_specs import model_preset
from roundpipe.predict.op_bytes import HALF
from roundpipe.predict.unit_costs import Kernels, _expert_times, layer_cost


def test_the_model_types_are_those_the_installed_peft_converts():
    conversion = pytest.importorskip("peft.utils.transformers_weight_conversion")
    if not peft_targets.peft_converts_experts():
        pytest.skip("this peft converts no experts' targets")
    patterns = conversion._MOE_FUSED_TARGETS.keys()
    converted = {t for t, p in conversion._MODEL_TO_CONVERSION_PATTERN.items() if p in patterns}
    assert converted == peft_targets.EXPERT_CONVERSION_TYPES


@pytest.fixture
def converting(monkeypatch):
    """Price as under a peft that converts (True) or does not (False)."""

    def set_to(value: bool) -> None:
        monkeypatch.setattr(peft_targets, "peft_converts_experts", lambda: value)

    return set_to


def test_qwen3_moe_gets_an_adapter_per_expert_only_where_peft_converts(converting):
    spec = model_preset("Qwen3-30B-A3B")
    h, i, experts, rank = 2048, 768, 128, 16
    converting(False)
    before = spec.lora_params(rank)
    assert not spec.expert_adapters
    converting(True)
    per_layer = experts * (2 * rank * (h + 2 * i) + rank * (i + h)) + rank * (h + experts)
    assert spec.expert_adapters
    assert spec.lora_params(rank) - before == spec.num_layers * per_layer
    # a model type peft does not convert keeps none
    assert not replace(spec, model_type="gpt_oss").expert_adapters


def test_folded_expert_adapters_cost_two_expert_stacks_and_their_weight_gradient(converting):
    spec = model_preset("Qwen3-30B-A3B")
    moe = next(shape for shape in spec.layer_shapes if shape.ffn == MOE)
    kernels = Kernels(gpu_preset("rtx4090"), "bf16")

    def cost():
        return layer_cost(spec, kernels, 2048, 2048, None, 16, layer=moe)

    converting(False)
    plain = cost()
    converting(True)
    folded = cost()
    stack = spec.num_experts * spec.expert_params * HALF
    assert folded.activation_bytes - plain.activation_bytes == 2 * stack
    adapters = spec.expert_adapter_params(moe, 16)
    assert folded.param_bytes - plain.param_bytes == adapters * HALF
    assert folded.forward > plain.forward
    # the experts' weight gradient, as a full fine-tune computes it, and more
    weight_gradient = _expert_times(spec, kernels, 2048, False, moe)[1]
    weight_gradient -= _expert_times(spec, kernels, 2048, True, moe)[1]
    assert folded.backward - plain.backward > weight_gradient > 0


def _simulate(capsys, *flags: str) -> dict:
    argv = ["simulate", "--model", "GLM-4.5-Air", "--gpu", "rtx4090", "--json", "--lora", "16"]
    main([*argv, "--schedule", "roundpipe", "--host-ram", "1024", "--seq-len", "1024", *flags])
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    return row


def test_simulate_prices_the_expert_adapters_unless_told_not_to(converting, capsys):
    converting(True)
    with_experts = _simulate(capsys)
    without = _simulate(capsys, "--no-lora-experts")
    converting(False)
    assert _simulate(capsys) == without  # a peft that converts nothing adds none
    assert without["fits"] and not with_experts["fits"]
    assert "layer" in with_experts["detail"]  # a layer's folded expert stacks outgrow it
    assert with_experts["suggestion"]["option"] == "--no-lora-experts"
    assert with_experts["suggestion"]["text"].startswith("--no-lora-experts fits (GPU")
    assert with_experts["host_ram"]["total"] > without["host_ram"]["total"]


def test_the_memory_check_prices_expert_adapters_only_for_targets_that_reach_them():
    assert peft_targets.targets_reach_experts("all-linear")
    assert peft_targets.targets_reach_experts(["q_proj", "mlp.down_proj"])
    assert not peft_targets.targets_reach_experts(["q_proj", "k_proj", "v_proj", "o_proj"])
    conversion = pytest.importorskip("peft.utils.transformers_weight_conversion")
    if peft_targets.peft_converts_experts():
        names = {n for m in conversion._MOE_TARGET_MODULE_MAPPING.values() for n in m}
        assert names == peft_targets.EXPERT_TARGET_NAMES


@pytest.mark.parametrize(
    ("targets", "experts"), [("all-linear", True), ("q_proj,v_proj", False), ("down_proj", True)]
)
def test_roundpipe_train_prices_expert_adapters_as_its_targets_reach_them(targets, experts):
    pytest.importorskip("yaml")
    from roundpipe.train.memory_check import run_workload
    from roundpipe.train.options import resolve

    given = {"model": "m", "data": "d", "output": "o", "seq_len": 512, "lora_targets": targets}
    options = resolve(given)
    assert run_workload(options, world=1, devices=1).lora_experts is experts


def test_simulate_says_how_many_parameters_lora_trains(converting, capsys):
    argv = ["simulate", "--model", "Qwen3-30B-A3B", "--gpu", "rtx4090", "--lora", "16"]
    argv += ["--schedule", "roundpipe", "--host-ram", "1024"]
    converting(True)
    main(argv)
    assert "LoRA rank 16: 996.5M trained, the routed experts' too" in capsys.readouterr().out
    main([*argv, "--no-lora-experts"])
    assert "LoRA rank 16: 13.4M trained)" in capsys.readouterr().out


QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "num_experts": 128,
    "num_experts_per_tok": 8,
}  # fmt: skip


def test_a_run_the_expert_adapters_outgrow_is_told_to_leave_the_experts(converting, monkeypatch):
    """roundpipe train's memory check: between what all-linear needs with peft 0.22's
    expert adapters and what it needs without, the refusal names the targets to give."""
    pytest.importorskip("yaml")
    from roundpipe.predict.host_memory import AVAILABLE, Room
    from roundpipe.predict.model_specs import ModelSpec
    from roundpipe.predict.models import memory_fit
    from roundpipe.train import memory_check
    from roundpipe.train.options import resolve
    from roundpipe.train.usage import UsageError

    converting(True)
    given = {"model": "m", "data": "d", "output": "o", "seq_len": 512, "devices": "emulated:2"}
    options = resolve(given)
    work = memory_check.run_workload(options, world=1, devices=2)
    spec, gpu = ModelSpec.from_config(QWEN3_30B_A3B), memory_check.PRICED_GPU
    needs = [memory_fit(spec, gpu, w, 2, 2**50) for w in (work, replace(work, lora_experts=False))]
    fraction = needs[0].host_budget.usable_fraction
    room = int((needs[0].host.total + needs[1].host.total) / 2 / fraction)
    monkeypatch.setattr(memory_check, "usable_ram", lambda: Room(room, AVAILABLE))
    with pytest.raises(UsageError, match="--lora-targets naming no expert projection"):
        memory_check.check_host_memory(options, QWEN3_30B_A3B, world=1)
    converting(False)  # a peft that adapts no expert: the run fits
    memory_check.check_host_memory(options, QWEN3_30B_A3B, world=1)


def test_the_nf4_expert_types_are_the_families_roundpipe_hf_quantizes_the_experts_of():
    from roundpipe.hf.nf4_experts import SUPPORTED

    classes = {t.title().replace("_", "") + "Experts" for t in peft_targets.NF4_EXPERT_TYPES}
    assert classes == set(SUPPORTED)  # Qwen3MoeExperts, GptOssExperts
