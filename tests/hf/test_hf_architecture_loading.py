"""``roundpipe.from_pretrained`` on every architecture that trains: saved checkpoints.

Each tiny model is saved with ``save_pretrained`` (transformers 5 writes several
families in another layout than its modules hold: experts one per expert, older
names) and loaded back: fully, it gives the loss of the model it was saved from; with
LoRA on every linear layer over an NF4 base, it gives the loss and adapter gradients
of peft over the same model whose decoder linear layers hold their NF4 round trip
(bitsandbytes' format, :mod:`roundpipe.hf.nf4_format`). MoE models whose stacked
experts roundpipe quantizes too (Qwen3-MoE, GPT-OSS) are checked against
bitsandbytes in test_nf4_experts.py. These lists are the README's table.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from peft.tuners.tuners_utils import _maybe_include_all_linear_layers  # noqa: E402
from support.architecture_status import NF4_TESTED, TRAINED  # noqa: E402
from support.architectures import architecture, padded_batch  # noqa: E402
from support.nf4_models import set_adapters  # noqa: E402

import roundpipe  # noqa: E402
from roundpipe import RoundPipeRunConfig  # noqa: E402
from roundpipe.hf.nf4 import NF4Linear  # noqa: E402
from roundpipe.hf.nf4_format import dequantize_nf4, quantize_nf4  # noqa: E402
from roundpipe.hf.structure import decoder_layers_of  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("architectures")

    def save(name: str):
        directory = root / name
        if not directory.exists():
            architecture(name).build().save_pretrained(directory)
        return directory

    return save


@pytest.mark.parametrize("name", TRAINED)
def test_a_saved_checkpoint_loads_back_to_the_same_loss(name, saved):
    model = architecture(name).build()
    batch = padded_batch(side="right")
    want = model(**batch, use_cache=False).loss
    directory = saved(name)
    config = RoundPipeRunConfig(num_microbatch=2)
    with roundpipe.from_pretrained(
        directory, torch_dtype=torch.float32, devices="emulated:2", model_run_config=config
    ) as pipe:
        got = pipe.eval_loss(batch)
    torch.testing.assert_close(got.float(), want.detach(), rtol=1e-5, atol=1e-6)


def nf4_round_trip(model) -> None:
    with torch.no_grad():
        for layer in decoder_layers_of(model):
            for module in layer.modules():
                if type(module) is torch.nn.Linear:
                    packed, absmax = quantize_nf4(module.weight)
                    shape = module.weight.shape
                    module.weight.copy_(dequantize_nf4(packed, absmax, shape, torch.float32))


@pytest.mark.parametrize("name", NF4_TESTED)
def test_lora_over_an_nf4_base_equals_peft_over_the_rounded_base(name, saved):
    model = architecture(name).build()
    every_linear = peft.LoraConfig(target_modules="all-linear")
    names = sorted(_maybe_include_all_linear_layers(every_linear, model).target_modules)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=names)
    nf4_round_trip(model)
    reference = peft.get_peft_model(model, copy.deepcopy(lora))
    set_adapters(reference)
    batch = padded_batch(side="right")
    want = reference(**batch, use_cache=False).loss
    want.backward()
    config = RoundPipeRunConfig(num_microbatch=3)
    with roundpipe.from_pretrained(
        saved(name),
        torch_dtype=torch.float32,
        lora=lora,
        quantize="nf4",
        devices="emulated:2",
        model_run_config=config,
    ) as pipe:
        set_adapters(pipe.hf_model)
        assert any(isinstance(m, NF4Linear) for m in pipe.hf_model.modules())
        loss = pipe.forward_backward(input_kwargs=batch)
        pipe.synchronize()
        grads = {n: p.grad for n, p in pipe.optim_named_parameters() if "lora_" in n}
    torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-5, atol=1e-6)
    expected = {n: p.grad for n, p in reference.named_parameters() if "lora_" in n}
    assert grads.keys() == expected.keys()
    for key, grad in expected.items():
        if grad is None:
            assert grads[key] is None or not grads[key].any(), key
            continue
        scale = float(grad.abs().max()) + 1e-6
        torch.testing.assert_close(grads[key], grad, rtol=1e-4, atol=1e-4 * scale)
