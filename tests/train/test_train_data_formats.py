"""``roundpipe train`` data formats beyond text, prompt+completion and messages: TRL's
conversational prompt-completion, content as text parts, Alpaca, ShareGPT, columns of
other names (``--data-fields``), and ``--train-on-prompt``.

The oracles: ``transformers``' ``apply_chat_template`` (the ids of a conversation, and
TRL's completion mask: the tokens after the prompt rendered with its generation prompt),
a chat template that renders content parts itself, and the equivalent record in one of
the three basic formats. Basic formats: ``test_train_examples.py``; sources:
``test_train_data_sources.py``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from support.bpe_tokenizer import CHATML, make_tokenizer  # noqa: E402

from roundpipe.train.data import DataError, load_dataset  # noqa: E402
from roundpipe.train.formats import FIELD_FORMATS  # noqa: E402

PROMPT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is two plus three?"},
    {"role": "assistant", "content": "Five."},
    {"role": "user", "content": "And the fox?"},
]
COMPLETION = [{"role": "assistant", "content": "It jumps over the dog."}]
PARTS_TEMPLATE = CHATML.replace(
    "{{ m.content }}",
    "{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}",
)


def ids(tokenizer, messages, **options) -> list[int]:
    rendered = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **options)
    return list(rendered["input_ids"])


def examples(tokenizer, write_jsonl, rows, **options):
    return load_dataset(write_jsonl(rows), tokenizer, 256, **options).examples


def labelled(example) -> list[int]:
    return [i for i, label in enumerate(example.labels) if label != -100]


# --- conversational prompt-completion ---------------------------------------------------


def test_conversational_prompt_completion_learns_the_completion_as_trl_masks_it(
    tokenizer, write_jsonl
):
    (example,) = examples(tokenizer, write_jsonl, [{"prompt": PROMPT, "completion": COMPLETION}])
    full = ids(tokenizer, PROMPT + COMPLETION)
    prompt = ids(tokenizer, PROMPT, add_generation_prompt=True)
    assert list(example.input_ids) == full
    # TRL's completion mask: every token after the prompt; we stop at the end-of-turn
    # token, leaving out the template's newline after it, as for every assistant turn.
    end_of_turn = full.index(tokenizer.convert_tokens_to_ids("<|im_end|>"), len(prompt))
    assert labelled(example) == list(range(len(prompt), end_of_turn + 1))
    assert tokenizer.decode(full[end_of_turn + 1 :]) == "\n"


def test_the_prompts_own_assistant_turns_are_not_learnt(tokenizer, write_jsonl):
    as_messages = examples(tokenizer, write_jsonl, [{"messages": PROMPT + COMPLETION}])[0]
    row = {"prompt": PROMPT, "completion": COMPLETION}
    as_completion = examples(tokenizer, write_jsonl, [row])[0]
    assert as_messages.input_ids == as_completion.input_ids
    assert set(labelled(as_completion)) < set(labelled(as_messages))  # "Five." is not learnt


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ({"prompt": PROMPT, "completion": [{"role": "user", "content": "Hi"}]}, "no assistant"),
        ({"prompt": "Hi", "completion": COMPLETION}, "must both be strings, or both lists"),
        ({"prompt": PROMPT, "completion": []}, '"completion" must be a non-empty list'),
    ],
)
def test_a_bad_conversational_record_is_named(tokenizer, write_jsonl, row, expected):
    path = write_jsonl([row])
    with pytest.raises(DataError, match=f"{path}:1: .*{expected}"):
        load_dataset(path, tokenizer, 64)


def test_standard_and_conversational_records_do_not_mix(tokenizer, write_jsonl):
    path = write_jsonl(
        [{"prompt": "a", "completion": "b"}, {"prompt": PROMPT, "completion": COMPLETION}]
    )
    with pytest.raises(DataError, match=f"{path}:2: a conversational .*first line \\(1\\)"):
        load_dataset(path, tokenizer, 64)


# --- content given as parts ---------------------------------------------------------------


def test_content_given_as_text_parts_is_the_joined_text(write_jsonl):
    tokenizer = make_tokenizer(chat_template=PARTS_TEMPLATE)
    question = [{"type": "text", "text": "What is "}, {"type": "text", "text": "two plus three?"}]
    parts = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": [{"type": "text", "text": "Five."}]},
    ]
    (example,) = examples(tokenizer, write_jsonl, [{"messages": parts}])
    assert list(example.input_ids) == ids(tokenizer, parts)  # the template renders the parts
    plain = [
        {"role": "user", "content": "What is two plus three?"},
        {"role": "assistant", "content": "Five."},
    ]
    assert examples(tokenizer, write_jsonl, [{"messages": plain}]) == [example]


def test_a_content_part_that_is_not_text_is_refused(tokenizer, write_jsonl):
    image = [{"type": "image", "image": "cat.png"}, {"type": "text", "text": "What is it?"}]
    messages = [{"role": "user", "content": image}, {"role": "assistant", "content": "A cat."}]
    path = write_jsonl([{"messages": messages}])
    with pytest.raises(DataError, match=f"{path}:1: message 1: content part 1 is of type 'image'"):
        load_dataset(path, tokenizer, 64)


# --- Alpaca and ShareGPT ------------------------------------------------------------------


def test_alpaca_is_a_prompt_of_instruction_and_input_and_a_completion(tokenizer, write_jsonl):
    rows = [
        {"instruction": "Add the numbers.", "input": "2 and 3", "output": "Five."},
        {"instruction": "Say hello.", "input": "", "output": "Hello"},
        {"instruction": "Say hello.", "output": "Hello"},
    ]
    same = [
        {"prompt": "Add the numbers.\n\n2 and 3", "completion": "Five."},
        {"prompt": "Say hello.", "completion": "Hello"},
        {"prompt": "Say hello.", "completion": "Hello"},
    ]
    assert examples(tokenizer, write_jsonl, rows) == examples(tokenizer, write_jsonl, same)


def test_sharegpt_conversations_are_messages_with_their_roles(tokenizer, write_jsonl):
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    turns = [{"from": names[m["role"]], "value": m["content"]} for m in PROMPT + COMPLETION]
    sharegpt = examples(tokenizer, write_jsonl, [{"conversations": turns}])
    assert sharegpt == examples(tokenizer, write_jsonl, [{"messages": PROMPT + COMPLETION}])


def test_a_sharegpt_turn_of_an_unknown_role_is_named(tokenizer, write_jsonl):
    turns = [{"from": "human", "value": "Hi"}, {"from": "bot", "value": "Hello"}]
    path = write_jsonl([{"conversations": turns}])
    with pytest.raises(DataError, match=f'{path}:1: turn 2: "from" must be one of human, gpt'):
        load_dataset(path, tokenizer, 64)


# --- --data-fields ------------------------------------------------------------------------


def test_data_fields_rename_columns_to_a_formats_fields(tokenizer, write_jsonl):
    rows = [{"question": "What is two plus three?", "answer": " Five.", "id": 3}]
    mapped = examples(tokenizer, write_jsonl, rows, fields="prompt=question,completion=answer")
    plain = [{"prompt": "What is two plus three?", "completion": " Five."}]
    assert mapped == examples(tokenizer, write_jsonl, plain)


def test_data_fields_choose_the_format_where_columns_of_two_are_present(tokenizer, write_jsonl):
    # like tatsu-lab/alpaca: the Alpaca columns and a "text" column rendering them
    row = {"instruction": "Say hello.", "input": "", "output": "Hello", "text": "### Say hello."}
    path = write_jsonl([row])
    with pytest.raises(DataError, match="more than one format.*choose one with --data-fields"):
        load_dataset(path, tokenizer, 64)
    alpaca = load_dataset(path, tokenizer, 64, fields="instruction=instruction,output=output")
    text = load_dataset(path, tokenizer, 64, fields="text=text")
    pair = {"prompt": "Say hello.", "completion": "Hello"}
    assert alpaca.examples == examples(tokenizer, write_jsonl, [pair])
    assert text.examples == examples(tokenizer, write_jsonl, [{"text": "### Say hello."}])


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ("answer=completion", f"unknown field 'answer'; the fields are {', '.join(FIELD_FORMATS)}"),
        ("prompt", "'prompt' is not FIELD=COLUMN"),
        ("prompt=a,prompt=b", "'prompt' is mapped twice"),
        ("prompt=a,output=b", "maps fields of more than one format"),
    ],
)
def test_bad_data_fields_are_refused(tokenizer, write_jsonl, fields, expected):
    with pytest.raises(DataError, match=f"--data-fields '{fields}'.*{expected}"):
        load_dataset(write_jsonl([{"text": "Hello"}]), tokenizer, 64, fields=fields)


def test_a_mapped_column_the_source_lacks_is_named(tokenizer, write_jsonl):
    path = write_jsonl([{"question": "Hi", "reply": "Hello"}])
    expected = f"{path}:1: no column 'answer' \\(--data-fields completion=answer\\)"
    with pytest.raises(DataError, match=expected):
        load_dataset(path, tokenizer, 64, fields="prompt=question,completion=answer")


# --- --train-on-prompt --------------------------------------------------------------------


@pytest.mark.parametrize(
    "row",
    [{"messages": PROMPT + COMPLETION + [{"role": "user", "content": "Thanks"}]},
     {"prompt": PROMPT, "completion": COMPLETION}],
)  # fmt: skip
def test_train_on_prompt_learns_the_whole_conversation_as_trl_does(tokenizer, write_jsonl, row):
    (example,) = examples(tokenizer, write_jsonl, [row], train_on_prompt=True)
    messages = row.get("messages") or row["prompt"] + row["completion"]
    assert list(example.input_ids) == ids(tokenizer, messages)
    assert example.labels == (-100, *example.input_ids[1:])


def test_train_on_prompt_learns_the_prompt_and_leaves_text_as_it_is(tokenizer, write_jsonl):
    row = {"prompt": "Hello", "completion": " world"}
    (pair,) = examples(tokenizer, write_jsonl, [row], train_on_prompt=True)
    assert pair.labels == (-100, *pair.input_ids[1:])
    text = [{"text": "Hello world"}]
    on_prompt = examples(tokenizer, write_jsonl, text, train_on_prompt=True)
    assert on_prompt == examples(tokenizer, write_jsonl, text)
