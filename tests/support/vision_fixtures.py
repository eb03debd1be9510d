"""A tiny Qwen3.5 VLM directory and vision chat data in TRL's format, built in code: the
train fixtures' word-level tokenizer with Qwen's vision tokens and a ChatML template
that renders image parts, the image processor saved beside the model, and JSONL whose
``images`` column names PNG files written next to it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from support.train_fixtures import build_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
VISION_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for part in m.content %}"
    "{% if part.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ part.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MERGE = 2  # the vision tower's spatial_merge_size: 2 x 2 patches make an image token
SIDES = [(56, 56), (28, 56), (56, 84), (84, 28)]  # 4, 2, 6 and 3 image tokens


def vision_tokenizer():
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *VISION_TOKENS]})
    tokenizer.chat_template = VISION_TEMPLATE
    return tokenizer


def image_processor():
    import transformers

    return transformers.Qwen2VLImageProcessorPil(
        patch_size=14,
        temporal_patch_size=2,
        merge_size=MERGE,
        min_pixels=28 * 28,
        max_pixels=84 * 84,
    )


def vision_model_dir(directory: Path, seed: int = 0) -> Path:
    """The architecture catalogue's tiny Qwen3.5 VLM, its config pointed at the
    tokenizer's vision tokens, saved with tokenizer and image processor."""
    from support.architectures import architecture

    tokenizer = vision_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = architecture("qwen3_5_vlm").build()
    model.resize_token_embeddings(len(tokenizer))
    ids = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    config = model.config
    config.vision_start_token_id, config.image_token_id = ids[0], ids[1]
    config.vision_end_token_id, config.video_token_id = ids[2], ids[3]
    for each in (config, config.get_text_config()):
        each.pad_token_id = tokenizer.pad_token_id
        each.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    image_processor().save_pretrained(directory)
    return Path(directory)


def write_vision_data(path: Path, records: int = 6, seed: int = 0) -> Path:
    """``records`` conversations in TRL's vision format: a user turn with zero, one or
    two images and a question, an assistant answer; the PNGs lie in ``path``'s folder,
    named relative to it."""
    from PIL import Image

    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    with open(path, "w") as file:
        for n in range(records):
            images = []
            for k in range(n % 3):
                width, height = SIDES[(n + k) % len(SIDES)]
                pixels = torch.randint(0, 256, (height, width, 3), generator=generator)
                name = f"image-{n}-{k}.png"
                Image.fromarray(pixels.to(torch.uint8).numpy()).save(path.parent / name)
                images.append(name)
            start = rng.randrange(0, 10)
            parts = [{"type": "image"} for _ in images]
            parts.append({"type": "text", "text": f"count from {start} to {start + 3}"})
            answer = " ".join(str(i) for i in range(start, start + 4))
            messages = [
                {"role": "user", "content": parts},
                {"role": "assistant", "content": [{"type": "text", "text": answer}]},
            ]
            file.write(json.dumps({"messages": messages, "images": images}) + "\n")
    return path
