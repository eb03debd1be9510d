"""Preference data for ``roundpipe train --method dpo|kto``: TRL's formats read,
tokenized and batched as TRL 1.16 prepares and collates them, and bad records refused
with one line naming the record.

The oracle is TRL itself: a ``DPOTrainer``/``KTOTrainer`` built on a tiny Qwen3 on the
CPU prepares the same records (``trainer.train_dataset``) and its own collator batches
them; our pair-adjacent DPO rows are TRL's ``[chosen..., rejected...]`` reordered, our
labels TRL's ``input_ids`` where its ``completion_mask`` is 1.
"""

from __future__ import annotations

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

import datasets  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from support.bpe_tokenizer import make_tokenizer  # noqa: E402
from support.train_fixtures import tiny_qwen3_config  # noqa: E402

from roundpipe.train.data import load_dataset, load_held_out  # noqa: E402
from roundpipe.train.preference_data import (  # noqa: E402
    DataError,
    PairExample,
    PreferenceBatches,
    UnpairedExample,
    load_preference_dataset,
    load_preference_held_out,
)
from roundpipe.train.preference_formats import UNPAIR_BATCH  # noqa: E402

PAD = 0  # the tiny tokenizer's pad (and EOS) token, <|endoftext|>


def user(text):
    return [{"role": "user", "content": text}]


def assistant(text):
    return [{"role": "assistant", "content": text}]


TEXT_PAIRS = [
    {"prompt": "Hello world,", "chosen": " how are you today?", "rejected": " the lazy dog."},
    # tokens merge across the prompt's end: the completion starts where they diverge
    {"prompt": "The quick bro", "chosen": "wn fox jumps.", "rejected": "ken dog."},
    {"prompt": "What is two plus three?", "chosen": " Five.<|endoftext|>", "rejected": " Six."},
    {"prompt": "user", "chosen": " The quick brown fox jumps over the dog.", "rejected": " No."},
    {"prompt": "Two plus", "chosen": " three is five.", "rejected": " three is six."},
]
CHAT_PAIRS = [
    {
        "prompt": [{"role": "system", "content": "Be brief."}, *user("What is two plus three?")],
        "chosen": assistant("Five."),
        "rejected": assistant("Six, I think."),
    },
    {"prompt": user("Hello world"), "chosen": assistant("Hello!"), "rejected": assistant("No.")},
    {
        "prompt": user("The fox?") + assistant("It jumps.") + user("Over what?"),
        "chosen": assistant("The lazy dog."),
        "rejected": assistant("The moon.") + user("Really?") + assistant("Yes."),
    },
]
IMPLICIT_TEXT_PAIRS = [
    {"chosen": "The sky is blue.", "rejected": "The sky is green."},  # backs off one space
    {"chosen": "Hello world, how", "rejected": "Hello world, howdy"},  # a prefix of the other
    {"chosen": "What is two plus three? Five.", "rejected": "What is two plus three? Six."},
]
UNPAIRED_TEXT = [
    {"prompt": "Hello world,", "completion": " how are you?", "label": True},
    {"prompt": "The quick", "completion": " brown fox.", "label": False},
    {"prompt": "Two plus three is", "completion": " five.", "label": True},
    {"prompt": "The lazy", "completion": " dog jumps over the quick brown fox.", "label": False},
    {"prompt": "What", "completion": " is two?", "label": True},
]
USER_ONLY = (  # a template that renders no assistant turn: a completion adds no token
    "{% for m in messages %}{% if m.role == 'user' %}<|im_start|>user\n{{ m.content }}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>"
    "assistant\n{% endif %}"
)


def implicit(pairs):
    """Conversational pairs with their prompt inside chosen and rejected."""
    return [
        {"chosen": p["prompt"] + p["chosen"], "rejected": p["prompt"] + p["rejected"]}
        for p in pairs
    ]


def trl_trainer(method, rows, tokenizer, tmp_path, max_length=None, batch_size=2):
    """TRL's trainer for ``method`` over ``rows``: it prepares them on construction."""
    config, trainer = {
        "dpo": (trl.DPOConfig, trl.DPOTrainer),
        "kto": (trl.KTOConfig, trl.KTOTrainer),
    }[method]
    args = config(
        output_dir=str(tmp_path / f"trl-{method}"),
        report_to="none",
        use_cpu=True,
        max_length=max_length,
        per_device_train_batch_size=batch_size,
    )
    model_config = tiny_qwen3_config(len(tokenizer))
    return trainer(
        model=transformers.Qwen3ForCausalLM(model_config),
        ref_model=transformers.Qwen3ForCausalLM(model_config),
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
    )


def ours(rows, tokenizer, write_jsonl, method, max_length=None, **options):
    return load_preference_dataset(write_jsonl(rows), tokenizer, max_length, method, **options)


def epoch_order(count, seed, epoch=0):
    return torch.randperm(count, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def labels_of(batch, prefix=""):
    """TRL's rows as our labels: the input ids where the completion mask is 1."""
    ids, mask = batch[f"{prefix}input_ids"], batch[f"{prefix}completion_mask"]
    return torch.where(mask.bool(), ids, torch.full_like(ids, -100))


def assert_pairs_as_trl(dataset, trainer, batch_size, seed=3):
    prepared = trainer.train_dataset
    expected = [
        PairExample(tuple(p), tuple(c), tuple(r))
        for p, c, r in zip(
            prepared["prompt_ids"], prepared["chosen_ids"], prepared["rejected_ids"], strict=True
        )
    ]
    assert dataset.examples == expected
    batches = PreferenceBatches(dataset, batch_size, seed, PAD)
    order = epoch_order(len(expected), seed)
    for step in range(batches.steps_per_epoch):
        indices = order[step * batch_size : (step + 1) * batch_size]
        theirs = trainer.data_collator([prepared[i] for i in indices])
        half = len(indices)
        adjacent = [k for i in range(half) for k in (i, half + i)]  # [c0, r0, c1, r1, ...]
        batch = batches.batch(step)
        assert torch.equal(batch["input_ids"], theirs["input_ids"][adjacent])
        assert torch.equal(batch["attention_mask"], theirs["attention_mask"][adjacent])
        assert torch.equal(batch["labels"], labels_of(theirs)[adjacent])
        assert batches.num_tokens(step) == theirs["attention_mask"].sum()


def unpaired_of(prepared):
    """TRL's prepared KTO rows as our examples."""
    columns = prepared["prompt_ids"], prepared["completion_ids"], prepared["label"]
    return [UnpairedExample(tuple(p), tuple(c), y) for p, c, y in zip(*columns, strict=True)]


def assert_unpaired_as_trl(dataset, trainer, batch_size, seed=3):
    prepared = trainer.train_dataset
    expected = unpaired_of(prepared)
    assert dataset.examples == expected
    batches = PreferenceBatches(dataset, batch_size, seed, PAD)
    assert batches.kl_completions == [tuple(ids) for ids in prepared["KL_completion_ids"]]
    order = epoch_order(len(expected), seed)
    for step in range(batches.steps_per_epoch):
        indices = order[step * batch_size : (step + 1) * batch_size]
        theirs = trainer.data_collator([prepared[i] for i in indices])
        batch = batches.batch(step)
        assert torch.equal(batch["desirable"], theirs["label"])
        for ours_prefix, trl_prefix in (("", ""), ("kl_", "KL_")):
            ids, mask = f"{trl_prefix}input_ids", f"{trl_prefix}attention_mask"
            assert torch.equal(batch[f"{ours_prefix}input_ids"], theirs[ids])
            assert torch.equal(batch[f"{ours_prefix}attention_mask"], theirs[mask])
            assert torch.equal(batch[f"{ours_prefix}labels"], labels_of(theirs, trl_prefix))
        assert batches.num_tokens(step) == theirs["attention_mask"].sum()


# --- DPO: as DPOTrainer prepares and DataCollatorForPreference batches ------------------


@pytest.mark.parametrize("max_length", [None, 12])
def test_text_pairs_are_tokenized_and_batched_as_dpo_trainer(
    tokenizer, write_jsonl, tmp_path, max_length
):
    dataset = ours(TEXT_PAIRS, tokenizer, write_jsonl, "dpo", max_length)
    trainer = trl_trainer("dpo", TEXT_PAIRS, tokenizer, tmp_path, max_length)
    assert_pairs_as_trl(dataset, trainer, batch_size=2)
    assert dataset.format == "paired text"
    assert dataset.truncated == (0 if max_length is None else 4)


def test_conversational_pairs_are_tokenized_and_batched_as_dpo_trainer(
    tokenizer, write_jsonl, tmp_path
):
    dataset = ours(CHAT_PAIRS, tokenizer, write_jsonl, "dpo", 50)
    assert_pairs_as_trl(dataset, trl_trainer("dpo", CHAT_PAIRS, tokenizer, tmp_path, 50), 2)
    assert dataset.format == "paired conversational"
    assert dataset.truncated == 1


@pytest.mark.parametrize("rows", [IMPLICIT_TEXT_PAIRS, implicit(CHAT_PAIRS)], ids=["text", "chat"])
def test_a_prompt_inside_the_pair_is_extracted_as_dpo_trainer_does(
    tokenizer, write_jsonl, tmp_path, rows
):
    dataset = ours(rows, tokenizer, write_jsonl, "dpo")
    assert_pairs_as_trl(dataset, trl_trainer("dpo", rows, tokenizer, tmp_path), 2)


# --- KTO: as KTOTrainer prepares and DataCollatorForUnpairedPreference batches ----------


@pytest.mark.parametrize("max_length", [None, 8])
def test_unpaired_text_is_tokenized_and_batched_as_kto_trainer(
    tokenizer, write_jsonl, tmp_path, max_length
):
    dataset = ours(UNPAIRED_TEXT, tokenizer, write_jsonl, "kto", max_length)
    trainer = trl_trainer("kto", UNPAIRED_TEXT, tokenizer, tmp_path, max_length, batch_size=2)
    assert_unpaired_as_trl(dataset, trainer, batch_size=2)
    assert dataset.format == "unpaired text"


def test_unpaired_conversations_are_tokenized_and_batched_as_kto_trainer(
    tokenizer, write_jsonl, tmp_path
):
    rows = [
        {"prompt": user(r["prompt"]), "completion": assistant(r["completion"]), "label": r["label"]}
        for r in UNPAIRED_TEXT
    ]
    dataset = ours(rows, tokenizer, write_jsonl, "kto")
    trainer = trl_trainer("kto", rows, tokenizer, tmp_path, batch_size=3)
    assert_unpaired_as_trl(dataset, trainer, batch_size=3)
    assert dataset.format == "unpaired conversational"


@pytest.mark.parametrize("rows", [CHAT_PAIRS, implicit(CHAT_PAIRS)], ids=["explicit", "implicit"])
def test_kto_unpairs_pairs_as_kto_trainer(tokenizer, write_jsonl, tmp_path, rows):
    dataset = ours(rows, tokenizer, write_jsonl, "kto")
    assert_unpaired_as_trl(dataset, trl_trainer("kto", rows, tokenizer, tmp_path), 2)


def test_kto_unpairs_in_trls_batches_of_a_thousand_pairs(tokenizer, write_jsonl, tmp_path):
    count = UNPAIR_BATCH + 7
    rows = [{"prompt": f"{i}", "chosen": " yes", "rejected": f" no {i}"} for i in range(count)]
    dataset = ours(rows, tokenizer, write_jsonl, "kto", 32)
    prepared = trl_trainer("kto", rows, tokenizer, tmp_path, 32).train_dataset
    assert dataset.examples == unpaired_of(prepared)
    desirable = [e.desirable for e in dataset.examples]
    assert desirable == [True] * 1000 + [False] * 1000 + [True] * 7 + [False] * 7


def test_a_kl_row_pairs_a_prompt_with_the_previous_completion_of_its_chunk(tokenizer, write_jsonl):
    dataset = ours(UNPAIRED_TEXT, tokenizer, write_jsonl, "kto")
    completions = [e.completion_ids for e in dataset.examples]
    batches = PreferenceBatches(dataset, 2, seed=0, pad_id=PAD)
    assert batches.kl_completions == [completions[k] for k in (1, 0, 3, 2, 4)]


# --- refusals: one line naming the record ----------------------------------------------


def refusal(tokenizer, write_jsonl, rows, method="dpo", max_length=None, **options):
    with pytest.raises(DataError) as caught:
        ours(rows, tokenizer, write_jsonl, method, max_length, **options)
    message = str(caught.value)
    assert "\n" not in message
    return message


GOOD = {"prompt": "Hello", "chosen": " world.", "rejected": " fox."}


@pytest.mark.parametrize(
    "record, says",
    [
        ({"prompt": "Hi", "chosen": " fox.", "rejected": " fox."}, "are identical"),
        ({"chosen": "The fox.", "rejected": "The fox."}, "are identical"),
        (
            {"prompt": "Hi", "chosen": " fox.", "rejected": " fox.<|endoftext|>"},
            "tokenize to the same completion",
        ),
        ({"prompt": "Hi", "chosen": "", "rejected": " fox."}, '"chosen" is empty'),
        (
            {"prompt": user("Hi"), "chosen": [], "rejected": assistant("No.")},
            '"chosen" is an empty list',
        ),
        ({"chosen": "Hello fox.", "rejected": "Bye fox."}, "share no prompt"),
        ({"prompt": "Hi", "chosen": assistant("Yes."), "rejected": " no"}, "mixes text and"),
        ({"prompt": "Hi", "chosen": 3, "rejected": " no"}, '"chosen" must be a string'),
        ({"prompt": "Hi", "chosen": " yes"}, 'a pair lacks "rejected"'),
        (
            {"prompt": user("Hi"), "chosen": [{"content": "x"}], "rejected": assistant("No.")},
            '"chosen": message 1: "role" must be a string',
        ),
    ],
)
def test_a_bad_pair_is_refused_naming_its_line(tokenizer, write_jsonl, tmp_path, record, says):
    message = refusal(tokenizer, write_jsonl, [GOOD, record])
    assert message.startswith(f"{tmp_path / 'data.jsonl'}:2: ")
    assert says in message


def test_a_completion_that_adds_no_token_is_refused(write_jsonl):
    rows = [{"prompt": user("Hi"), "chosen": assistant("Yes."), "rejected": assistant("No.")}]
    message = refusal(make_tokenizer(chat_template=USER_ONLY), write_jsonl, rows)
    assert 'data.jsonl:1: "chosen" adds no token after the prompt' in message


@pytest.mark.parametrize("method", ["dpo", "kto"])
def test_a_prompt_that_fills_max_length_is_refused(tokenizer, write_jsonl, method):
    rows = [GOOD, {"prompt": "The quick brown fox jumps", "chosen": " a", "rejected": " b"}]
    prompt = len(tokenizer("The quick brown fox jumps")["input_ids"])
    message = refusal(tokenizer, write_jsonl, rows, method, max_length=prompt)
    assert message.endswith(
        f"data.jsonl:2: its prompt has {prompt} tokens, --seq-len (--max_length) is {prompt}: "
        "raise it or shorten the prompt"
    )
    assert len(ours(rows, tokenizer, write_jsonl, method, prompt + 1).examples) > 1


@pytest.mark.parametrize("label", [True, False])
def test_kto_refuses_a_set_of_one_kind(tokenizer, write_jsonl, label):
    rows = [{**row, "label": label} for row in UNPAIRED_TEXT]
    message = refusal(tokenizer, write_jsonl, rows, "kto")
    assert f"all 5 examples are {'desirable' if label else 'undesirable'}" in message
    assert "KTO needs both" in message


@pytest.mark.parametrize(
    "record, hint",
    [
        ({"text": "Hello world."}, "--method sft"),
        ({"prompt": "Hi", "completion": " there"}, "--method sft"),
        ({"messages": user("Hi") + assistant("Hello.")}, "--method sft"),
        ({"prompt": "Hi", "completion": " there", "label": True}, "--method kto"),
    ],
)
def test_dpo_refuses_data_without_pairs_naming_the_fields(
    tokenizer, write_jsonl, tmp_path, record, hint
):
    message = refusal(tokenizer, write_jsonl, [record])
    assert message.startswith(f"{tmp_path / 'data.jsonl'}:1: ")
    assert '--method dpo needs "chosen" and "rejected"' in message
    assert ", ".join(f'"{key}"' for key in sorted(record)) in message
    assert hint in message


KTO_NEEDS = '--method kto needs "prompt", "completion" and "label"'


@pytest.mark.parametrize(
    "record, says",
    [
        ({"text": "Hello."}, KTO_NEEDS),
        ({"prompt": "Hi", "completion": " there"}, KTO_NEEDS),
        ({"prompt": "Hi", "completion": " there", "label": None}, KTO_NEEDS),
        ({"prompt": "Hi", "completion": " x", "label": "true"}, '"label" must be true or false'),
        ({"prompt": "Hi", "completion": " x", "label": 1}, '"label" must be true or false'),
        ({**GOOD, "completion": " x", "label": True}, "has both a pair"),
        ({"prompt": "Hi", "rejected": " x"}, 'a pair lacks "chosen"'),
    ],
)
def test_a_bad_kto_record_is_refused_naming_its_line(
    tokenizer, write_jsonl, tmp_path, record, says
):
    message = refusal(tokenizer, write_jsonl, [UNPAIRED_TEXT[0], record], "kto")
    assert message.startswith(f"{tmp_path / 'data.jsonl'}:2: {says}")


def test_a_source_of_two_formats_is_refused(tokenizer, write_jsonl):
    chat = {"prompt": user("Hi"), "chosen": assistant("Yes."), "rejected": assistant("No.")}
    message = refusal(tokenizer, write_jsonl, [GOOD, chat])
    assert "data.jsonl:2: a paired conversational line" in message
    assert "(1) is paired text" in message


def test_chat_pairs_need_a_chat_template(write_jsonl):
    message = refusal(make_tokenizer(chat_template=None), write_jsonl, CHAT_PAIRS)
    assert "holds chat data (paired conversational) but the tokenizer has no chat template" in (
        message
    )


# --- columns of other names -------------------------------------------------------------


def test_data_fields_map_columns_to_the_preference_fields(tokenizer, write_jsonl):
    renamed = [{"q": r["prompt"], "good": r["chosen"], "bad": r["rejected"]} for r in TEXT_PAIRS]
    fields = "prompt=q,chosen=good,rejected=bad"
    mapped = ours(renamed, tokenizer, write_jsonl, "dpo", fields=fields)
    assert mapped.examples == ours(TEXT_PAIRS, tokenizer, write_jsonl, "dpo").examples


@pytest.mark.parametrize(
    "fields, says",
    [
        ("answer=a", "unknown field 'answer'"),
        ("chosen", "is not FIELD=COLUMN"),
        ("label=y", "no column 'y'"),
    ],
)
def test_bad_data_fields_are_refused(tokenizer, write_jsonl, fields, says):
    assert says in refusal(tokenizer, write_jsonl, TEXT_PAIRS, fields=fields)


# --- batches: a pure function of data, seed and step -----------------------------------


@pytest.mark.parametrize("method", ["dpo", "kto"])
def test_batches_are_a_function_of_the_step_alone(tokenizer, write_jsonl, method):
    dataset = ours(TEXT_PAIRS, tokenizer, write_jsonl, method)
    first, second = (PreferenceBatches(dataset, 3, 7, PAD) for _ in range(2))
    steps = range(3 * first.steps_per_epoch)
    forward = [first.batch(step) for step in steps]
    backward = [second.batch(step) for step in reversed(steps)][::-1]
    for one, other in zip(forward, backward, strict=True):
        assert one.keys() == other.keys()
        assert all(torch.equal(one[key], other[key]) for key in one)


def test_each_epoch_visits_every_example_once_in_its_own_order(tokenizer, write_jsonl):
    dataset = ours(UNPAIRED_TEXT, tokenizer, write_jsonl, "kto")
    batches = PreferenceBatches(dataset, 2, seed=5, pad_id=PAD)
    assert batches.steps_per_epoch == 3
    for epoch in range(2):
        seen = [
            row.tolist()
            for step in range(3 * epoch, 3 * epoch + 3)
            for row in batches.batch(step)["input_ids"]
        ]
        expected = [
            list(dataset.examples[i].prompt_ids + dataset.examples[i].completion_ids)
            for i in epoch_order(5, 5, epoch)
        ]
        assert [row[: len(want)] for row, want in zip(seen, expected, strict=True)] == expected


# --- held-out records --------------------------------------------------------------------


def test_held_out_records_are_split_as_sft_splits_them(tokenizer, write_jsonl):
    path = write_jsonl(TEXT_PAIRS)
    sft = write_jsonl([{"text": f"{i} {r['prompt']}"} for i, r in enumerate(TEXT_PAIRS)], "s.jsonl")
    train, held = load_preference_held_out(path, tokenizer, None, "dpo", 0.4, 11)
    sft_sides = load_held_out(sft, tokenizer, 64, 0.4, 11)
    everything = load_preference_dataset(path, tokenizer, None, "dpo").examples
    sft_everything = load_dataset(sft, tokenizer, 64).examples
    for side, sft_side in zip((train, held), sft_sides, strict=True):
        records = [everything.index(example) for example in side.examples]
        assert records == [sft_everything.index(example) for example in sft_side.examples]
    assert len(held.examples) == 2
    assert held.path.endswith("(held out)")


def test_kto_held_out_keeps_a_pair_on_one_side(tokenizer, write_jsonl):
    rows = [{"prompt": f"{i}", "chosen": " yes", "rejected": " no"} for i in range(10)]
    train, held = load_preference_held_out(write_jsonl(rows), tokenizer, None, "kto", 0.3, 2)
    for side in (train, held):
        prompts = [e.prompt_ids for e in side.examples]
        assert all(prompts.count(prompt) == 2 for prompt in prompts)
    assert (len(train.examples), len(held.examples)) == (14, 6)


def test_an_eval_split_that_leaves_a_side_empty_is_refused(tokenizer, write_jsonl):
    with pytest.raises(DataError, match="each side needs at least one"):
        load_preference_held_out(write_jsonl(TEXT_PAIRS), tokenizer, None, "dpo", 0.01, 0)
