"""The data options of ``roundpipe train``: ``--data`` and ``--eval-data`` sources,
``--data-split``, ``--data-fields``, ``--eval-split`` and ``--train-on-prompt``, from
the options to the batches (``preflight.prepare``) and in a real run.

The data itself: ``test_train_data_sources.py`` and ``test_train_data_formats.py``.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("yaml")
datasets = pytest.importorskip("datasets")

from support.train_cli import COMMON, metrics  # noqa: E402
from support.train_data import cache_hub_dataset, isolate_datasets  # noqa: E402

from roundpipe.cli import main  # noqa: E402
from roundpipe.train.options import UsageError, resolve  # noqa: E402
from roundpipe.train.preflight import prepare  # noqa: E402

HUB_ID = "someone/counting"


@pytest.fixture
def hub_counting(monkeypatch, tmp_path, train_files) -> str:
    """The prompt+completion training data as a cached hub dataset, with the columns
    ``question`` and ``answer``; -> its id."""
    cache = isolate_datasets(monkeypatch, tmp_path)
    lines = train_files["prompt_completion"].read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    renamed = [{"question": row["prompt"], "answer": row["completion"]} for row in rows]
    cache_hub_dataset(cache, HUB_ID, {"train": renamed})
    return HUB_ID


def options(train_files, tmp_path, **given):
    return resolve(
        {"model": train_files["model"], "output": tmp_path / "out", "seq_len": 32} | given
    )


def test_a_hub_dataset_with_other_column_names_and_a_held_out_share(
    train_files, tmp_path, hub_counting
):
    prepared = prepare(
        options(
            train_files,
            tmp_path,
            data=hub_counting,
            data_fields="prompt=question,completion=answer",
            eval_split=0.25,
            eval_every=2,
        )
    )
    assert prepared.options.data == HUB_ID  # kept as given: run.yaml and --resume see it
    assert len(prepared.eval_batches.examples) == 12  # round(0.25 * 48)
    assert len(prepared.train_batches.examples) == 36
    assert "--eval-split 0.25: 12 examples held out for evaluation, 36 to train on (seed 0)" in (
        prepared.notes
    )
    local = prepare(options(train_files, tmp_path, data=train_files["prompt_completion"]))
    every = Counter(e.input_ids for e in local.train_batches.examples)
    held = Counter(e.input_ids for e in prepared.eval_batches.examples)
    trained = Counter(e.input_ids for e in prepared.train_batches.examples)
    assert held + trained == every


def test_train_on_prompt_labels_every_token_but_the_first(train_files, tmp_path):
    data = train_files["messages"]
    prepared = prepare(options(train_files, tmp_path, data=data, train_on_prompt=True))
    assert all(e.labels == (-100, *e.input_ids[1:]) for e in prepared.train_batches.examples)
    plain = prepare(options(train_files, tmp_path, data=data))
    assert all(e.labels != (-100, *e.input_ids[1:]) for e in plain.train_batches.examples)


def test_local_sources_become_absolute_and_several_are_read(train_files, tmp_path, monkeypatch):
    monkeypatch.chdir(train_files["root"])
    given = options(train_files, tmp_path, data="text.jsonl,prompt_completion.jsonl")
    prepared = prepare(given)
    root = train_files["root"]
    assert prepared.options.data == f"{root / 'text.jsonl'},{root / 'prompt_completion.jsonl'}"
    assert len(prepared.train_batches.examples) == 96


def test_the_notes_name_each_source_that_was_truncated(train_files, tmp_path):
    data = f"{train_files['text']},{train_files['prompt_completion']}"
    notes = prepare(options(train_files, tmp_path, data=data, seq_len=8)).notes
    assert [note for note in notes if "truncated" in note] == [
        f"{name}: 48 of 48 examples truncated to 8 tokens"
        for name in ("text.jsonl", "prompt_completion.jsonl")
    ]


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"eval_split": 0.2, "eval_data": "held-out.jsonl"}, "not both"),
        ({"eval_split": 0.0}, "--eval-split must be a fraction in (0, 1), got 0.0"),
        ({"eval_split": 1.0}, "--eval-split must be a fraction in (0, 1), got 1.0"),
        ({"eval_every": 3}, "--eval-every needs --eval-data or --eval-split"),
    ],
)
def test_eval_options_that_contradict_are_refused(given, message):
    with pytest.raises(UsageError, match=message.replace("(", "\\(").replace(")", "\\)")):
        resolve({"model": "m", "data": "d.jsonl", "output": "o", **given})


def test_bad_data_options_exit_2_naming_them(train_files, tmp_path, capfd):
    cases = {
        "--data-fields": ("answer=completion", "--data-fields 'answer=completion': unknown"),
        "--data-split": ("validation", "no split 'validation'"),
    }
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"text": "a"}])}).save_to_disk(
        str(saved)
    )
    capfd.readouterr()  # the progress bar of save_to_disk
    for flag, (value, message) in cases.items():
        args = ["--model", train_files["model"], "--data", saved, "--output", tmp_path / "out"]
        with pytest.raises(SystemExit) as exit_info:
            main(["train", *map(str, args), flag, value])
        assert exit_info.value.code == 2
        err = capfd.readouterr().err
        assert message in err and len(err.splitlines()) == 1, err


def test_a_run_evaluates_on_its_held_out_share(train_files, tmp_path, hub_counting, capsys):
    output = tmp_path / "run"
    args = ["--model", train_files["model"], "--data", hub_counting, "--output", output,
            "--data-fields", "prompt=question,completion=answer", "--eval-split", "0.25",
            "--eval-every", "2", "--steps", "4", *COMMON]  # fmt: skip
    main(["train", *map(str, args)])
    assert "12 examples held out" in capsys.readouterr().out
    assert [r["step"] for r in metrics(output) if "eval_loss" in r] == [2, 4]
