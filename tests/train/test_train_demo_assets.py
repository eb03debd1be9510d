"""The assets of ``roundpipe train --demo`` (``roundpipe.train.demo``).

``prepare_demo`` writes a tiny Qwen3 model directory that ``transformers`` loads, the
same bytes every time, and reuses it; the chat data in the package parses and keeps
its evaluation prompts out of training; ``sample_generations`` answers as a plain
greedy loop over the model's own logits does (the oracle), for a full model directory
and for a peft adapter.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import roundpipe  # noqa: E402
from roundpipe.train.demo import (  # noqa: E402
    DemoSetup,
    decode_answer,
    format_samples,
    prepare_demo,
    sample_generations,
)
from roundpipe.train.options import OPTIONS  # noqa: E402

PROMPTS = ("What is the capital of France?", "Count from 4 to 8.")
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> DemoSetup:
    return prepare_demo(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def tokenizer(demo: DemoSetup):
    return transformers.AutoTokenizer.from_pretrained(demo.model_dir)


def load_model(directory: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)


def file_bytes(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def chat_lines(path: Path) -> list[list[dict]]:
    return [json.loads(line)["messages"] for line in path.read_text().splitlines()]


def user_questions(path: Path) -> set[str]:
    return {m["content"] for chat in chat_lines(path) for m in chat if m["role"] == "user"}


def first_question(chat: list[dict]) -> str:
    return next(m["content"] for m in chat if m["role"] == "user")


def greedy_answer(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """The oracle: argmax of the full forward's last logits, token by token, until the
    end of the turn."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    stop = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id}
    answer: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([ids + answer])).logits
            token = int(logits[0, -1].argmax())
            if token in stop:
                break
            answer.append(token)
    return tokenizer.decode(answer, skip_special_tokens=True).strip()


def test_prepare_demo_writes_identical_files_from_the_same_seed(demo, tmp_path):
    again = prepare_demo(tmp_path)
    assert file_bytes(again.model_dir) == file_bytes(demo.model_dir)


def test_prepare_demo_reuses_a_complete_directory(demo):
    before = {p.name: p.stat().st_mtime_ns for p in demo.model_dir.iterdir()}
    again = prepare_demo(demo.model_dir.parent)
    assert again == demo
    assert {p.name: p.stat().st_mtime_ns for p in demo.model_dir.iterdir()} == before


def test_prepare_demo_rebuilds_a_directory_missing_a_file(demo, tmp_path):
    setup = prepare_demo(tmp_path)
    (setup.model_dir / "model.safetensors").unlink()
    prepare_demo(tmp_path)
    assert file_bytes(setup.model_dir) == file_bytes(demo.model_dir)


def test_prepare_demo_with_another_seed_builds_other_weights(demo, tmp_path):
    other = prepare_demo(tmp_path, seed=1)
    assert other.options["seed"] == 1
    weights = file_bytes(other.model_dir)["model.safetensors"]
    assert weights != file_bytes(demo.model_dir)["model.safetensors"]


def test_prepare_demo_refuses_to_replace_a_directory_it_did_not_write(tmp_path):
    (tmp_path / "base-model").mkdir()
    (tmp_path / "base-model" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="base-model"):
        prepare_demo(tmp_path)
    assert (tmp_path / "base-model" / "notes.txt").read_text() == "mine"


def test_model_directory_loads_as_a_tiny_fp32_qwen3(demo, tokenizer):
    model = load_model(demo.model_dir)
    assert isinstance(model, transformers.Qwen3ForCausalLM)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) < 5_000_000
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.max_position_embeddings >= 256
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_id == end_of_turn
    assert end_of_turn in model.generation_config.eos_token_id
    assert tokenizer.pad_token == "<|endoftext|>"


def test_chat_template_renders_chatml(tokenizer):
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 2 plus 3?"},
        {"role": "assistant", "content": "2 plus 3 is 5."},
    ]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>system\nAnswer briefly.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n"
        "<|im_start|>assistant\n2 plus 3 is 5.<|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(
        messages[1:2], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    "text",
    [
        "The capital of France is Paris.",
        "  two  spaces,\nnew lines\n\tand a tab ",
        "Unseen words: Zürich, naïve, 東京, 12345!",
        "<|im_start|>user\nHi<|im_end|>\n",
    ],
)
def test_tokenizer_round_trips_text(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_special_tokens_are_single_tokens_and_words_are_whole(tokenizer):
    ids = tokenizer("<|im_start|>assistant\n<|im_end|>", add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert len(tokenizer.tokenize("The capital of France is Paris.")) == 7


@pytest.mark.parametrize("name", ["chat.jsonl", "chat_eval.jsonl"])
def test_dataset_lines_are_chats_ending_with_an_assistant_turn(demo, name):
    path = {"chat.jsonl": demo.data, "chat_eval.jsonl": demo.eval_data}[name]
    assert path.name == name and path.stat().st_size <= 300_000
    for number, chat in enumerate(chat_lines(path), start=1):
        roles = [m["role"] for m in chat]
        turns = roles[1:] if roles[0] == "system" else roles
        assert turns[::2] == ["user"] * (len(turns) // 2), f"{name}:{number}"
        assert turns[1::2] == ["assistant"] * (len(turns) // 2), f"{name}:{number}"
        assert len(turns) >= 2 and len(turns) % 2 == 0, f"{name}:{number}"
        assert all(isinstance(m["content"], str) and m["content"] for m in chat)


def test_training_data_has_system_turns_and_multi_turn_chats(demo):
    chats = chat_lines(demo.data)
    assert len(chats) >= 500
    assert any(chat[0]["role"] == "system" for chat in chats)
    assert sum(sum(m["role"] == "assistant" for m in chat) > 1 for chat in chats) >= 10


def test_evaluation_and_sample_prompts_are_held_out_from_training(demo):
    training = user_questions(demo.data)
    # A multi-turn evaluation chat may ask a common follow-up ("What is my name?"), but
    # it opens with a question training never asked.
    openings = [first_question(chat) for chat in chat_lines(demo.eval_data)]
    assert openings and not set(openings) & training
    assert 3 <= len(demo.prompts) <= 4
    assert set(demo.prompts) <= set(openings)


def test_data_files_ship_inside_the_package(demo):
    package = Path(roundpipe.__file__).parent
    assert demo.data == package / "train" / "demo_data" / "chat.jsonl"
    assert demo.eval_data == package / "train" / "demo_data" / "chat_eval.jsonl"
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((package.parent / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["roundpipe"]
    shipped = {path for pattern in patterns for path in package.glob(pattern)}
    assert {demo.data, demo.eval_data} <= shipped


def test_options_name_the_cli_options_of_a_full_fine_tune(demo):
    options = demo.options
    assert set(options) <= {option.key for option in OPTIONS}
    assert options["full"] is True and "devices" not in options  # CUDA when present
    assert options["precision"] == "fp32"
    for name in ("steps", "batch_size", "seq_len", "microbatches", "warmup_steps", "seed"):
        assert isinstance(options[name], int) and options[name] >= 0, name
    assert options["seq_len"] <= load_model(demo.model_dir).config.max_position_embeddings
    assert 0 < options["lr"] < 1


def test_sample_generations_of_a_full_model_match_a_greedy_loop(demo, tokenizer, tmp_path):
    trained = load_model(demo.model_dir)
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(1)
        for parameter in trained.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    trained.save_pretrained(tmp_path / "trained")  # weights only: the tokenizer is the base's
    samples = sample_generations(demo.model_dir, tmp_path / "trained", PROMPTS, NEW_TOKENS)
    base = load_model(demo.model_dir)
    assert samples[0][1] != samples[0][2]  # else the test could not tell the models apart
    assert samples == [
        (
            prompt,
            greedy_answer(base, tokenizer, prompt, NEW_TOKENS),
            greedy_answer(trained, tokenizer, prompt, NEW_TOKENS),
        )
        for prompt in PROMPTS
    ]
    assert all(isinstance(text, str) for sample in samples for text in sample)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # peft calls a deprecated transformers API
def test_sample_generations_apply_a_peft_adapter_on_the_base_model(demo, tokenizer, tmp_path):
    torch.manual_seed(2)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    adapted = peft.get_peft_model(load_model(demo.model_dir), lora).eval()
    adapted.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    samples = sample_generations(demo.model_dir, tmp_path / "adapter", PROMPTS[:1], NEW_TOKENS)
    expected_after = greedy_answer(adapted, tokenizer, PROMPTS[0], NEW_TOKENS)
    assert expected_after != samples[0][1]  # the adapter changes the answer
    assert samples[0][2] == expected_after


def test_sample_generations_name_a_missing_directory(demo, tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        sample_generations(demo.model_dir, tmp_path / "nowhere", PROMPTS)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        sample_generations(demo.model_dir, tmp_path / "empty", PROMPTS)


def test_decode_answer_stops_at_the_end_of_the_turn(tokenizer):
    ids = tokenizer(" The sky is blue.<|im_end|>\nextra", add_special_tokens=False)["input_ids"]
    assert decode_answer(tokenizer, ids) == "The sky is blue."
    end = ids.index(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    assert decode_answer(tokenizer, torch.tensor(ids[end:])) == ""


def test_format_samples_shows_each_prompt_with_both_answers():
    text = format_samples(
        [("What is 2 plus 3?", "garbage\n" * 40, "2 plus 3 is 5."), ("Hello!", "", "Hi!")],
        width=40,
    )
    lines = text.splitlines()
    assert lines[1:4] == [
        "  Q: What is 2 plus 3?",
        "     before: " + ("garbage " * 5)[:37] + "...",
        "     after:  2 plus 3 is 5.",
    ]
    assert lines[5:] == ["     before: (empty)", "     after:  Hi!"]
