"""Hugging Face integration: ``roundpipe.from_hf`` and ``roundpipe.from_pretrained``
(free functions over the user's model; ``transformers`` is imported lazily)."""

from .families import FAMILIES, Family, own_adapter
from .structure import UnsupportedModel

__all__ = ["FAMILIES", "Family", "UnsupportedModel", "own_adapter"]
