"""Vision-language models trained on images and text through ``from_hf``.

The vision tower and the merge of image features into the text run in the first stage
(the model's own code, recorded); each microbatch gets the images its rows' image
tokens stand for. The oracle is the transformers model on the whole batch: loss, every
gradient (the vision tower's too), logits; with LoRA on every linear layer of both
towers, peft on the model.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from support.architectures import architecture  # noqa: E402
from support.hf_families import assert_trains_as_hf  # noqa: E402
from support.image_batches import image_batch  # noqa: E402

import roundpipe  # noqa: E402
from roundpipe import RoundPipeRunConfig  # noqa: E402

WITH_IMAGES = ["qwen2_5_vl", "qwen3_5_vlm", "qwen3_5_moe_vlm", "gemma3_vlm"]
SPLIT = RoundPipeRunConfig(num_microbatch=3)  # rows [0, 1], [2, 3], [4]: images in two


@pytest.mark.parametrize("name", WITH_IMAGES)
def test_images_and_text_train_as_the_transformers_model(name):
    model = architecture(name).build()
    batch = image_batch(model)
    assert_trains_as_hf(model, batch, SPLIT)
    image_path = [p for n, p in model.named_parameters() if "vis" in n or "multi_modal" in n]
    assert any(p.grad is not None and p.grad.any() for p in image_path)  # images reached


@pytest.mark.parametrize("name", WITH_IMAGES)
def test_eval_loss_and_logits_of_a_batch_with_images_are_the_models(name):
    model = architecture(name).build().eval()
    batch = image_batch(model)
    with torch.no_grad():
        out = copy.deepcopy(model)(**batch, use_cache=False)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with roundpipe.from_hf(model, devices="emulated:2", model_run_config=SPLIT) as pipe:
        loss = pipe.eval_loss(batch)
        with torch.no_grad():
            logits = pipe(**inputs)
    torch.testing.assert_close(loss.float(), out.loss, rtol=1e-5, atol=1e-6)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(logits[real], out.logits[real], rtol=1e-5, atol=1e-5)


def test_lora_on_both_towers_trains_with_images_as_peft():
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    config.init_lora_weights = False
    model = peft.get_peft_model(architecture("qwen2_5_vl").build(), config)
    assert any("visual" in n and "lora_" in n for n, _ in model.named_parameters())
    assert_trains_as_hf(model, image_batch(model.get_base_model()), SPLIT)


def test_images_that_do_not_match_the_image_tokens_are_refused():
    model = architecture("qwen2_5_vl").build()
    batch = image_batch(model)
    batch["input_ids"][0, 3] = 5  # one image token fewer
    with (
        roundpipe.from_hf(model, devices="emulated:1") as pipe,
        pytest.raises(
            ValueError, match=r"3 image\(s\) stand for 6 image tokens, but input_ids hold 5"
        ),
    ):
        pipe.forward_backward(input_kwargs=batch)


def test_images_for_a_vlm_whose_images_are_not_cut_yet_are_refused_by_name():
    model = architecture("qwen3_vl").build()
    batch = image_batch(model)
    with (
        roundpipe.from_hf(model, devices="emulated:1") as pipe,
        pytest.raises(
            ValueError, match=r"model_type 'qwen3_vl' trains on text only here: its DeepStack"
        ),
    ):
        pipe.forward_backward(input_kwargs=batch)
