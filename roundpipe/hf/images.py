"""Images in a vision-language model's batch, cut into microbatches with their rows.

A VLM takes its images beside ``input_ids``: Qwen-VL models (Qwen2.5-VL, Qwen3.5) as
``pixel_values`` of every image's patches one after another with ``image_grid_thw``
(``t x h x w`` patches an image) and ``mm_token_type_ids``; Gemma 3 as one
``pixel_values`` entry per image with ``token_type_ids``. Each image stands in the text
as image tokens (Qwen: its patches over ``spatial_merge_size**2``; Gemma 3:
``mm_tokens_per_image``), rows in order. :func:`split_with_images` cuts the rows as the
runtime cuts any batch and gives each microbatch the images its rows' image tokens
stand for; the prologue runs the vision tower and the model's own merge of the image
features into the text (docs/design.md#images).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QWEN_GRID = ("qwen2_5_vl", "qwen3_5", "qwen3_5_moe")
FIXED_TOKENS = ("gemma3",)
NOT_YET = {
    "qwen3_vl": "its DeepStack adds vision features to the hidden states inside the "
    "decoder's first layers, which the general path cannot replay yet",
    "qwen3_vl_moe": "its DeepStack adds vision features to the hidden states inside the "
    "decoder's first layers, which the general path cannot replay yet",
}
"""VLMs whose images are refused (they train on text), and why."""
ROW_INPUTS = ("input_ids", "attention_mask", "position_ids", "labels", "mm_token_type_ids",
              "token_type_ids")  # fmt: skip
"""Inputs with one entry a row (cut as the rows are)."""


@dataclass(frozen=True)
class ImageLayout:
    """How a model's images stand in its batch."""

    model_type: str
    image_token_id: int
    merge: int = 1
    """Qwen-VL: patches merged into one image token (``spatial_merge_size ** 2``)."""
    tokens_per_image: int | None = None
    """Gemma 3: image tokens an image stands for (``mm_tokens_per_image``)."""

    @property
    def inputs(self) -> tuple[str, ...]:
        """The image inputs the model takes beside its text inputs."""
        if self.tokens_per_image is None:
            return ("pixel_values", "image_grid_thw", "mm_token_type_ids")
        return ("pixel_values", "token_type_ids")

    def grid_tokens(self, patches: int) -> int:
        """Qwen-VL: the image tokens an image of ``patches`` patches (``t*h*w``) stands for."""
        return patches // self.merge

    def image_sizes(self, batch: dict) -> tuple[list[int], list[int]]:
        """Per image: the image tokens it stands for, and its entries in ``pixel_values``."""
        if self.tokens_per_image is None:
            patches = [int(n) for n in batch["image_grid_thw"].prod(dim=-1)]
            return [self.grid_tokens(n) for n in patches], patches
        count = batch["pixel_values"].shape[0]
        return [self.tokens_per_image] * count, [1] * count


def image_layout(causal_lm) -> ImageLayout | None:
    """The :class:`ImageLayout` of ``causal_lm``, or ``None`` (a text model, or a VLM
    whose images roundpipe does not cut into microbatches yet)."""
    config = causal_lm.config
    token = getattr(config, "image_token_id", None)
    if token is None:
        token = getattr(config, "image_token_index", None)
    if token is None or getattr(config, "vision_config", None) is None:
        return None
    if config.model_type in QWEN_GRID:
        merge = config.vision_config.spatial_merge_size
        return ImageLayout(config.model_type, int(token), merge=merge * merge)
    if config.model_type in FIXED_TOKENS:
        return ImageLayout(
            config.model_type, int(token), tokens_per_image=config.mm_tokens_per_image
        )
    return None


def images_refusal(causal_lm) -> str | None:
    """Why a batch with images cannot train ``causal_lm``, a VLM without an
    :class:`ImageLayout` (``None`` for a text model: images are unknown inputs there)."""
    config = causal_lm.config
    if getattr(config, "vision_config", None) is None:
        return None
    reason = NOT_YET.get(config.model_type)
    if reason is None:
        reason = "roundpipe does not cut its image inputs into microbatches yet"
    return f"model_type {config.model_type!r} trains on text only here: {reason}"


def check_images(layout: ImageLayout, batch: dict) -> None:
    """Refuse images that do not match the image tokens of the text, naming the counts."""
    if "pixel_values" not in batch:
        return
    tokens, entries = layout.image_sizes(batch)
    found = int((batch["input_ids"] == layout.image_token_id).sum())
    if found != sum(tokens):
        raise ValueError(
            f"the batch's {len(tokens)} image(s) stand for {sum(tokens)} image tokens, but "
            f"input_ids hold {found} (image token id {layout.image_token_id}); pass the "
            "processor's input_ids with the images they were made with"
        )
    if batch["pixel_values"].shape[0] != sum(entries):
        raise ValueError(
            f"pixel_values has {batch['pixel_values'].shape[0]} entries along dim 0; the "
            f"images' sizes call for {sum(entries)}"
        )


def split_with_images(layout: ImageLayout):
    """A ``split_input`` for :class:`~roundpipe.RoundPipeRunConfig`: rows cut as
    ``torch.tensor_split`` cuts them, each microbatch with the images of its rows."""

    def split(args: tuple, kwargs: dict, num: int) -> list[tuple[tuple, dict]]:
        rows = kwargs["input_ids"].shape[0]
        if rows < num:
            raise ValueError(f"the batch has {rows} rows, fewer than its {num} microbatches")
        tokens, entries = layout.image_sizes(kwargs)
        per_row = (kwargs["input_ids"] == layout.image_token_id).sum(dim=1).tolist()
        first_image = _first_image_of_each_row(per_row, tokens)
        pieces = []
        for part in torch.tensor_split(torch.arange(rows), num):
            start, stop = int(part[0]), int(part[-1]) + 1
            piece = {
                k: v[start:stop] if k in ROW_INPUTS else v
                for k, v in kwargs.items()
                if k not in ("pixel_values", "image_grid_thw")
            }
            a, b = first_image[start], first_image[stop]
            if b > a:
                offset = sum(entries[:a])
                piece["pixel_values"] = kwargs["pixel_values"][offset : offset + sum(entries[a:b])]
                if "image_grid_thw" in kwargs:
                    piece["image_grid_thw"] = kwargs["image_grid_thw"][a:b]
            pieces.append((args, piece))
        return pieces

    return split


def _first_image_of_each_row(per_row: list[int], tokens: list[int]) -> list[int]:
    """``first[r]``: the index of row ``r``'s first image (``first[rows]``: the count),
    the images taken in order, each row's image tokens made of whole images."""
    first, image = [], 0
    for row, count in enumerate(per_row):
        first.append(image)
        while count > 0 and image < len(tokens):
            count -= tokens[image]
            image += 1
        if count != 0:
            raise ValueError(
                f"row {row}'s image tokens are not whole images in order (the images stand "
                f"for {tokens} tokens each)"
            )
    first.append(image)
    return first
