"""The images of vision chat data (TRL's format: ``messages`` whose content holds
``{"type": "image"}`` parts, and an ``images`` column with one image per part, in order):
opened, measured and turned into the model's image inputs as its processor would.

The chat template renders each image part as the model's image token; the processor
then stands every image for as many image tokens as its patch grid merges into
(``t*h*w / spatial_merge_size**2``). :class:`ImageReader` does that expansion on the
token ids the chat labels were computed on, so labels stay where the template put the
assistant turns and the image tokens carry none; the pixels are computed again when a
batch is built, so host memory holds the images' references, not their patches
(docs/design.md#images). Qwen-VL layouts (Qwen2.5-VL, Qwen3.5) are read here; a VLM
whose processor expands its image marker into other tokens (Gemma 3) takes images
through the Python API.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from ..hf.decoder import IGNORE_INDEX
from ..hf.images import ImageLayout, image_layout, images_refusal

Grid = tuple[int, int, int]


class ImageReader:
    """The image processor and image layout of the model in ``directory`` (its config
    ``config``), loaded when the first record with images asks for them."""

    def __init__(self, directory: Path, config: Any):
        self.directory = Path(directory)
        self.config = config
        self._layout: ImageLayout | None = None
        self._processor: Any = None

    @property
    def layout(self) -> ImageLayout:
        """The model's image layout; a ``ValueError`` saying why if images cannot train it."""
        if self._layout is None:
            stand_in = SimpleNamespace(config=self.config)
            layout = image_layout(stand_in)
            model_type = getattr(self.config, "model_type", "?")
            if layout is None:
                reason = images_refusal(stand_in) or (
                    f"model_type {model_type!r} is a text model (no vision tower)"
                )
                raise ValueError(f"the data has images, but {reason}")
            if layout.tokens_per_image is not None:
                raise ValueError(
                    f"the data has images, but roundpipe train reads images for Qwen-VL "
                    f"layouts (Qwen2.5-VL, Qwen3.5) only so far; {model_type!r} takes images "
                    "through the Python API (the processor's input_ids with pixel_values)"
                )
            self._layout = layout
        return self._layout

    @property
    def processor(self) -> Any:
        if self._processor is None:
            import transformers

            try:
                self._processor = transformers.AutoImageProcessor.from_pretrained(self.directory)
            except (OSError, ValueError, KeyError, TypeError) as error:
                raise ValueError(
                    f"the data has images, but the model's image processor cannot be loaded "
                    f"from {self.directory} (preprocessor_config.json): {error}"
                ) from error
        return self._processor

    def expand(
        self, ids: list[int], labels: list[int], images: list[Any]
    ) -> tuple[list[int], list[int], tuple[Grid, ...]]:
        """``(ids, labels, grids)``: each image token of ``ids`` (one per image of
        ``images``, resolved by :func:`resolve_image`, as the chat template renders an
        image part) stood for by its image's tokens, unlabelled."""
        token = self.layout.image_token_id
        found = sum(1 for i in ids if i == token)
        if found != len(images):
            raise ValueError(
                f"the chat template rendered {found} image token(s) (id {token}) for "
                f"{len(images)} image(s); it must render each image part as the model's "
                "image token"
            )
        grids = tuple(self._grid(open_image(image, None)) for image in images)
        out_ids: list[int] = []
        out_labels: list[int] = []
        image = 0
        for i, label in zip(ids, labels, strict=True):
            if i != token:
                out_ids.append(i)
                out_labels.append(label)
                continue
            count = self.layout.grid_tokens(math.prod(grids[image]))
            out_ids += [token] * count
            out_labels += [IGNORE_INDEX] * count
            image += 1
        return out_ids, out_labels, grids

    def inputs(
        self, input_ids: torch.Tensor, images: list[Any], grids: list[Grid]
    ) -> dict[str, torch.Tensor]:
        """The image inputs of a batch whose rows hold ``images`` (in row order), measured
        at tokenization as ``grids``."""
        pixels = self.processor(images=[open_image(image, None) for image in images],
                                return_tensors="pt")  # fmt: skip
        computed = [tuple(int(n) for n in grid) for grid in pixels["image_grid_thw"]]
        if computed != list(grids):
            raise RuntimeError(
                f"the image processor measured {computed} now and {list(grids)} when the "
                "data was read; the images changed during the run"
            )
        return {
            "pixel_values": pixels["pixel_values"],
            "image_grid_thw": pixels["image_grid_thw"],
            "mm_token_type_ids": (input_ids == self.layout.image_token_id).int(),
        }

    def _grid(self, image: Any) -> Grid:
        grid = self.processor(images=[image], return_tensors="pt")["image_grid_thw"][0]
        return tuple(int(n) for n in grid)  # type: ignore[return-value]


def resolve_image(image: Any, base: Path | None) -> Any:
    """An ``images`` entry as the batches keep it: a path made absolute against ``base``
    (the data file's folder), a ``{"bytes"}`` or ``{"path"}`` table cell as bytes or a
    path, a PIL image as is; anything else is refused."""
    if isinstance(image, dict):
        if image.get("bytes") is not None:
            return bytes(image["bytes"])
        image = image.get("path")
    if isinstance(image, str | Path):
        path = Path(image).expanduser()
        if not path.is_absolute() and base is not None:
            path = base / path
        if not path.is_file():
            raise ValueError(f"image {str(image)!r}: no such file ({path})")
        return str(path)
    if isinstance(image, bytes) or _is_pil(image):
        return image
    raise ValueError(
        f"an image must be a path, a {{'bytes': ...}} or {{'path': ...}} object, or a PIL "
        f"image, got {type(image).__name__}"
    )


def open_image(image: Any, base: Path | None) -> Any:
    """A resolved (or raw) ``images`` entry as an RGB PIL image."""
    from PIL import Image, UnidentifiedImageError

    image = resolve_image(image, base)
    if _is_pil(image):
        return image.convert("RGB")
    try:
        opened = Image.open(io.BytesIO(image) if isinstance(image, bytes) else image)
        return opened.convert("RGB")
    except (OSError, UnidentifiedImageError) as error:
        what = "image bytes" if isinstance(image, bytes) else f"image {image}"
        raise ValueError(f"{what} cannot be read: {error}") from error


def _is_pil(image: Any) -> bool:
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - transformers' image processors need it
        return False
    return isinstance(image, Image.Image)
