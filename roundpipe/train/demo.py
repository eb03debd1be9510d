"""The assets of ``roundpipe train --demo``: a tiny Qwen3 model, its tokenizer, a chat dataset.

``prepare_demo(workdir)`` writes ``workdir/base-model`` reproducibly (reused when an
earlier run wrote the same); ``DEMO_OPTIONS`` train for about a minute on two CPU
cores; ``sample_generations`` and ``format_samples`` show held-out answers before and
after training (docs/design.md#demo).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

import torch

DATA_DIR = Path(__file__).parent / "demo_data"
TRAIN_DATA = DATA_DIR / "chat.jsonl"
EVAL_DATA = DATA_DIR / "chat_eval.jsonl"

PAD_TOKEN = "<|endoftext|>"
TURN_START = "<|im_start|>"
TURN_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, TURN_START, TURN_END)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB_SIZE = 2048


class _ModelConfig(TypedDict):
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool


MODEL_CONFIG: _ModelConfig = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
# Questions of the held-out set (chat_eval.jsonl) whose answers follow the training
# patterns: the trained model answers them right (checked with seeds 0-3).
SAMPLE_PROMPTS = (
    "What is the capital of France?",
    "What colour is the sky?",
    "What is the opposite of hot?",
    "What does a cow say?",
)
# About a minute of training on two CPU cores. Synchronous steps: with one-step-stale
# (asynchronous) AdamW steps this tiny model, trained from scratch at this learning
# rate, stays near a loss of 1 and answers wrongly; exact steps cost no time here.
# No devices: the command's default, CUDA where there is a GPU, else 2 emulated ones;
# fp32 on either (the recipe was tuned in fp32).
DEMO_OPTIONS = {
    "full": True,
    "precision": "fp32",
    "sync": True,
    "steps": 300,
    "batch_size": 32,
    "seq_len": 128,
    "microbatches": 2,
    "lr": 5e-3,
    "warmup_steps": 40,
    "schedule": "cosine",
    "eval_every": 50,
    "save_every": 150,
    "seed": 0,
}
# Written last into a finished model directory; a directory without it (or with other
# contents) is rebuilt. Bump the format when the model or tokenizer recipe changes.
MARKER_FILE = "roundpipe_demo.json"
MARKER_FORMAT = 1
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


@dataclass(frozen=True)
class DemoSetup:
    """What ``roundpipe train --demo`` trains: the model directory, the data, the options."""

    model_dir: Path
    data: Path
    eval_data: Path
    prompts: tuple[str, ...]
    options: dict = field(default_factory=dict)


def prepare_demo(workdir: Path, seed: int = 0) -> DemoSetup:
    """Write (or reuse) the untrained demo model in ``workdir/base-model`` and return
    the demo's setup. The directory is built under a temporary name and renamed into
    place, so an interrupted run never leaves a half-written model to be reused."""
    workdir = Path(workdir)
    model_dir = workdir / "base-model"
    marker = _marker(seed)
    if not _is_complete(model_dir, marker):
        _check_replaceable(model_dir)
        workdir.mkdir(parents=True, exist_ok=True)
        staging = workdir / f".base-model.tmp-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            _write_model_dir(staging, seed)
            (staging / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
            shutil.rmtree(model_dir, ignore_errors=True)
            staging.rename(model_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return DemoSetup(
        model_dir=model_dir,
        data=TRAIN_DATA,
        eval_data=EVAL_DATA,
        prompts=SAMPLE_PROMPTS,
        options={**DEMO_OPTIONS, "seed": seed},
    )


def _marker(seed: int) -> dict:
    digest = hashlib.sha256(TRAIN_DATA.read_bytes()).hexdigest()
    return {
        "format": MARKER_FORMAT,
        "seed": seed,
        "vocab_size": VOCAB_SIZE,
        "model": MODEL_CONFIG,
        "train_data_sha256": digest,
    }


def _is_complete(model_dir: Path, marker: dict) -> bool:
    try:
        written = json.loads((model_dir / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return written == marker and all((model_dir / name).is_file() for name in REQUIRED_FILES)


def _check_replaceable(model_dir: Path) -> None:
    """Refuse to delete a directory the demo did not write."""
    if model_dir.exists() and not (model_dir / MARKER_FILE).is_file():
        raise FileExistsError(
            f"{model_dir} exists but was not written by `roundpipe train --demo` (it has no "
            f"{MARKER_FILE}); remove it or choose another --output directory"
        )


def _write_model_dir(directory: Path, seed: int) -> None:
    tokenizer = build_tokenizer(chat_texts(TRAIN_DATA))
    model = build_model(tokenizer, seed)
    with _without_progress_bars():
        model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


@contextmanager
def _without_progress_bars() -> Iterator[None]:
    """Silence ``transformers``' progress bars (loading a tiny model is instant; the
    bars would only clutter the demo's output)."""
    from transformers.utils import logging

    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            logging.enable_progress_bar()


def chat_texts(path: Path) -> Iterator[str]:
    """Every role and message content of a chat JSONL file, in file order."""
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                messages = json.loads(line)["messages"]
                for message in messages:
                    yield message["role"]
                    yield message["content"]
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"{path}:{number}: not a chat line ({error})") from error


def build_tokenizer(texts: Iterable[str]):
    """A byte-level BPE tokenizer trained on ``texts`` (deterministic: no seed), wrapped
    as a ``transformers`` fast tokenizer with the ChatML template. It has at most
    ``VOCAB_SIZE`` entries; fewer when the merges run out, and then every word of
    ``texts`` is one token (words it never saw fall back to bytes).

    ``eos_token`` is ``<|im_end|>`` so that generation stops at the end of the
    assistant's turn; ``<|endoftext|>`` pads."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=TURN_END,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[TURN_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=MODEL_CONFIG["max_position_embeddings"],
    )


def build_model(tokenizer, seed: int = 0):
    """A randomly initialised fp32 ``Qwen3ForCausalLM`` of ``MODEL_CONFIG`` for
    ``tokenizer``, its weights a function of ``seed`` only (the global RNG is left
    as it was)."""
    import transformers

    end_ids = _stop_token_ids(tokenizer)
    config = transformers.Qwen3Config(
        vocab_size=len(tokenizer),
        bos_token_id=None,
        eos_token_id=end_ids[0],
        pad_token_id=tokenizer.pad_token_id,
        **MODEL_CONFIG,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # transformers wraps ``to`` with functools.wraps, whose stub drops the binding of self
        model = transformers.Qwen3ForCausalLM(config).to(torch.float32)  # type: ignore[arg-type]
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=end_ids,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    return model


def _stop_token_ids(tokenizer) -> list[int]:
    """The tokens that end an answer: the end of the turn, then the end of the text."""
    return [tokenizer.convert_tokens_to_ids(TURN_END), tokenizer.convert_tokens_to_ids(PAD_TOKEN)]


def sample_generations(
    base_dir: Path, trained_dir: Path, prompts: Sequence[str], max_new_tokens: int = 32
) -> list[tuple[str, str, str]]:
    """``(prompt, untrained answer, trained answer)`` for each prompt: greedy answers on
    the CPU to the prompt as a single user turn of the chat template. ``trained_dir``
    is a full model directory, or a peft adapter directory (it has
    ``adapter_config.json``) applied on top of the model in ``base_dir``."""
    import transformers

    base_dir, trained_dir, prompts = Path(base_dir), Path(trained_dir), tuple(prompts)
    for directory in (base_dir, trained_dir):
        if not directory.is_dir():
            raise FileNotFoundError(f"{directory} is not a directory; cannot sample from it")
    with _without_progress_bars():
        tokenizer = transformers.AutoTokenizer.from_pretrained(base_dir)
        untrained = _answers(_load_model(base_dir), tokenizer, prompts, max_new_tokens)
        if (trained_dir / "adapter_config.json").is_file():
            import peft

            model = peft.PeftModel.from_pretrained(_load_model(base_dir), trained_dir).eval()
        else:
            model = _load_model(trained_dir)
        trained = _answers(model, tokenizer, prompts, max_new_tokens)
    return list(zip(prompts, untrained, trained, strict=True))


def _load_model(directory: Path):
    import transformers
    from packaging.version import Version

    if not (directory / "config.json").is_file():
        raise FileNotFoundError(
            f"{directory} is neither a Hugging Face model directory (no config.json) "
            "nor a peft adapter directory (no adapter_config.json)"
        )
    dtype_kwarg = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, **{dtype_kwarg: torch.float32}
    )
    return model.eval()


def _answers(model, tokenizer, prompts: Sequence[str], max_new_tokens: int) -> list[str]:
    stop_ids = _stop_token_ids(tokenizer)
    answers = []
    for prompt in prompts:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            output = model.generate(
                **inputs,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=stop_ids,
                pad_token_id=tokenizer.pad_token_id,
            )
        answers.append(decode_answer(tokenizer, output[0, inputs["input_ids"].shape[1] :]))
    return answers


def decode_answer(tokenizer, new_ids: torch.Tensor | Sequence[int]) -> str:
    """Generated token ids up to the first stop token (``<|im_end|>`` or
    ``<|endoftext|>``), as text without special tokens or surrounding whitespace."""
    stop_ids = set(_stop_token_ids(tokenizer))
    kept = []
    for token in torch.as_tensor(new_ids).tolist():
        if token in stop_ids:
            break
        kept.append(token)
    return tokenizer.decode(kept, skip_special_tokens=True).strip()


def format_samples(samples: Iterable[tuple[str, str, str]], width: int = 76) -> str:
    """The sample generations as a block of text: each prompt, then its untrained and
    trained answers on one line each (whitespace collapsed, cut to ``width``)."""
    lines = ["Sample generations (greedy; before = untrained, after = trained):"]
    for prompt, before, after in samples:
        lines.append(f"  Q: {_one_line(prompt, width)}")
        lines.append(f"     before: {_one_line(before, width)}")
        lines.append(f"     after:  {_one_line(after, width)}")
    return "\n".join(lines)


def _one_line(text: str, width: int) -> str:
    text = " ".join(text.split())
    if not text:
        return "(empty)"
    return text if len(text) <= width else text[: width - 3] + "..."
