"""Tiny inputs for ``roundpipe train`` tests, built in code: a word-level tokenizer with
a ChatML template, a tiny ``Qwen3ForCausalLM`` directory, and JSONL files in the three
data formats (regular patterns a tiny model learns in a few steps)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
WORDS = [
    "user", "assistant", "system", "count", "from", "to", "next", "is", "the", "after",
    "what", "comes", "say", "hello", "back", "please",
    *[str(n) for n in range(20)],
]  # fmt: skip
MAX_POSITIONS = 64


def build_tokenizer():
    """A word-level fast tokenizer over :data:`WORDS` (``<|im_end|>`` is EOS,
    ``<|endoftext|>`` pads)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
    )


TINY_QWEN3 = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)
"""The sizes of the train tests' Qwen3: hidden 32, 2 layers, 4 heads of 8, 2 KV heads."""


def tiny_qwen3_config(vocab_size: int, **fields):
    """A ``Qwen3Config`` of :data:`TINY_QWEN3` for a vocabulary of ``vocab_size``;
    ``fields`` set other config fields or change a size."""
    import transformers

    return transformers.Qwen3Config(vocab_size=vocab_size, **{**TINY_QWEN3, **fields})


def build_model_dir(directory: Path, seed: int = 0, with_tokenizer: bool = True) -> Path:
    """A randomly initialised fp32 Qwen3 (hidden 32, 2 layers) saved with its tokenizer."""
    import transformers

    tokenizer = build_tokenizer()
    config = tiny_qwen3_config(
        len(tokenizer),
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen3ForCausalLM(config)
    model.save_pretrained(directory)
    if with_tokenizer:
        tokenizer.save_pretrained(directory)
    return Path(directory)


def architecture_dir(name: str, directory: Path) -> Path:
    """The architecture catalogue's tiny ``name`` model with :func:`build_tokenizer`'s
    vocabulary, saved with that tokenizer."""
    from .architectures import architecture

    tokenizer = build_tokenizer()
    model = architecture(name).build()
    model.resize_token_embeddings(len(tokenizer))
    for config in (model.config, model.config.get_text_config()):
        config.pad_token_id = tokenizer.pad_token_id
        config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return Path(directory)


def _counting(rng: random.Random) -> tuple[int, int]:
    start = rng.randrange(0, 10)
    return start, start + rng.randrange(3, 6)


def write_data(path: Path, data_format: str, lines: int = 48, seed: int = 0) -> Path:
    """``lines`` examples of counting (``count from 3 to 6`` → ``3 4 5 6``)."""
    rng = random.Random(seed)
    with open(path, "w") as file:
        for _ in range(lines):
            start, end = _counting(rng)
            question = f"count from {start} to {end}"
            answer = " ".join(str(n) for n in range(start, end + 1))
            if data_format == "text":
                record = {"text": f"{question} {answer}"}
            elif data_format == "prompt_completion":
                record = {"prompt": question, "completion": answer}
            else:
                record = {
                    "messages": [
                        {"role": "user", "content": question},
                        {"role": "assistant", "content": answer},
                    ]
                }
            file.write(json.dumps(record) + "\n")
    return Path(path)
