"""``roundpipe chat``: one answer (``--prompt``) or a conversation read from stdin, on a
model directory, a LoRA adapter on its base, or a checkpoint of a ``roundpipe train``
run, with the tokenizer's chat template or ``--chat-template``.

The oracle is ``transformers``' own greedy ``generate`` on the same conversation
rendered by the same template (and peft's ``PeftModel`` for an adapter, ``roundpipe
export --merge``'s model for a checkpoint). Bad input exits with code 2 and one line.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from support.chat_fixtures import base_model_dir, greedy_answer  # noqa: E402
from support.train_cli import COMMON, REPO, run_train  # noqa: E402
from support.train_fixtures import build_model_dir, write_data  # noqa: E402

from roundpipe.cli import main  # noqa: E402
from roundpipe.train.chat_templates import CHATML, LLAMA3  # noqa: E402
from roundpipe.train.export import export  # noqa: E402

GREEDY = ("--temperature", "0", "--max-new-tokens", "5")
CHAT_LIMIT_S = 120


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("chat") / "model")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A base model: its tokenizer has no chat template."""
    return base_model_dir(tmp_path_factory.mktemp("chat") / "base")


@pytest.fixture(scope="module")
def lora_run(base_dir, tmp_path_factory):
    """A finished two-step LoRA run on chat data, of the base model with ``--chat-template
    chatml``: its --output (adapter, checkpoints)."""
    root = tmp_path_factory.mktemp("chat-run")
    data = write_data(root / "messages.jsonl", "messages", lines=16)
    output = root / "out"
    done = run_train("--model", base_dir, "--data", data, "--output", output, *COMMON,
                     "--steps", "2", "--lr", "5e-2", "--chat-template", "chatml")  # fmt: skip
    assert done.returncode == 0, done.stderr
    return output


def chat_process(*args, stdin: str | None = None) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "roundpipe", "chat", *map(str, args)]
    return subprocess.run(command, input=stdin or "", capture_output=True, text=True,
                          env=environment, cwd=REPO, timeout=CHAT_LIMIT_S)  # fmt: skip


def chat_answer(capsys, *args) -> str:
    """What ``roundpipe chat --prompt`` prints, run in this process."""
    assert main(["chat", *map(str, args), *GREEDY]) == 0
    return capsys.readouterr().out


def refused(capsys, *args) -> str:
    capsys.readouterr()  # what the test printed before (transformers' progress bars)
    with pytest.raises(SystemExit) as exit_info:
        main(["chat", *map(str, args), *GREEDY])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def load(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)


def save_adapter(base, directory, seed: int = 1):
    """A LoRA adapter of ``base`` with random (not zero) B matrices, saved by peft."""
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = peft.get_peft_model(base, config)
    model.save_pretrained(directory)
    return directory


def test_one_prompt_prints_the_greedy_answer_of_generate(model_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    want = greedy_answer(load(model_dir), tokenizer, [user("count from 3 to 6")])
    done = chat_process("--model", model_dir, "--prompt", "count from 3 to 6", *GREEDY)
    assert done.returncode == 0, done.stderr
    assert done.stdout == want + "\n"


def test_the_interactive_chat_answers_each_line_in_one_conversation_until_exit(model_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = load(model_dir)
    messages = [{"role": "system", "content": "say hello"}]
    answers = []
    for line in ("count from 3 to 6", "what comes next"):
        messages.append(user(line))
        answers.append(greedy_answer(model, tokenizer, messages))
        messages.append({"role": "assistant", "content": answers[-1]})
    done = chat_process(
        "--model", model_dir, "--system", "say hello", *GREEDY,
        stdin="count from 3 to 6\nwhat comes next\n/exit\nnever answered\n",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert [line.strip() for line in done.stdout.splitlines()] == answers


def test_an_adapter_answers_as_peft_applies_it_to_the_base(model_dir, tmp_path, capsys):
    adapter = save_adapter(load(model_dir), tmp_path / "adapter")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    with_adapter = peft.PeftModel.from_pretrained(load(model_dir), adapter)
    want = greedy_answer(with_adapter, tokenizer, [user("hello")])
    args = ("--model", model_dir, "--adapter", adapter, "--prompt", "hello")
    assert chat_answer(capsys, *args) == want + "\n"


def test_the_adapter_a_train_run_wrote_finds_its_base_and_keeps_its_template(
    base_dir, lora_run, capsys
):
    tokenizer = transformers.AutoTokenizer.from_pretrained(lora_run)
    assert tokenizer.chat_template == CHATML  # --chat-template of the run, saved with it
    with_adapter = peft.PeftModel.from_pretrained(load(base_dir), lora_run)
    want = greedy_answer(with_adapter, tokenizer, [user("count from 2 to 5")])
    assert chat_answer(capsys, "--adapter", lora_run, "--prompt", "count from 2 to 5") == (
        want + "\n"
    )


@pytest.mark.parametrize("given", ["step-2", "the run"])
def test_a_checkpoint_answers_as_its_merged_export_with_the_runs_template(
    lora_run, tmp_path, capsys, given
):
    checkpoint = lora_run / "checkpoints" / "step-2"  # the run's newest
    export(checkpoint, tmp_path / "merged", merge=True)
    merged = tmp_path / "merged"
    tokenizer = transformers.AutoTokenizer.from_pretrained(merged)
    assert tokenizer.chat_template == CHATML
    want = greedy_answer(load(merged), tokenizer, [user("count from 2 to 5")])
    flag = ("--checkpoint", checkpoint if given == "step-2" else lora_run)
    assert chat_answer(capsys, *flag, "--prompt", "count from 2 to 5") == want + "\n"


def test_a_seeded_sampled_answer_equals_generate_with_that_seed(model_dir, capsys):
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = load(model_dir)
    text = tokenizer.apply_chat_template(
        [user("hello")], tokenize=False, add_generation_prompt=True
    )
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    torch.manual_seed(3)
    with torch.no_grad():
        output = model.eval().generate(
            **inputs, max_new_tokens=8, do_sample=True, temperature=1.5, top_p=0.95
        )
    want = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    sampling = ("--temperature", "1.5", "--top-p", "0.95", "--seed", "3", "--max-new-tokens", "8")
    assert main(["chat", "--model", str(model_dir), "--prompt", "hello", *sampling]) == 0
    assert capsys.readouterr().out == want.strip() + "\n"


def test_chat_template_gives_a_base_model_its_template(base_dir, capsys):
    err = refused(capsys, "--model", base_dir, "--prompt", "hello")
    assert "no chat template" in err and "--chat-template" in err
    assert err.count("\n") == 1
    tokenizer = transformers.AutoTokenizer.from_pretrained(base_dir)
    tokenizer.chat_template = LLAMA3
    want = greedy_answer(load(base_dir), tokenizer, [user("hello")])
    args = ("--model", base_dir, "--chat-template", "llama3", "--prompt", "hello")
    assert chat_answer(capsys, *args) == want + "\n"


def test_an_adapter_of_another_model_is_refused(model_dir, tmp_path, capsys):
    config = load(model_dir).config
    config.hidden_size, config.intermediate_size = 16, 32
    other = save_adapter(transformers.Qwen3ForCausalLM(config), tmp_path / "other")
    err = refused(capsys, "--model", model_dir, "--adapter", other, "--prompt", "hello")
    assert err.startswith(f"roundpipe chat: error: --adapter {other} does not fit --model")
    assert err.count("\n") == 1


@pytest.mark.parametrize("flag", ["--model", "--adapter", "--checkpoint"])
def test_a_missing_directory_is_refused(model_dir, tmp_path, capsys, flag):
    missing = tmp_path / "missing"
    args = (flag, missing) if flag != "--adapter" else ("--model", model_dir, flag, missing)
    err = refused(capsys, *args, "--prompt", "hello")
    assert err.startswith("roundpipe chat: error: ")
    assert str(missing) in err
    assert err.count("\n") == 1


def test_an_adapter_given_as_the_model_is_refused_naming_adapter(model_dir, tmp_path, capsys):
    adapter = save_adapter(load(model_dir), tmp_path / "adapter")
    err = refused(capsys, "--model", adapter, "--prompt", "hello")
    assert (
        err == f"roundpipe chat: error: --model {adapter}: a LoRA adapter, not a model: "
        "pass it as --adapter\n"
    )
