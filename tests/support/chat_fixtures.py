"""For the ``roundpipe chat`` and ``--chat-template`` tests: a base model (its tokenizer
without a chat template), and the oracle answer of ``transformers``' own ``generate``."""

from __future__ import annotations

from pathlib import Path

import torch

from .train_fixtures import build_model_dir, build_tokenizer


def base_model_dir(directory: Path) -> Path:
    """The tiny training model (:func:`build_model_dir`) saved with a tokenizer that has
    no chat template, as a base model's."""
    build_model_dir(directory, with_tokenizer=False)
    tokenizer = build_tokenizer()
    tokenizer.chat_template = None
    tokenizer.save_pretrained(directory)
    return Path(directory)


def greedy_answer(model, tokenizer, messages: list[dict], max_new_tokens: int = 5) -> str:
    """``generate``'s greedy answer to the conversation as the tokenizer's template
    renders it, decoded without special tokens."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        output = model.eval().generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    new = output[0, inputs["input_ids"].shape[1] :]
    return tokenizer.decode(new, skip_special_tokens=True).strip()
