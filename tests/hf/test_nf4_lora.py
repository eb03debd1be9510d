"""LoRA over a 4-bit base: ``roundpipe.from_pretrained(path, lora=..., quantize="nf4")``.

Oracle: the same directory loaded by transformers with bitsandbytes' NF4
(``BitsAndBytesConfig``, CPU) and wrapped by peft — the QLoRA recipe users run. The
quantized bytes are the same, and so are the loss, the adapter gradients and the
training steps (fp32 compute, tolerances of float summation order). An adapter trained
over the 4-bit base is an ordinary peft adapter of the unquantized model.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file
from support.children.harness import CHILDREN
from support.nf4_models import (
    adapter_config,
    adapter_grads,
    build_model,
    losses_around_a_checkpoint,
    nf4_bytes_of,
    reference_qlora,
    set_adapters,
)

import roundpipe
from roundpipe import RoundPipeRunConfig
from roundpipe.hf.nf4 import NF4Linear

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from support.children.harness import run_child  # noqa: E402
from support.hf_families import padded_batch, train_both, train_steps  # noqa: E402

TARGETS = ["q_proj", "v_proj", "down_proj"]


def lora_config(**kwargs):
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, **kwargs)


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    """Tiny Llama, Qwen2 (biases) and Qwen3 (tied embeddings) models, saved in fp32."""
    root = tmp_path_factory.mktemp("nf4_models")
    for family in ("llama", "qwen2", "qwen3"):
        build_model(family).save_pretrained(root / family)
    return root


def quantized_pipe(directory, dtype=torch.float32, lora=None, **options):
    options.setdefault("devices", "emulated:2")
    return roundpipe.from_pretrained(
        directory, torch_dtype=dtype, lora=lora or lora_config(), quantize="nf4", **options
    )


def nf4_layers(model) -> dict[str, NF4Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, NF4Linear)}


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_loss_and_adapter_gradients_equal_bitsandbytes_with_peft(saved_models, family):
    bnb = pytest.importorskip("bitsandbytes")
    reference = reference_qlora(saved_models / family, lora_config())
    set_adapters(reference)
    batch = padded_batch()
    want = reference(**batch).loss
    want.backward()
    config = RoundPipeRunConfig(num_microbatch=2)
    with quantized_pipe(saved_models / family, model_run_config=config) as pipe:
        set_adapters(pipe.hf_model)
        layers = nf4_layers(pipe.hf_model)
        loss = pipe.forward_backward(input_kwargs=batch)
        pipe.synchronize()
        grads = adapter_grads(pipe.optim_named_parameters())
    # 7 linears in each of the 3 decoder layers, named as in the peft model of bitsandbytes
    assert len(layers) == 21
    for name, layer in layers.items():
        module = reference.get_submodule(name)
        assert isinstance(module, bnb.nn.Linear4bit), name
        packed, absmax = nf4_bytes_of(module)
        assert torch.equal(layer.packed_weight, packed), name
        assert torch.equal(layer.absmax, absmax), name
    torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-5, atol=1e-6)
    want_grads = adapter_grads(reference.named_parameters())
    assert grads.keys() == want_grads.keys() and len(grads) == 2 * 3 * len(TARGETS)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_training_steps_follow_bitsandbytes_with_peft(saved_models):
    pytest.importorskip("bitsandbytes")
    reference = reference_qlora(saved_models / "llama", lora_config())
    set_adapters(reference)
    batches = [padded_batch(seed=seed) for seed in range(3)]
    with quantized_pipe(saved_models / "llama") as pipe:
        set_adapters(pipe.hf_model)
        train_both(pipe, reference, batches, lr=1e-2)


def test_bf16_loss_is_close_to_bitsandbytes_with_peft(saved_models):
    """In bf16 the two compute with different kernels; the loss agrees to bf16 accuracy."""
    pytest.importorskip("bitsandbytes")
    reference = reference_qlora(saved_models / "qwen3", lora_config(), dtype=torch.bfloat16)
    set_adapters(reference)
    batch = padded_batch()
    with torch.no_grad():
        want = reference(**batch).loss
    with quantized_pipe(saved_models / "qwen3", dtype=torch.bfloat16) as pipe:
        set_adapters(pipe.hf_model)
        loss = pipe.forward_backward(input_kwargs=batch)
    torch.testing.assert_close(loss.detach().float(), want.float(), rtol=2e-2, atol=2e-2)


def test_base_linear_layers_hold_0_5625_host_bytes_a_parameter(saved_models):
    """The decoder layers' linears are NF4 (bytes + fp32 scales); embeddings, norms and
    the head are as without quantizing."""
    dense = transformers.AutoModelForCausalLM.from_pretrained(saved_models / "llama")
    with quantized_pipe(saved_models / "llama", devices="emulated:1") as pipe:
        layers = nf4_layers(pipe.hf_model.get_base_model())
        params = sum(m.in_features * m.out_features for m in layers.values())
        host = sum(p.numel() * p.element_size() for m in layers.values() for p in m.parameters())
        dense_linears = {
            n
            for n, m in dense.named_modules()
            if isinstance(m, torch.nn.Linear) and ".layers." in n
        }
        others = {
            n: p for n, p in pipe.hf_model.get_base_model().named_parameters() if "lora_" not in n
        }
    assert {name.replace(".base_layer", "") for name in layers} == dense_linears
    assert host == 0.5625 * params
    for name, param in dense.named_parameters():
        if name.rpartition(".")[0] not in dense_linears:
            assert torch.equal(others[name], param), name  # kept as they were


def test_an_adapter_trained_over_nf4_loads_with_peft_on_the_unquantized_base(
    saved_models, tmp_path
):
    with quantized_pipe(saved_models / "llama") as pipe:
        train_steps(pipe, steps=2)
        pipe.save_pretrained(tmp_path / "nf4_adapter")
        trained = {
            n: p.detach().clone() for n, p in pipe.hf_model.named_parameters() if "lora_" in n
        }
    with roundpipe.from_pretrained(
        saved_models / "llama", torch_dtype=torch.float32, lora=lora_config(), devices="emulated:1"
    ) as dense_pipe:
        dense_pipe.save_pretrained(tmp_path / "dense_adapter")
    nf4_saved = load_file(tmp_path / "nf4_adapter" / "adapter_model.safetensors")
    dense_saved = load_file(tmp_path / "dense_adapter" / "adapter_model.safetensors")
    assert nf4_saved.keys() == dense_saved.keys()
    assert adapter_config(tmp_path / "nf4_adapter") == adapter_config(tmp_path / "dense_adapter")

    base = transformers.AutoModelForCausalLM.from_pretrained(saved_models / "llama")
    reloaded = peft.PeftModel.from_pretrained(base, tmp_path / "nf4_adapter")
    loaded = {n: p for n, p in reloaded.named_parameters() if "lora_" in n}
    assert loaded.keys() == trained.keys()
    for name, value in trained.items():
        assert torch.equal(loaded[name], value), name
    assert any(bool(value.abs().sum()) for n, value in trained.items() if "lora_B" in n)


def test_all_linear_targets_the_linears_it_targets_without_quantizing(saved_models, tmp_path):
    lora = peft.LoraConfig(r=2, target_modules="all-linear")
    with quantized_pipe(saved_models / "qwen3", lora=lora, devices="emulated:1") as pipe:
        wrapped = {n for n, m in pipe.hf_model.named_modules() if hasattr(m, "lora_A")}
    assert lora.target_modules == "all-linear"  # the caller's config is left as it was
    dense = peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(saved_models / "qwen3"),
        peft.LoraConfig(r=2, target_modules="all-linear"),
    )
    assert wrapped == {n for n, m in dense.named_modules() if hasattr(m, "lora_A")}
    assert len(wrapped) == 21  # every decoder linear, not the head


def test_a_checkpoint_of_a_quantized_run_resumes_it_exactly(saved_models, tmp_path):
    def run(load: bool) -> list[float]:
        def open_pipe():
            return quantized_pipe(saved_models / "llama")

        return losses_around_a_checkpoint(open_pipe, tmp_path / "ckpt", padded_batch, load)

    assert run(load=False) == run(load=True)


def test_merging_an_adapter_into_the_nf4_base_is_refused(saved_models):
    with (
        quantized_pipe(saved_models / "llama", devices="emulated:1") as pipe,
        pytest.raises(NotImplementedError, match="load it onto the unquantized base"),
    ):
        pipe.hf_model.merge_adapter()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"quantize": "int4", "lora": "config"}, ValueError, r"one of \(None, 'nf4'\), got 'int4'"),
        ({"quantize": "nf4"}, ValueError, r"pass lora=peft.LoraConfig"),
        ({"quantize": "nf4", "lora": "ia3"}, TypeError, "must be a peft.LoraConfig, got IA3Config"),
        ({"quantize": "nf4", "lora": "dora"}, ValueError, "use_dora=True needs the dense base"),
        ({"quantize": "nf4", "lora": "pissa"}, ValueError, "init_lora_weights='pissa' needs"),
    ],
)
def test_bad_quantize_arguments_are_refused_before_loading(tmp_path, kwargs, error, match):
    configs = {
        "config": lora_config(),
        "ia3": peft.IA3Config(target_modules=["q_proj"], feedforward_modules=[]),
        "dora": lora_config(use_dora=True),
        "pissa": lora_config(init_lora_weights="pissa"),
    }
    if "lora" in kwargs:
        kwargs = {**kwargs, "lora": configs[kwargs["lora"]]}
    build_model("llama").save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"never read")
    with pytest.raises(error, match=match):
        roundpipe.from_pretrained(tmp_path, devices="emulated:1", **kwargs)


@pytest.mark.slow  # 70 s on 2 busy cores: writing 1.5 GB, quantizing 736 M parameters
def test_loading_a_1_5_gb_checkpoint_quantized_stays_within_its_host_memory_bound(tmp_path):
    """Peak RSS ≤ 1.2 × the quantized model's host bytes + 1 GB (the imports take
    ~0.4 GB): the weights are read and quantized a few MB at a time, never held dense."""
    directory = tmp_path / "checkpoint"
    try:
        generated = run_child([os.path.join(CHILDREN, "hf_load_generate.py"), str(directory)], 120)
        result = run_child([os.path.join(CHILDREN, "nf4_load_measure.py"), str(directory)], 300)
    finally:
        shutil.rmtree(directory, ignore_errors=True)  # 1.5 GB: not left to pytest's tmp dirs
    assert result["nf4_params"] > 0.9 * generated["weight_bytes"] / 2  # most of the model
    assert result["nf4_bytes"] == 0.5625 * result["nf4_params"]
    assert result["quantized_bytes"] < 0.35 * generated["weight_bytes"]
    assert result["loaded_peak_rss"] <= 1.2 * result["quantized_bytes"] + (1 << 30), result
    assert result["loss"] == result["loss"]  # not NaN
