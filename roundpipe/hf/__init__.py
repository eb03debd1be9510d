"""Hugging Face integration: ``RoundPipe.from_hf`` (imports ``transformers`` lazily)."""

from .families import FAMILIES, Family, family_of

__all__ = ["FAMILIES", "Family", "family_of"]
