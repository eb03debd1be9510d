"""Hugging Face integration: ``roundpipe.from_hf`` and ``roundpipe.from_pretrained``
(free functions over the user's model; ``transformers`` is imported lazily)."""

from .families import FAMILIES, Family, family_of

__all__ = ["FAMILIES", "Family", "family_of"]
