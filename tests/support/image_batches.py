"""Batches with images for the catalogue's tiny vision-language models.

Token ids 119-121 stand for image and vision tokens (the tiny vocabulary has 128), set
in the model's config as the processor's would be; rows 0 and 3 hold images (row 3
two of them), rows 1 and 4 are right-padded, image tokens carry no label.
"""

from __future__ import annotations

import torch

IMAGE_TOKEN = 120


def image_batch(model, seed: int = 0) -> dict:
    """A batch with three images for ``model`` (a Qwen-VL or Gemma 3 catalogue model,
    whose config this points at the image token ids used here)."""
    config = model.config
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 110, (5, 14), generator=generator)
    if config.model_type == "gemma3":
        config.image_token_id = config.image_token_index = IMAGE_TOKEN
        per_image = config.mm_tokens_per_image
        ids[0, 2 : 2 + per_image] = IMAGE_TOKEN
        ids[3, 1 : 1 + per_image] = IMAGE_TOKEN
        ids[3, 7 : 7 + per_image] = IMAGE_TOKEN
        vision = config.vision_config
        pixels = torch.randn(3, vision.num_channels, vision.image_size, vision.image_size,
                             generator=generator)  # fmt: skip
        extra = {"pixel_values": pixels, "token_type_ids": (ids == IMAGE_TOKEN).long()}
    else:  # Qwen-VL: patches of every image in a row, a (t, h, w) grid each
        config.image_token_id, config.vision_start_token_id, config.video_token_id = 120, 119, 121
        grid = torch.tensor([(1, 4, 4), (1, 2, 2), (1, 2, 2)])  # 4, 1 and 1 image tokens
        ids[0, 2], ids[0, 3:7] = 119, IMAGE_TOKEN
        ids[3, 1], ids[3, 2], ids[3, 5], ids[3, 6] = 119, IMAGE_TOKEN, 119, IMAGE_TOKEN
        vision = config.vision_config
        width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        pixels = torch.randn(int(grid.prod(-1).sum()), width, generator=generator)
        extra = {
            "pixel_values": pixels,
            "image_grid_thw": grid,
            "mm_token_type_ids": (ids == IMAGE_TOKEN).int(),
        }
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    mask[4, 6:] = 0
    labels = ids.masked_fill((mask == 0) | (ids >= 119), -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, **extra}
