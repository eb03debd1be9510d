"""``RoundPipe.from_pretrained``: a local Hugging Face model directory as an ``HFRoundPipe``."""

from __future__ import annotations

from pathlib import Path

import torch

from .pipe import HFRoundPipe, from_hf


def from_pretrained(path, *, torch_dtype=torch.bfloat16, lora=None, **options) -> HFRoundPipe:
    """A local Hugging Face model directory, loaded with ``transformers`` in
    ``torch_dtype``, optionally wrapped with ``peft`` for ``lora`` (a ``LoraConfig``)."""
    import transformers
    from packaging.version import Version

    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(
            f"{directory} is not a Hugging Face model directory (it has no config.json); "
            "RoundPipe.from_pretrained loads local directories only"
        )
    dtype_kwarg = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, **{dtype_kwarg: torch_dtype}
    )
    if lora is not None:
        import peft

        model = peft.get_peft_model(model, lora)
    return from_hf(model, **options)
