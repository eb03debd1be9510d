"""``roundpipe train`` data from where users keep it: JSONL, a JSON array, CSV, Parquet,
a ``datasets`` ``save_to_disk`` directory, a local directory of data files, a hub
dataset id (offline, from the ``datasets`` cache a download leaves), several sources at
once, and ``--eval-split``.

Every source gives the examples its rows give as JSONL lines (the oracle: the same
records through the JSONL reader; the tables written by ``datasets`` itself); errors
name the file and line where the source has lines, else the row. Formats:
``test_train_data_formats.py``.
"""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
torch = pytest.importorskip("torch")

from support.train_data import cache_hub_dataset, isolate_datasets  # noqa: E402

from roundpipe.train.data import DataError, load_dataset, load_held_out  # noqa: E402
from roundpipe.train.sources import resolve_sources  # noqa: E402

ROWS = [
    {"prompt": "What is two plus three?", "completion": " Five."},
    {"prompt": "Hello", "completion": " world"},
    {"prompt": "The quick brown fox", "completion": " jumps over the lazy dog."},
]


@pytest.fixture(autouse=True)
def offline_datasets(monkeypatch, tmp_path):
    """``datasets`` offline, with its cache in the test's directory."""
    return isolate_datasets(monkeypatch, tmp_path)


@pytest.fixture
def from_jsonl(tokenizer, write_jsonl):
    """The examples of ``rows`` written as JSONL lines: what every source must give."""
    return lambda rows: load_dataset(write_jsonl(rows, "oracle.jsonl"), tokenizer, 64).examples


# --- each kind of source ----------------------------------------------------------------


def test_a_json_array_reads_like_the_same_records_as_lines(tokenizer, tmp_path, from_jsonl):
    path = tmp_path / "data.json"
    path.write_text(json.dumps(ROWS, indent=2))
    dataset = load_dataset(path, tokenizer, 64)
    assert dataset.format == "prompt_completion"
    assert dataset.examples == from_jsonl(ROWS)


def test_a_json_file_of_lines_is_read_as_jsonl(tokenizer, tmp_path, from_jsonl):
    path = tmp_path / "data.json"
    path.write_text("\n".join(map(json.dumps, ROWS)))
    assert load_dataset(path, tokenizer, 64).examples == from_jsonl(ROWS)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[\n  {"text": "a"},\n  {"text": 3}\n]', ':3 (element 2): "text" must be a string'),
        ('[\n  {"text": "a"},\n  [1]\n]', ":3 (element 2): expected a JSON object, got list"),
        ('[\n  {"text": "a"},\n  {"text": oops}\n]', ":3: not valid JSON"),
        ('[\n  {"text": "a"}\n  {"text": "b"}\n]', ":3: not valid JSON: expected ','"),
        ('[{"text": "a"}', ":1: not valid JSON: expected ','"),
        ('[{"text": "a"}] {}', ": not valid JSON: the array does not end"),
    ],
)
def test_a_bad_json_array_element_is_named_with_its_line(tokenizer, tmp_path, text, expected):
    path = tmp_path / "data.json"
    path.write_text(text)
    with pytest.raises(DataError) as caught:
        load_dataset(path, tokenizer, 64)
    assert str(caught.value).startswith(f"{path}{expected}"), caught.value


def test_csv_cells_stay_text_and_a_bad_record_is_named_by_its_line(tokenizer, tmp_path):
    path = tmp_path / "data.csv"
    path.write_text('prompt,completion\nHow many?,42\n"two\nlines",1.50\n')
    dataset = load_dataset(path, tokenizer, 64)
    assert [tokenizer.decode(e.input_ids) for e in dataset.examples] == [
        "How many?42<|endoftext|>",
        "two\nlines1.50<|endoftext|>",
    ]
    path.write_text('prompt,completion\n"two\nlines",a\n\nHello,world,extra\n')
    with pytest.raises(DataError, match=f"{path}:5: 3 fields where the header has 2"):
        load_dataset(path, tokenizer, 64)


def test_a_csv_header_naming_a_column_twice_is_refused_and_long_cells_are_read(
    tokenizer, tmp_path, from_jsonl
):
    path = tmp_path / "data.csv"
    path.write_text("prompt,completion,prompt\na,b,c\n")
    with pytest.raises(DataError, match=f"{path}:1: the header names the column 'prompt' twice"):
        load_dataset(path, tokenizer, 64)
    long = "word " * 40_000  # 200 KB, past the csv module's 128 KiB default
    path.write_text(f'prompt,completion\na,"{long}"\n')
    assert load_dataset(path, tokenizer, 64).truncated == 1


def test_a_csv_that_is_not_utf8_is_named_by_its_line(tokenizer, tmp_path):
    path = tmp_path / "data.csv"
    path.write_bytes("prompt,completion\nfine,ok\ncaf\u00e9,x\n".encode("latin-1"))
    with pytest.raises(DataError, match=f"{path}:3: not UTF-8 text"):
        load_dataset(path, tokenizer, 64)


def test_a_directory_of_data_files_in_several_formats_is_refused_naming_them(tokenizer, tmp_path):
    directory = tmp_path / "mixed"
    directory.mkdir()
    (directory / "train.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    (directory / "extra.csv").write_text("prompt,completion\na,b\n")
    with pytest.raises(DataError, match="holds data files of 2 formats \\(extra.csv, train.jsonl"):
        load_dataset(directory, tokenizer, 64)


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_lone_surrogate_or_a_record_nested_too_deep_is_one_line(tokenizer, tmp_path, suffix):
    path = tmp_path / f"data{suffix}"
    good = json.dumps(ROWS[0])
    for bad, message in [
        ('{"text": "a \\ud800 b"}', r"holds \\ud800, a lone surrogate"),
        ('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ]:
        path.write_text(f"[{good},\n{bad}]" if suffix == ".json" else f"{good}\n{bad}\n")
        with pytest.raises(DataError, match=f"{path}:2: .*{message}"):
            load_dataset(path, tokenizer, 64)


def test_a_parquet_file_reads_like_the_same_records_as_lines(tokenizer, tmp_path, from_jsonl):
    path = tmp_path / "data.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(str(path))
    assert load_dataset(path, tokenizer, 64).examples == from_jsonl(ROWS)


def test_a_bad_table_row_is_named_by_its_row(tokenizer, tmp_path):
    path = tmp_path / "data.parquet"
    datasets.Dataset.from_list([{"text": "Hello"}, {"text": None}]).to_parquet(str(path))
    with pytest.raises(DataError, match=f"{path}: row 2: no fields of a known format"):
        load_dataset(path, tokenizer, 64)


def test_a_parquet_file_that_datasets_cannot_read_is_named(tokenizer, tmp_path):
    path = tmp_path / "data.parquet"
    path.write_text("not parquet")
    with pytest.raises(DataError, match=f"{path} \\(read as a local file or directory\\): "):
        load_dataset(path, tokenizer, 64)


def test_a_save_to_disk_dataset_and_the_split_of_a_saved_dataset_dict(
    tokenizer, tmp_path, from_jsonl
):
    single = tmp_path / "single"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(single))
    assert load_dataset(single, tokenizer, 64).examples == from_jsonl(ROWS)
    splits = tmp_path / "splits"
    parts = {"train": ROWS[:2], "test": ROWS[2:]}
    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in parts.items()}).save_to_disk(
        str(splits)
    )
    assert load_dataset(splits, tokenizer, 64).examples == from_jsonl(ROWS[:2])
    assert load_dataset(splits, tokenizer, 64, split="test").examples == from_jsonl(ROWS[2:])
    with pytest.raises(DataError, match="no split 'validation' \\(its splits: train, test\\)"):
        load_dataset(splits, tokenizer, 64, split="validation")


def test_a_local_directory_of_data_files_is_loaded_by_datasets(tokenizer, tmp_path, from_jsonl):
    directory = tmp_path / "repo"
    (directory / "data").mkdir(parents=True)
    datasets.Dataset.from_list(ROWS[:2]).to_parquet(str(directory / "data" / "train.parquet"))
    datasets.Dataset.from_list(ROWS[2:]).to_parquet(str(directory / "data" / "test.parquet"))
    assert load_dataset(directory, tokenizer, 64).examples == from_jsonl(ROWS[:2])
    assert load_dataset(directory, tokenizer, 64, split="test").examples == from_jsonl(ROWS[2:])


def test_a_hub_dataset_id_loads_offline_from_the_datasets_cache(
    tokenizer, offline_datasets, from_jsonl
):
    cache_hub_dataset(offline_datasets, "someone/tiny-sft", {"train": ROWS[:2], "test": ROWS[2:]})
    assert load_dataset("someone/tiny-sft", tokenizer, 64).examples == from_jsonl(ROWS[:2])
    test = load_dataset("someone/tiny-sft", tokenizer, 64, split="test")
    assert test.examples == from_jsonl(ROWS[2:])
    assert test.sources[0].label == "someone/tiny-sft (split test)"


def test_a_hub_id_that_cannot_be_loaded_is_named_with_the_reason(tokenizer):
    with pytest.raises(DataError, match="someone/absent \\(read as a hub dataset id\\): .*Hub"):
        load_dataset("someone/absent", tokenizer, 64)


@pytest.mark.parametrize("name", ["train.jsonl", "data/train.csv", "./data", "a/b/c"])
def test_a_missing_file_is_not_taken_for_a_hub_id(tokenizer, tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match="cannot read the data file"):
        load_dataset(name, tokenizer, 64)


def test_the_datasets_package_is_needed_only_for_its_sources(
    tokenizer, tmp_path, monkeypatch, write_jsonl
):
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    assert load_dataset(write_jsonl([{"text": "Hello"}]), tokenizer, 64).examples
    with pytest.raises(DataError, match="needs the datasets package: pip install"):
        load_dataset("someone/tiny-sft", tokenizer, 64)


# --- several sources ----------------------------------------------------------------------


def test_several_sources_are_read_in_order_each_in_its_own_format(tokenizer, tmp_path, write_jsonl):
    text = write_jsonl([{"text": "Hello world"}], "text.jsonl")
    alpaca = tmp_path / "alpaca.csv"
    alpaca.write_text("instruction,input,output\nSay hello,,Hello\n")
    dataset = load_dataset(f"{text},{alpaca}", tokenizer, 64)
    pair = write_jsonl([{"prompt": "Say hello", "completion": "Hello"}])
    assert dataset.examples == [
        *load_dataset(text, tokenizer, 64).examples,
        *load_dataset(pair, tokenizer, 64).examples,
    ]
    assert dataset.format == "text+prompt_completion"
    assert [(s.label, s.format) for s in dataset.sources] == [
        ("text.jsonl", '"text"'),
        ("alpaca.csv", 'Alpaca ("instruction"+"output")'),
    ]


def test_truncated_and_dropped_examples_are_counted_by_source(tokenizer, write_jsonl):
    long = write_jsonl(
        [{"text": "The quick brown fox jumps over the lazy dog. " * 3}], "long.jsonl"
    )
    empty = write_jsonl([{"prompt": "Hello", "completion": ""}], "empty.jsonl")
    dataset = load_dataset(f"{long},{empty}", tokenizer, 12)
    counts = [(s.label, s.examples, s.truncated, s.dropped) for s in dataset.sources]
    assert counts == [("long.jsonl", 1, 1, 0), ("empty.jsonl", 0, 0, 1)]


def test_local_sources_become_absolute_and_hub_ids_stay_as_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n')
    assert resolve_sources("a.jsonl, org/name") == f"{tmp_path / 'a.jsonl'},org/name"
    with pytest.raises(DataError, match="an empty source between commas"):
        resolve_sources("a.jsonl,,b.jsonl")


# --- --eval-split -------------------------------------------------------------------------


def test_eval_split_holds_out_the_seeded_permutations_first_share(tokenizer, write_jsonl):
    rows = [{"text": f"Hello {n}"} for n in range(10)]
    path = write_jsonl(rows)
    train, held = load_held_out(path, tokenizer, 64, 0.3, seed=5)
    order = torch.randperm(10, generator=torch.Generator().manual_seed(5)).tolist()
    held_rows = sorted(order[:3])  # round(0.3 * 10), kept in the data's order
    each = [
        load_dataset(write_jsonl([row], "one.jsonl"), tokenizer, 64).examples[0] for row in rows
    ]
    assert held.examples == [each[i] for i in held_rows]
    assert train.examples == [each[i] for i in range(10) if i not in held_rows]
    again = load_held_out(path, tokenizer, 64, 0.3, seed=5)  # what a resumed run sees
    assert (again[0].examples, again[1].examples) == (train.examples, held.examples)
    other = load_held_out(path, tokenizer, 64, 0.3, seed=6)[1]
    assert other.examples != held.examples


def test_eval_split_spans_all_sources_and_names_the_held_out_part(tokenizer, write_jsonl):
    a = write_jsonl([{"text": f"Hello {n}"} for n in range(4)], "a.jsonl")
    b = write_jsonl([{"prompt": f"Hi {n}", "completion": " there"} for n in range(4)], "b.jsonl")
    train, held = load_held_out(f"{a},{b}", tokenizer, 64, 0.5, seed=0)
    assert len(train.examples) == len(held.examples) == 4
    assert {s.label for s in held.sources} <= {"a.jsonl (held out)", "b.jsonl (held out)"}


@pytest.mark.parametrize("fraction", [0.01, 0.99])
def test_eval_split_needs_a_record_on_each_side(tokenizer, write_jsonl, fraction):
    path = write_jsonl([{"text": "Hello"}, {"text": "world"}, {"text": "fox"}])
    with pytest.raises(DataError, match=f"--eval-split {fraction}: holds out . of the 3 records"):
        load_held_out(path, tokenizer, 64, fraction, seed=0)
