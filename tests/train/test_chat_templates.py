"""``--chat-template FILE|NAME`` (:mod:`roundpipe.train.chat_templates`): the built-in
templates render as their families do, honour ``add_generation_prompt``, and let the chat
data's assistant turns be found (their labels are exactly the replies and the end-of-turn
token); a Jinja file is read; a bad name, file or template is one clear error.
``roundpipe train --chat-template`` trains chat data on a base model without a template
(whose refusal names the option). ``roundpipe chat --chat-template``: test_chat_command.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from support.bpe_tokenizer import make_tokenizer  # noqa: E402
from support.chat_fixtures import base_model_dir  # noqa: E402
from support.train_fixtures import write_data  # noqa: E402

from roundpipe.train.chat import IGNORE_INDEX, chat_examples  # noqa: E402
from roundpipe.train.chat_templates import apply_chat_template_option  # noqa: E402
from roundpipe.train.options import resolve  # noqa: E402
from roundpipe.train.preflight import prepare  # noqa: E402
from roundpipe.train.usage import UsageError  # noqa: E402

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello world"},
    {"role": "assistant", "content": "how are you"},
    {"role": "user", "content": "What is two plus three?"},
    {"role": "assistant", "content": "five"},
]
RENDERED = {
    "chatml": (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello world<|im_end|>\n"
        "<|im_start|>assistant\nhow are you<|im_end|>\n"
        "<|im_start|>user\nWhat is two plus three?<|im_end|>\n"
    ),
    "llama3": (
        "<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHello world<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nhow are you<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is two plus three?<|eot_id|>"
    ),
}
RENDERED["qwen3"] = RENDERED["chatml"]
GENERATION_PROMPT = {
    "chatml": "<|im_start|>assistant\n",
    "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "qwen3": "<|im_start|>assistant\n",
}
END_OF_TURN = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "qwen3": "<|im_end|>"}
LLAMA3_SPECIAL = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def tokenizer_for(name: str):
    """The tiny BPE tokenizer without a chat template (a base model's), with the
    family's markup tokens special, as its own tokenizer has them."""
    tokenizer = make_tokenizer(chat_template=None, bos=name == "llama3")
    if name == "llama3":
        tokenizer.add_special_tokens({"additional_special_tokens": LLAMA3_SPECIAL})
    assert not tokenizer.chat_template
    return tokenizer


@pytest.mark.parametrize("name", ["chatml", "llama3", "qwen3"])
def test_a_built_in_template_renders_as_its_family_does(name):
    tokenizer = tokenizer_for(name)
    apply_chat_template_option(tokenizer, name)
    history = CONVERSATION[:4]
    render = tokenizer.apply_chat_template
    assert render(history, tokenize=False) == RENDERED[name]
    prompt = render(history, tokenize=False, add_generation_prompt=True)
    assert prompt == RENDERED[name] + GENERATION_PROMPT[name]


@pytest.mark.parametrize("name", ["chatml", "llama3", "qwen3"])
def test_a_built_in_template_labels_exactly_the_assistant_replies(name):
    tokenizer = tokenizer_for(name)
    apply_chat_template_option(tokenizer, name)
    [(ids, labels)] = chat_examples(CONVERSATION, tokenizer)
    assert len(ids) == len(labels)
    learnt = [label for label in labels if label != IGNORE_INDEX]
    replies = tokenizer.decode(learnt, skip_special_tokens=False)
    end = END_OF_TURN[name]
    assert replies == f"how are you{end}five{end}"


def test_qwen3_without_thinking_opens_the_reply_with_an_empty_thinking_block():
    tokenizer = tokenizer_for("qwen3")
    apply_chat_template_option(tokenizer, "qwen3")
    prompt = tokenizer.apply_chat_template(
        CONVERSATION[:2], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_a_jinja_file_becomes_the_template(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    tokenizer = tokenizer_for("chatml")
    apply_chat_template_option(tokenizer, str(path))
    rendered = tokenizer.apply_chat_template(
        CONVERSATION[1:2], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "[user] Hello world\n[assistant] "


def test_no_value_keeps_the_tokenizers_own_template():
    tokenizer = make_tokenizer()
    own = tokenizer.chat_template
    apply_chat_template_option(tokenizer, None)
    assert tokenizer.chat_template == own


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("chatml3", "neither a built-in template (chatml, llama3, qwen3) nor a file"),
        ("{directory}", "cannot be read"),
        ("{empty}", "the file is empty"),
        ("{broken}", "the template cannot render a conversation"),
    ],
    ids=["unknown-name", "a-directory", "empty-file", "broken-jinja"],
)
def test_a_bad_value_is_one_clear_error(tmp_path, value, says):
    (tmp_path / "empty.jinja").write_text("\n")
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}{{ m.content }")
    value = value.format(
        directory=tmp_path, empty=tmp_path / "empty.jinja", broken=tmp_path / "broken.jinja"
    )
    with pytest.raises(UsageError) as caught:
        apply_chat_template_option(tokenizer_for("chatml"), value)
    message = str(caught.value)
    assert message.startswith(f"--chat-template {value}: ")
    assert says in message
    assert "\n" not in message


def test_train_with_chat_template_renders_chat_data_with_it(tmp_path):
    base = base_model_dir(tmp_path / "base")
    data = write_data(tmp_path / "chat.jsonl", "messages", lines=4)
    given = {"model": base, "data": data, "output": tmp_path / "out", "seq_len": 32,
             "chat_template": "chatml"}  # fmt: skip
    prepared = prepare(resolve(given))
    decode = prepared.tokenizer.decode
    first = prepared.train_batches.examples[0]
    assert decode(first.input_ids).startswith("<|im_start|> user count from")
    learnt = [label for label in first.labels if label != IGNORE_INDEX]
    assert decode(learnt, skip_special_tokens=False).endswith("<|im_end|>")


def test_train_refuses_chat_data_for_a_tokenizer_without_template_naming_the_option(tmp_path):
    base = base_model_dir(tmp_path / "base")
    data = write_data(tmp_path / "chat.jsonl", "messages", lines=4)
    given = {"model": base, "data": data, "output": tmp_path / "out", "seq_len": 32}
    with pytest.raises(UsageError) as caught:
        prepare(resolve(given))
    assert "no chat template" in str(caught.value)
    assert "--chat-template" in str(caught.value)


def test_train_keeps_a_template_file_by_its_absolute_path(tmp_path, monkeypatch):
    base = base_model_dir(tmp_path / "base")
    data = write_data(tmp_path / "chat.jsonl", "messages", lines=4)
    (tmp_path / "mine.jinja").write_text(
        "{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}"
    )
    monkeypatch.chdir(tmp_path)
    given = {"model": base, "data": data, "output": tmp_path / "out", "seq_len": 32,
             "chat_template": "mine.jinja"}  # fmt: skip
    prepared = prepare(resolve(given))
    assert prepared.options.chat_template == str(tmp_path / "mine.jinja")
