"""A model directory whose config.json describes a large model and whose weights file is
empty: what ``roundpipe train`` checks before loading a model is all there, the weights
are not (a check that read them would fail on the empty file)."""

from __future__ import annotations

from pathlib import Path

from support.train_fixtures import build_tokenizer


def big_model_dir(directory: Path) -> Path:
    """A Qwen3 of about 1.7 B parameters (7 GB in fp32; about 1 GB of it in NF4): its
    config, the tiny tokenizer and an empty ``model.safetensors``."""
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    config = transformers.Qwen3Config(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    config.save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)
    (directory / "model.safetensors").write_bytes(b"")
    return directory
