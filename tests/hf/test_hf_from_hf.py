"""``roundpipe.from_hf`` against the Hugging Face model itself (fp32, tiny configs).

The oracle is ``model(**batch).loss`` and its gradients for the whole batch: the mean
over every label token, whatever the microbatch split, the padding side or the device
count; inference returns the model's logits; parameters keep the model's names.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from support import architectures  # noqa: E402
from support.architectures import hf_loss_and_grads  # noqa: E402
from support.hf_families import (  # noqa: E402
    VOCAB,
    assert_trains_as_hf,
    build,
    padded_batch,
    train_both,
)

import roundpipe  # noqa: E402
from roundpipe import RoundPipeRunConfig  # noqa: E402

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gpt_oss"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("devices", "microbatches", "side"), [(1, 2, "right"), (3, 3, "left")])
def test_loss_and_gradients_equal_the_hugging_face_model(family, devices, microbatches, side):
    model = build(family)
    batch = padded_batch(side=side)
    want, want_grads = hf_loss_and_grads(model, batch)
    config = RoundPipeRunConfig(num_microbatch=microbatches)  # 5 rows do not divide evenly
    with roundpipe.from_hf(model, devices=f"emulated:{devices}", model_run_config=config) as pipe:
        loss = pipe.forward_backward(input_kwargs=batch)
        pipe.synchronize()
    torch.testing.assert_close(loss.detach(), want, rtol=1e-5, atol=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, want_grads[name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_inference_returns_the_models_logits(family):
    model = build(family)
    batch = padded_batch(side="left")
    del batch["labels"]
    with torch.no_grad():
        want = model(**batch).logits
    with (
        roundpipe.from_hf(model, devices="emulated:2") as pipe,
        torch.no_grad(),
    ):
        got = pipe(**batch)
    valid = batch["attention_mask"].bool()
    torch.testing.assert_close(got[valid], want[valid], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [5, 2])  # 2 rows: fewer than the 3 microbatches
def test_eval_loss_is_the_models_loss_without_gradients(rows):
    model = build("qwen3")
    batch = {k: v[:rows] for k, v in padded_batch(side="left").items()}
    with torch.no_grad():
        want = model(**batch).loss
    with roundpipe.from_hf(model, devices="emulated:2") as pipe:
        pipe.model[-1].chunk_tokens = 7
        got = pipe.eval_loss(batch)
        pipe.synchronize()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert all(p.grad is None for p in model.parameters())


def test_parameters_keep_the_models_names_and_train_in_place():
    model = build("llama")
    reference = copy.deepcopy(model)
    batches = [padded_batch(seed=s) for s in range(3)]
    with roundpipe.from_hf(model, devices="emulated:2") as pipe:
        names = [name for name, _ in pipe.optim_named_parameters()]
        assert names == [name for name, _ in model.named_parameters()]
        train_both(pipe, reference, batches, lr=1e-2)
        pipe.synchronize()
    for (name, param), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param.detach(), ref.detach(), rtol=1e-4, atol=1e-5, msg=name)


def test_the_loss_is_computed_in_chunks_of_tokens():
    from roundpipe.hf.decoder import HeadLayer

    model = build("llama")
    batch = padded_batch()
    want, _ = hf_loss_and_grads(model, batch)
    with roundpipe.from_hf(model, devices="emulated:1") as pipe:
        head = pipe.model[-1]
        assert isinstance(head, HeadLayer)
        head.chunk_tokens = 7  # 45 shifted tokens: seven chunks, the last one short
        loss = pipe.forward_backward(input_kwargs=batch)
    torch.testing.assert_close(loss.detach(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda b: b.pop("input_ids"), "input_ids must be"),
        (lambda b: b.update(labels=b["labels"][:, :-1]), "labels must have the shape"),
        (lambda b: b.update(attention_mask=b["attention_mask"] * 2), "only 0 and 1"),
        (lambda b: b.update(labels=torch.full_like(b["labels"], -100)), "no label token"),
        (lambda b: b.pop("labels"), "training needs labels"),
        (lambda b: b.update(input_ids=torch.zeros(1, 65, dtype=torch.long)), "exceeds"),
    ],
)
def test_bad_batches_are_refused_before_any_work(change, message):
    batch = padded_batch()
    change(batch)
    with (
        roundpipe.from_hf(build("llama"), devices="emulated:1") as pipe,
        pytest.raises(ValueError, match=message),
    ):
        pipe.forward_backward(input_kwargs=batch)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("microbatches", [1, 2])
def test_the_router_auxiliary_loss_is_weighted_by_label_tokens(family, microbatches):
    """The oracle: each microbatch's own HF loss (token mean + coef × its router loss),
    weighted by the microbatch's share of the batch's label tokens."""
    model = build(family)
    model.config.output_router_logits = True
    model.router_aux_loss_coef = 0.5  # large enough to matter
    if family == "qwen3_moe":
        model.config.mlp_only_layers = [1]  # dense layers route nothing
    batch = padded_batch(rows=4, side="right")
    reference = copy.deepcopy(model)
    counts = [(batch["labels"][rows, 1:] != -100).sum() for rows in (slice(0, 2), slice(2, 4))]
    pieces = [slice(0, 4)] if microbatches == 1 else [slice(0, 2), slice(2, 4)]
    want = 0
    for rows in pieces:
        count = (batch["labels"][rows, 1:] != -100).sum()
        want = want + reference(**{k: v[rows] for k, v in batch.items()}).loss * count / sum(counts)
    want.backward()
    config = RoundPipeRunConfig(num_microbatch=microbatches)
    roundpipe.from_hf(model, devices="emulated:1").close()  # wrapping twice hooks once
    with roundpipe.from_hf(model, devices="emulated:2", model_run_config=config) as pipe:
        loss = pipe.forward_backward(input_kwargs=batch)
        pipe.synchronize()
    torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-5, atol=1e-6)
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    assert routers and all(len(m._forward_hooks) == 1 for m in routers)
    for (name, param), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param.grad, ref.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_an_encoder_decoder_model_is_refused_by_its_model_type():
    config = transformers.T5Config(d_model=32, num_layers=1, num_heads=2, d_kv=16, d_ff=64)
    with pytest.raises(ValueError, match=r"model_type 't5' is an encoder-decoder model"):
        roundpipe.from_hf(transformers.T5ForConditionalGeneration(config), devices="emulated:1")


@pytest.mark.parametrize("kind", ["target_modules", "modules_to_save"])
@pytest.mark.parametrize("family", ["llama", "gemma3_text"])  # our adapter; the general path
def test_an_adapter_on_lm_head_is_refused_not_silently_left_untrained(kind, family):
    peft = pytest.importorskip("peft")
    base = build(family) if family == "llama" else architectures.architecture(family).build()
    targets = {"target_modules": ["q_proj", "lm_head"]} if kind == "target_modules" else {
        "target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}  # fmt: skip
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, **targets))
    with pytest.raises(ValueError, match=r"on the output layer \(lm_head\) is not supported"):
        roundpipe.from_hf(model, devices="emulated:1")


def test_save_pretrained_writes_what_transformers_loads(tmp_path):
    model = build("qwen3")
    batch = padded_batch()
    with roundpipe.from_hf(model, devices="emulated:2") as pipe:
        optimizer = torch.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
        pipe.forward_backward(input_kwargs=batch)
        pipe.step(lambda: (optimizer.step(), optimizer.zero_grad()))  # async: saving waits
        pipe.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    del batch["labels"]
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, model(**batch).logits)


def lora(model):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    torch.manual_seed(1)
    wrapped = peft.get_peft_model(model, config)
    for name, param in wrapped.named_parameters():  # lora_B starts at zero: make it count
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    return wrapped


def test_lora_trains_like_peft_and_saves_an_adapter_peft_loads(tmp_path):
    peft = pytest.importorskip("peft")
    model = lora(build("llama"))
    reference = copy.deepcopy(model)
    batches = [padded_batch(seed=s, side="left") for s in range(3)]
    with roundpipe.from_hf(model, devices="emulated:2") as pipe:
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        assert [n for n, _ in pipe.optim_named_parameters()] == trainable  # no base masters
        train_both(pipe, reference, batches)
        pipe.save_pretrained(tmp_path)
    for (name, param), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param.detach(), ref.detach(), rtol=1e-4, atol=1e-6, msg=name)
    fresh = peft.PeftModel.from_pretrained(build("llama"), tmp_path)
    batch = padded_batch(seed=9)
    del batch["labels"]
    with torch.no_grad():
        torch.testing.assert_close(fresh(**batch).logits, model(**batch).logits)


def test_from_pretrained_loads_a_local_directory_with_or_without_lora(tmp_path):
    peft = pytest.importorskip("peft")
    model = build("qwen2")
    model.save_pretrained(tmp_path)
    batch = padded_batch()
    want, _ = hf_loss_and_grads(model, batch)
    with roundpipe.from_pretrained(
        tmp_path, torch_dtype=torch.float32, devices="emulated:2"
    ) as pipe:
        torch.testing.assert_close(pipe.forward_backward(input_kwargs=batch).detach(), want)
    config = peft.LoraConfig(r=2, target_modules=["q_proj"])
    with roundpipe.from_pretrained(
        tmp_path, torch_dtype=torch.float32, lora=config, devices="emulated:2"
    ) as pipe:
        names = [name for name, _ in pipe.optim_named_parameters()]
        assert names and all("lora_" in name for name in names)
        # lora_B starts at zero: the adapted model computes the base model's loss
        torch.testing.assert_close(pipe.forward_backward(input_kwargs=batch).detach(), want)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        roundpipe.from_pretrained(tmp_path / "missing", devices="emulated:1")


def test_a_bf16_model_with_fp32_masters_trains_like_fp32():
    model = build("llama")
    reference = copy.deepcopy(model)
    batches = [padded_batch(seed=s) for s in range(3)]
    with roundpipe.from_hf(model.to(torch.bfloat16), devices="emulated:2") as pipe:
        assert all(p.dtype == torch.float32 for p in pipe.optim_parameters())
        train_both(pipe, reference, batches, rtol=2e-2, atol=0)


def test_a_checkpoint_restores_a_hugging_face_run(tmp_path):
    batches = [padded_batch(seed=s) for s in range(3)]
    with roundpipe.from_hf(build("qwen3"), devices="emulated:2") as pipe:
        optimizer = torch.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
        pipe.forward_backward(input_kwargs=batches[0])
        pipe.step(lambda: (optimizer.step(), optimizer.zero_grad()))
        pipe.save_checkpoint(tmp_path / "c", optimizer, extra={"next": 1})
        want = [float(pipe.forward_backward(input_kwargs=b)) for b in batches[1:]]
    torch.manual_seed(5)
    fresh = transformers.Qwen3ForCausalLM(build("qwen3").config)  # other weights
    with roundpipe.from_hf(fresh, devices="emulated:2") as pipe:
        optimizer = torch.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
        assert pipe.load_checkpoint(tmp_path / "c", optimizer) == {"next": 1}
        got = [float(pipe.forward_backward(input_kwargs=b)) for b in batches[1:]]
    assert got == want


def test_a_lora_checkpoint_holds_the_adapters_not_the_base(tmp_path):
    pytest.importorskip("peft")
    from safetensors import safe_open

    batches = [padded_batch(seed=s) for s in range(3)]
    with roundpipe.from_hf(lora(build("llama")), devices="emulated:2") as pipe:
        optimizer = torch.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
        pipe.forward_backward(input_kwargs=batches[0])
        pipe.step(lambda: (optimizer.step(), optimizer.zero_grad()))
        pipe.save_checkpoint(tmp_path / "c", optimizer)
        want = [float(pipe.forward_backward(input_kwargs=b)) for b in batches[1:]]
    with safe_open(tmp_path / "c" / "weights.safetensors", "pt") as file:
        saved = {key.split("/")[0] for key in file.keys() if "lora_" not in key}  # noqa: SIM118
    assert saved == {"frozen", "buffer"}  # the base weights are only fingerprinted
    with roundpipe.from_hf(lora(build("llama")), devices="emulated:2") as pipe:
        optimizer = torch.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
        pipe.load_checkpoint(tmp_path / "c", optimizer)
        got = [float(pipe.forward_backward(input_kwargs=b)) for b in batches[1:]]
    assert got == want
    torch.manual_seed(5)
    other_base = lora(transformers.LlamaForCausalLM(build("llama").config))
    pipe = roundpipe.from_hf(other_base, devices="emulated:1")
    with pipe, pytest.raises(ValueError, match="frozen parameter"):
        pipe.load_checkpoint(tmp_path / "c")


def test_an_fp16_model_trains_with_a_grad_scaler():
    model = build("llama")
    reference = copy.deepcopy(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    batches = [padded_batch(seed=s) for s in range(3)]
    with roundpipe.from_hf(model.half(), devices="emulated:2", grad_scaler=scaler) as pipe:
        train_both(pipe, reference, batches, rtol=2e-2, atol=0, scaler=scaler)
    assert scaler.get_scale() == 2.0**10  # no overflow: every step was taken


def test_the_head_never_holds_the_logits_of_more_than_one_chunk(monkeypatch):
    """Full fp32 logits over sequence × vocabulary are never materialised: every LM-head
    matmul of the loss, forward or recompute, covers at most one chunk of tokens."""
    from roundpipe.hf import decoder

    rows: list[int] = []
    linear = decoder.F.linear

    def recording_linear(x, weight, bias=None):
        if weight.shape[0] == VOCAB and x.dim() == 2:  # the head: flattened tokens
            rows.append(x.shape[0])
        return linear(x, weight, bias)

    monkeypatch.setattr(decoder.F, "linear", recording_linear)
    model = build("llama")
    batch = padded_batch(rows=4, length=16)  # 60 shifted tokens
    want, _ = hf_loss_and_grads(model, batch)
    with roundpipe.from_hf(model, devices="emulated:1") as pipe:
        pipe.model[-1].chunk_tokens = 8
        loss = pipe.forward_backward(input_kwargs=batch)
    torch.testing.assert_close(loss.detach(), want, rtol=1e-5, atol=1e-6)
    assert rows and max(rows) <= 8
    assert len(rows) >= 2 * (60 // 8)  # each chunk computed, then recomputed in backward


@pytest.mark.parametrize("devices", [1, 2])
def test_lora_on_every_linear_of_a_moe_model_trains_as_peft(devices):
    """peft wraps the MoE router's bare ``weight`` with a parametrization while it runs;
    the layer shell must be the same for the next microbatch (it crashed on the second)."""
    peft = pytest.importorskip("peft")
    model = build("qwen3_moe")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    wrapped = peft.get_peft_model(model, config)
    assert any(type(m).__name__ == "ParamWrapper" for m in wrapped.modules())  # the router
    run_config = RoundPipeRunConfig(num_microbatch=3)
    assert_trains_as_hf(wrapped, padded_batch(side="right"), run_config, f"emulated:{devices}")
