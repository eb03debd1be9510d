"""``RoundPipe.from_hf`` / ``RoundPipe.from_pretrained`` (a mixin of ``RoundPipe``)."""

from __future__ import annotations

from typing import Any

from torch import nn


class FromHuggingFace:
    @classmethod
    def from_hf(cls, model: nn.Module, **options: Any) -> Any:
        """Wrap a Hugging Face ``*ForCausalLM`` (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE,
        GPT-OSS; or a peft model of one):
        its embedding, decoder layers and head become the layers, its own modules; its
        loss is computed exactly (see :mod:`roundpipe.hf.pipe`). ``options`` are those of
        ``RoundPipe(...)``."""
        from .pipe import from_hf

        return from_hf(model, **options)

    @classmethod
    def from_pretrained(cls, path, **options: Any) -> Any:
        """``from_hf`` of the model in a local directory: ``torch_dtype`` (default
        ``torch.bfloat16``), ``lora=peft.LoraConfig(...)`` for adapters, and the options
        of ``RoundPipe(...)``."""
        from .loading import from_pretrained

        return from_pretrained(path, **options)
