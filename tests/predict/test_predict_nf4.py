"""``roundpipe simulate --lora R --quantize nf4``: host RAM with the frozen base in NF4,
uploads of the quantized bytes, and the transfer time they save.

Oracles: the runtime's own ``NF4Linear`` (its bytes per quantized layer), the simulator's
upload spans (the bytes each round uploads, with and without NF4, on the same plan), and
the per-weight costs written out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from support.predict_models import TINY_LLAMA, json_rows
from torch import nn

from roundpipe.cli import main
from roundpipe.planning.sim.roundpipe_schedule import simulate_roundpipe
from roundpipe.predict.gpus import GIB, PCIE_BANDWIDTH, gpu_preset
from roundpipe.predict.host_settings import LeanSettings
from roundpipe.predict.model_specs import ModelSpec, model_preset
from roundpipe.predict.models import PricedModel, Workload, cost_model, memory_fit, predict
from roundpipe.predict.nf4_uploads import upload_savings
from roundpipe.predict.unit_costs import (
    MEMORY_EFFICIENCY,
    Kernels,
    dequantized_params,
    layer_cost,
)

RTX4090 = gpu_preset("rtx4090")
TINY = TINY_LLAMA
NF4 = LeanSettings(quantize="nf4")
FLAGS = ["simulate", "--model", "Qwen3-1.7B", "--gpus", "2", "--batch", "8", "--seq-len", "512"]


def _work(quantize: str | None = "nf4", **rest) -> Workload:
    values = {"seq_len": 512, "batch": 8, "lora_rank": 8, **rest}
    return Workload(**values, settings=LeanSettings(quantize=quantize))


def test_the_quantized_base_holds_what_the_runtimes_nf4_layers_hold():
    transformers = pytest.importorskip("transformers")
    nf4 = pytest.importorskip("roundpipe.hf.nf4")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).to(torch.bfloat16)
    quantized = 0
    for layer in model.model.layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    quantized += child.weight.numel()
                    setattr(parent, name, nf4.NF4Linear.from_linear(child))
    base_bytes = sum(p.nbytes for p in model.parameters())
    spec = ModelSpec.from_config(TINY)
    assert quantized == spec.num_layers * spec.linear_weight_params
    host = memory_fit(spec, RTX4090, _work(seq_len=128, batch=4), 2).host
    adapters = spec.lora_params(8)
    assert host.weights == base_bytes + 2 * adapters
    assert host.weights == 2 * (spec.num_params - quantized + adapters) + quantized * 9 // 16
    unquantized = memory_fit(spec, RTX4090, _work(None, seq_len=128, batch=4), 2).host
    assert (host.spare, host.masters, host.optimizer_state) == (
        unquantized.spare,
        unquantized.masters,
        unquantized.optimizer_state,
    )


def test_a_quantized_layer_uploads_its_nf4_bytes_and_pays_a_dequantizing_pass():
    spec, kernels = model_preset("Qwen3-8B"), Kernels(RTX4090, "bf16")
    plain = layer_cost(spec, kernels, 4096, 4096, None, 16)
    quantized = layer_cost(spec, kernels, 4096, 4096, None, 16, quantized=True)
    h, i = spec.hidden_size, spec.intermediate_size
    weights = h * (2 * spec.q_width + 2 * spec.kv_width) + 3 * h * i  # q k v o, gate up down
    assert spec.linear_weight_params == weights
    assert plain.param_bytes - quantized.param_bytes == 2 * weights - math.ceil(weights * 0.5625)
    # read 0.5625 B and write 2 B per weight at the GPU's (derated) memory bandwidth, in the
    # forward (and so the recompute) and again for the input gradient
    dequantize = weights * 2.5625 / (RTX4090.memory_bandwidth * MEMORY_EFFICIENCY)
    assert quantized.forward - plain.forward == pytest.approx(dequantize, rel=1e-9)
    assert quantized.backward - plain.backward == pytest.approx(dequantize, rel=1e-9)
    assert quantized.activation_bytes == plain.activation_bytes


def test_an_moe_pass_dequantizes_only_the_experts_it_routes_to():
    spec = model_preset("Qwen3-30B-A3B")
    expert = 3 * spec.hidden_size * spec.moe_intermediate_size
    attention = spec.hidden_size * (2 * spec.q_width + 2 * spec.kv_width)
    assert spec.linear_weight_params == attention + spec.num_experts * expert
    assert dequantized_params(spec, 1) == attention + spec.experts_per_token * expert
    assert dequantized_params(spec, 4096) == spec.linear_weight_params


def _uploaded_bytes(work: Workload, plan, gpus: int) -> float:
    """Bytes the simulator uploads in one round of ``plan``: its upload spans' seconds at
    the link's bandwidth."""
    model = PricedModel.build(model_preset("Qwen3-1.7B"), RTX4090, work, work.tokens_per_microbatch)
    microbatches = work.round_microbatches(gpus)
    costs = cost_model(model, RTX4090, work, gpus, microbatches)
    result = simulate_roundpipe(plan, costs, gpus, microbatches, round_size=microbatches)
    seconds = sum(s.end - s.start for s in result.timeline.spans if s.kind == "upload")
    return seconds * costs.h2d_bandwidth


def test_the_upload_bytes_saved_are_what_the_simulator_stops_uploading():
    spec, gpus = model_preset("Qwen3-1.7B"), 2
    work = _work(batch=32)  # 4 rounds of 8 microbatches
    plan = memory_fit(spec, RTX4090, work, gpus).plan
    savings = upload_savings(spec, RTX4090, work, gpus, plan)
    per_round = _uploaded_bytes(_work(None, batch=32), plan, gpus) - _uploaded_bytes(
        work, plan, gpus
    )
    rounds = work.num_microbatches / work.round_microbatches(gpus)
    assert rounds == 4
    assert savings.upload_saved_bytes == pytest.approx(per_round * rounds, rel=1e-9)
    assert savings.upload_saved_s == savings.upload_saved_bytes / PCIE_BANDWIDTH[4]
    # every layer of a forward stage is uploaded twice (forward, backward), the fused once
    fused = plan.backward[0] - 1  # the head is a unit of the fused stage
    assert savings.layer_uploads == 2 * spec.num_layers - fused
    passes = savings.layer_uploads + spec.num_layers  # and each backward dequantizes again
    once = spec.linear_weight_params * 2.5625 / (RTX4090.memory_bandwidth * MEMORY_EFFICIENCY)
    assert savings.dequantize_s == pytest.approx(once * passes * 32, rel=1e-9)


def test_no_savings_without_a_quantized_base():
    spec = model_preset("Qwen3-1.7B")
    work = _work(None)
    assert upload_savings(spec, RTX4090, work, 2, memory_fit(spec, RTX4090, work, 2).plan) is None


def test_few_microbatches_on_a_slow_link_get_faster_and_many_pay_for_dequantizing():
    # one round of 4 short microbatches: each layer's upload outweighs its dequantizing;
    # with 16 per round every pass dequantizes again and the saving is gone
    spec, gpus = model_preset("Qwen3-8B"), 4

    def tokens_per_s(batch: int, quantize: str | None) -> float:
        work = _work(quantize, seq_len=256, batch=batch, pcie=3)
        return predict(spec, RTX4090, work, gpus, ("roundpipe",))[0].tokens_per_s

    assert tokens_per_s(4, "nf4") > 1.5 * tokens_per_s(4, None)
    assert tokens_per_s(16, "nf4") < tokens_per_s(16, None)


def test_the_output_states_the_upload_saved_in_text_and_json(capsys):
    main([*FLAGS, "--lora", "8", "--quantize", "nf4", "--schedule", "roundpipe", "--json"])
    (row,) = json_rows(capsys)
    assert (row["quantize"], row["optimizer_states"], row["master_weights"]) == (
        "nf4",
        "fp32",
        "fp32",
    )
    spec, work = model_preset("Qwen3-1.7B"), _work()
    savings = upload_savings(spec, RTX4090, work, 2, memory_fit(spec, RTX4090, work, 2).plan)
    assert row["upload_saved_bytes"] == savings.upload_saved_bytes > 0
    assert row["upload_saved_s"] == pytest.approx(savings.upload_saved_s)
    assert row["dequantize_s"] == pytest.approx(savings.dequantize_s)
    main([*FLAGS, "--lora", "8", "--quantize", "nf4", "--schedule", "roundpipe"])
    out = capsys.readouterr().out
    line = (
        f"  nf4 uploads: {savings.upload_saved_bytes / GIB:.2f} GiB less over PCIe per "
        f"iteration, {savings.upload_saved_s:.2f} s less upload (summed over the links), "
        f"{savings.dequantize_s:.2f} s of dequantizing on the GPUs"
    )
    assert line in out.splitlines()
    assert "frozen base in nf4 (0.5625 B a linear weight)" in out
