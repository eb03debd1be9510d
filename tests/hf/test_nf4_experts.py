"""NF4 stacked MoE experts (Qwen3-MoE, GPT-OSS) under ``from_pretrained(quantize="nf4")``.

Oracle: the same Hugging Face model on plain PyTorch with every weight RoundPipe
quantizes (decoder linears and each expert's 2-d weight) replaced by its NF4 round
trip (:mod:`roundpipe.hf.nf4_format`, bit-identical to bitsandbytes), wrapped by peft
with the same LoRA config, in fp32: the loss, the router loss and the adapter gradients
agree to float summation order. Each expert is quantized on its own, as bitsandbytes
quantizes a 2-d weight.
"""

from __future__ import annotations

import copy
import gc
import math
import os
import shutil
import weakref

import pytest
import torch
from safetensors.torch import load_file
from support.children.harness import CHILDREN
from support.nf4_models import (
    adapter_config,
    adapter_grads,
    losses_around_a_checkpoint,
    set_adapters,
)

import roundpipe
from roundpipe import RoundPipeRunConfig
from roundpipe.hf import nf4_experts
from roundpipe.hf.nf4 import NF4Linear
from roundpipe.hf.nf4_experts import NF4Experts, nf4_expert_modules, quantize_experts_module
from roundpipe.hf.nf4_format import dequantize_nf4, quantize_nf4

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from support.children.harness import run_child  # noqa: E402
from support.hf_families import build, padded_batch, train_steps  # noqa: E402

TARGETS = ["q_proj", "v_proj", "o_proj"]
FAMILIES = ["qwen3_moe", "gpt_oss"]


def lora_config(**kwargs):
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, **kwargs)


def build_moe(family: str, router_loss: bool = False, odd: bool = False):
    """The tiny models of test_hf_from_hf; ``odd``: Qwen3-MoE experts of 24 × 36 and
    36 × 12 elements, each ending in a partial block (grouped_mm needs rows of a
    multiple of 16 bytes)."""
    if odd:
        torch.manual_seed(0)
        config = transformers.Qwen3MoeConfig(
            vocab_size=64,
            hidden_size=36,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=12,
        )
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        model = build(family)
    with torch.no_grad():  # experts that matter: NF4's error shows in the loss
        for module in model.modules():
            if type(module).__name__.endswith("Experts"):
                module.gate_up_proj.mul_(8)
                module.down_proj.mul_(8)
    if router_loss:
        model.config.output_router_logits = True
        model.config.router_aux_loss_coef = 0.5  # large enough to matter
    return model


def round_trip(weight: torch.Tensor) -> torch.Tensor:
    packed, absmax = quantize_nf4(weight)
    return dequantize_nf4(packed, absmax, weight.shape, weight.dtype)


def oracle(model, experts: bool = True):
    """``model`` with each weight RoundPipe quantizes replaced by its NF4 round trip
    (``experts=False``: the linears only)."""
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for name, module in reference.named_modules():
            if ".layers." not in name:
                continue
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(round_trip(module.weight))
            if experts and type(module).__name__.endswith("Experts"):
                for weight in (module.gate_up_proj, module.down_proj):
                    weight.copy_(torch.stack([round_trip(w) for w in weight]))
    return reference


def quantized_pipe(directory, lora=None, dtype=torch.float32, **options):
    options.setdefault("devices", "emulated:2")
    return roundpipe.from_pretrained(
        directory, torch_dtype=dtype, lora=lora or lora_config(), quantize="nf4", **options
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Qwen3-MoE (stored one tensor per expert) and GPT-OSS (stored stacked, with biases),
    saved in fp32; with the router loss; Qwen3-MoE with partial blocks."""
    root = tmp_path_factory.mktemp("nf4_moe")
    for family in FAMILIES:
        build_moe(family).save_pretrained(root / family)
        build_moe(family, router_loss=True).save_pretrained(root / f"{family}_router")
    build_moe("qwen3_moe", odd=True).save_pretrained(root / "odd")
    return root


@pytest.mark.parametrize(
    ("name", "implementation"),
    [
        ("qwen3_moe", None),
        ("gpt_oss", None),
        ("qwen3_moe_router", None),
        ("gpt_oss_router", None),
        ("qwen3_moe", "eager"),
        ("gpt_oss", "eager"),
        ("odd", None),
        ("odd", "eager"),
    ],
)
def test_loss_and_adapter_gradients_equal_the_dense_nf4_round_trip(
    saved, name, implementation, monkeypatch
):
    """``None``: transformers' default experts implementation (grouped_mm, which reads
    the whole stacked tensor); ``eager`` indexes one expert at a time, and only the
    experts it indexes are dequantized."""
    dense = transformers.AutoModelForCausalLM.from_pretrained(saved / name)
    if implementation is not None:
        dense.set_experts_implementation(implementation)
    reference = peft.get_peft_model(oracle(dense), lora_config())
    set_adapters(reference)
    batch = padded_batch()
    want = reference(**batch).loss
    want.backward()
    if implementation == "eager":

        def whole(self, name):
            raise AssertionError("the eager forward dequantized every expert")

        monkeypatch.setattr(NF4Experts, "dequantized", whole)
    config = RoundPipeRunConfig(num_microbatch=1)
    with quantized_pipe(saved / name, model_run_config=config) as pipe:
        base = pipe.hf_model.get_base_model()
        if implementation is not None:
            base.set_experts_implementation(implementation)
        set_adapters(pipe.hf_model)
        loss = pipe.forward_backward(input_kwargs=batch)
        pipe.synchronize()
        grads = adapter_grads(pipe.optim_named_parameters())
        experts = nf4_expert_modules(base)
    assert len(experts) == dense.config.num_hidden_layers
    torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-5, atol=1e-6)
    want_grads = adapter_grads(reference.named_parameters())
    assert grads.keys() == want_grads.keys() and len(grads) == 2 * len(TARGETS) * len(experts)
    for key, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[key], rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss", "odd"])
def test_the_experts_nf4_error_is_far_above_the_tolerance(saved, name):
    """The comparisons above can fail: keeping the experts dense moves the loss by much
    more than their tolerance (4e-5)."""
    dense = transformers.AutoModelForCausalLM.from_pretrained(saved / name)
    batch = padded_batch()
    with torch.no_grad():
        quantized = oracle(dense)(**batch).loss
        linears_only = oracle(dense, experts=False)(**batch).loss
    assert abs(float(quantized - linears_only)) > 2e-4


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_graph_keeps_no_dense_expert_weight(family, implementation, monkeypatch):
    """Autograd saves the NF4 data, not the weights the forward dequantized: none of
    them is alive between forward and backward, and the backward dequantizes each saved
    one again; the gradients are those of the dense round trip."""
    model = build_moe(family)
    model.set_experts_implementation(implementation)
    dense = model.model.layers[0].mlp.experts
    reference = oracle(model).model.layers[0].mlp.experts
    experts = quantize_experts_module(copy.deepcopy(dense))
    made = []
    original = nf4_experts.dequantize

    def counted(*args):
        made.append(weakref.ref(weight := original(*args)))
        return weight

    monkeypatch.setattr(nf4_experts, "dequantize", counted)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(12, model.config.hidden_size, generator=generator)
    index = torch.randint(0, 4, (12, 2), generator=generator)
    scores = torch.rand(12, 2, generator=generator)
    results = []
    for module in (experts, reference):
        x, w = hidden.clone().requires_grad_(), scores.clone().requires_grad_()
        out = module(x, index, w)
        forward_made = len(made)
        gc.collect()
        assert not any(ref() is not None for ref in made)
        (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        results.append((out.detach(), x.grad, w.grad, forward_made, len(made) - forward_made))
    (out, x_grad, w_grad, forward_made, backward_made), (want, want_x, want_w, *_) = results
    assert forward_made == backward_made > 0 and forward_made >= 2
    if implementation == "grouped_mm":
        assert forward_made == 2  # gate_up_proj and down_proj, whole
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x_grad, want_x, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w_grad, want_w, rtol=1e-5, atol=1e-6)


def test_the_router_loss_is_part_of_the_loss(saved):
    """The router-loss models' loss differs from the plain ones' by coef × aux > 0."""
    batch = padded_batch()
    losses = {}
    for name in ("qwen3_moe", "qwen3_moe_router"):
        with quantized_pipe(saved / name, devices="emulated:1") as pipe:
            set_adapters(pipe.hf_model)
            losses[name] = float(pipe.forward_backward(input_kwargs=batch))
    assert losses["qwen3_moe_router"] > losses["qwen3_moe"] + 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_expert_is_nf4_in_0_5625_host_bytes_a_parameter(saved, family, dtype):
    """Each expert's rows hold exactly the NF4 of that expert's 2-d weight in the model
    dtype (bf16: converted from the fp32 checkpoint, as transformers loads it); the
    biases (GPT-OSS), the routers and everything outside the layers stay as loaded."""
    dense = transformers.AutoModelForCausalLM.from_pretrained(saved / family, dtype=dtype)
    with quantized_pipe(saved / family, dtype=dtype, devices="emulated:1") as pipe:
        base = pipe.hf_model.get_base_model()
        experts = nf4_expert_modules(base)
        state = {n: p.detach().clone() for n, p in base.named_parameters()}
        dequantized = {n: m.dequantized("down_proj") for n, m in experts.items()}
    assert len(experts) == 3 and all(isinstance(m, NF4Experts) for m in experts.values())
    params = host = 0
    for name in experts:
        for weight in ("gate_up_proj", "down_proj"):
            original = dense.get_parameter(f"{name}.{weight}")
            packed, absmax = state[f"{name}.{weight}_packed"], state[f"{name}.{weight}_absmax"]
            assert f"{name}.{weight}" not in state
            assert not packed.requires_grad and packed.dtype == torch.uint8
            for expert, w in enumerate(original):
                want_packed, want_absmax = quantize_nf4(w)
                assert torch.equal(packed[expert], want_packed), (name, weight, expert)
                assert torch.equal(absmax[expert], want_absmax), (name, weight, expert)
            params += original.numel()
            host += packed.numel() + 4 * absmax.numel()
        want = torch.stack([round_trip(w) for w in dense.get_parameter(f"{name}.down_proj")])
        assert torch.equal(dequantized[name], want)
    assert host == 0.5625 * params
    for name, param in dense.named_parameters():
        module_name, _, attr = name.rpartition(".")
        module = dense.get_submodule(module_name)
        if isinstance(module, torch.nn.Linear) and ".layers." in name and attr == "weight":
            continue  # NF4Linear (test_nf4_lora)
        if module_name in experts and attr in ("gate_up_proj", "down_proj"):
            continue
        wrapped = f"{module_name}.base_layer.{attr}"  # a LoRA target's bias
        kept = state[name] if name in state else state[wrapped]
        assert torch.equal(kept, param), name  # biases, routers, norms, embeddings


@pytest.mark.parametrize("family", FAMILIES)
def test_loading_reads_one_expert_at_a_time(saved, family, monkeypatch):
    """Qwen3-MoE stores one tensor per expert and projection, GPT-OSS the stacked
    tensor: either way an experts weight is read into a buffer of one expert, never
    into a dense stacked tensor."""
    reads = []
    original = nf4_experts.read_into

    def recorded(stored, out):
        reads.append((stored.name, out.shape))
        original(stored, out)

    monkeypatch.setattr(nf4_experts, "read_into", recorded)
    with quantized_pipe(saved / family, devices="emulated:1") as pipe:
        experts = nf4_expert_modules(pipe.hf_model.get_base_model())
    # 3 layers × 4 experts × (gate, up, down) or (gate_up, down)
    assert len(reads) == 3 * 4 * (3 if family == "qwen3_moe" else 2)
    one_expert = math.prod(experts["model.layers.0.mlp.experts"]._nf4_shapes["gate_up_proj"][1:])
    assert max(math.prod(shape) for _, shape in reads) <= one_expert


def test_experts_and_linears_are_frozen_and_not_lora_targets(saved):
    lora = peft.LoraConfig(r=2, target_modules="all-linear")
    with quantized_pipe(saved / "gpt_oss", lora=lora, devices="emulated:1") as pipe:
        model = pipe.hf_model
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        wrapped = {n for n, m in model.named_modules() if hasattr(m, "lora_A")}
        linears = [m for m in model.modules() if isinstance(m, NF4Linear)]
    assert trainable and all("lora_" in n for n in trainable)
    assert wrapped and not any("experts" in n or "router" in n for n in wrapped)
    assert len(linears) == len(wrapped)  # every attention projection, quantized and wrapped


def test_lora_on_the_stacked_experts_is_refused(saved):
    lora = peft.LoraConfig(r=2, target_modules=["q_proj"], target_parameters=["gate_up_proj"])
    with pytest.raises(ValueError, match=r"target_parameters=\['gate_up_proj'\] puts LoRA"):
        quantized_pipe(saved / "qwen3_moe", lora=lora, devices="emulated:1")


def test_a_checkpoint_of_a_quantized_moe_run_resumes_it_exactly(saved, tmp_path):
    def run(load: bool) -> list[float]:
        def open_pipe():
            return quantized_pipe(saved / "gpt_oss_router")

        return losses_around_a_checkpoint(open_pipe, tmp_path / "ckpt", padded_batch, load)

    assert run(load=False) == run(load=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_adapter_loads_with_peft_on_the_unquantized_model(saved, tmp_path, family):
    with quantized_pipe(saved / family) as pipe:
        train_steps(pipe, steps=2)
        pipe.save_pretrained(tmp_path / "nf4_adapter")
        trained = {
            n: p.detach().clone() for n, p in pipe.hf_model.named_parameters() if "lora_" in n
        }
    with roundpipe.from_pretrained(
        saved / family, torch_dtype=torch.float32, lora=lora_config(), devices="emulated:1"
    ) as dense_pipe:
        dense_pipe.save_pretrained(tmp_path / "dense_adapter")
    for file in ("adapter_model.safetensors", "adapter_config.json"):
        assert (tmp_path / "nf4_adapter" / file).exists()
    assert (
        load_file(tmp_path / "nf4_adapter" / "adapter_model.safetensors").keys()
        == load_file(tmp_path / "dense_adapter" / "adapter_model.safetensors").keys()
    )
    assert adapter_config(tmp_path / "nf4_adapter") == adapter_config(tmp_path / "dense_adapter")
    base = transformers.AutoModelForCausalLM.from_pretrained(saved / family)
    reloaded = peft.PeftModel.from_pretrained(base, tmp_path / "nf4_adapter")
    loaded = {n: p for n, p in reloaded.named_parameters() if "lora_" in n}
    assert loaded.keys() == trained.keys()
    for name, value in trained.items():
        assert torch.equal(loaded[name], value), name
    assert any(bool(value.abs().sum()) for n, value in trained.items() if "lora_B" in n)


@pytest.mark.slow  # 60 s on 2 busy cores: writing 840 MB, quantizing 400 M expert parameters
def test_loading_a_moe_checkpoint_quantized_stays_within_its_host_memory_bound(tmp_path):
    """Peak RSS ≤ 1.2 × the quantized model's host bytes + 1 GB (the imports take
    ~0.4 GB), for a checkpoint whose experts (96% of it) are stored one tensor per
    expert: each expert is read and quantized on its own, never stacked dense."""
    script = os.path.join(CHILDREN, "nf4_moe_load.py")
    directory = tmp_path / "checkpoint"
    try:
        generated = run_child([script, "generate", str(directory)], 120)
        result = run_child([script, "measure", str(directory)], 300)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert result["expert_params"] > 0.9 * generated["weight_bytes"] / 2
    assert result["expert_bytes"] == 0.5625 * result["expert_params"]
    assert result["loaded_peak_rss"] <= 1.2 * result["quantized_bytes"] + (1 << 30), result
    # what loading added is the quantized model and ~100 MB of quantize temporaries;
    # the dense experts are 805 MB, one layer's stacked 201 MB
    added = result["loaded_peak_rss"] - result["baseline_rss"]
    assert added < 1.2 * result["quantized_bytes"] + (160 << 20), result
    assert result["loss"] == result["loss"]  # not NaN


@pytest.mark.parametrize("quantize", [None, "nf4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_predictor_counts_the_adapters_all_linear_trains(saved, family, quantize):
    """``roundpipe simulate``'s LoRA count is what a run trains: with peft 0.22 a dense
    Qwen3-MoE's routed experts and router get adapters, an NF4 one's stay frozen."""
    from roundpipe.predict.gpus import gpu_preset
    from roundpipe.predict.host_settings import LeanSettings
    from roundpipe.predict.model_specs import ModelSpec
    from roundpipe.predict.models import PricedModel, Workload

    lora = peft.LoraConfig(r=4, target_modules="all-linear")
    pipe = roundpipe.from_pretrained(
        saved / family,
        torch_dtype=torch.float32,
        lora=lora,
        quantize=quantize,
        devices="emulated:1",
    )
    with pipe:
        named = pipe.hf_model.named_parameters()
        trained = sum(p.numel() for n, p in named if "lora_" in n)
        spec = ModelSpec.from_config(pipe.hf_model.config)
    work = Workload(64, 1, lora_rank=4, settings=LeanSettings(quantize=quantize))
    assert PricedModel.build(spec, gpu_preset("rtx4090"), work, 64).trainable == trained
