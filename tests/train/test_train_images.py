"""``roundpipe train`` on TRL's vision chat format: ``messages`` with ``{"type": "image"}``
parts and an ``images`` column, on a tiny Qwen3.5 VLM saved with its image processor.

Oracles: the processor's own rule (each image token of the rendered template stood for
by ``t*h*w / merge**2`` tokens, the pixels the image processor's), and the transformers
model on the batch: the pipe's loss and every gradient, and the first step's loss of a
real run over the whole data set.
"""

from __future__ import annotations

import json
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

from support.hf_families import assert_trains_as_hf  # noqa: E402
from support.train_cli import metrics, run_train  # noqa: E402
from support.vision_fixtures import (  # noqa: E402
    MERGE,
    image_processor,
    vision_model_dir,
    write_vision_data,
)

from roundpipe import RoundPipeRunConfig  # noqa: E402
from roundpipe.train.batches import Batches  # noqa: E402
from roundpipe.train.data import DataError, load_dataset  # noqa: E402
from roundpipe.train.images import ImageReader  # noqa: E402

RECORDS = 6


@pytest.fixture(scope="module")
def vision(tmp_path_factory) -> types.SimpleNamespace:
    root = tmp_path_factory.mktemp("vision")
    model = vision_model_dir(root / "model")
    (root / "data").mkdir()
    data = write_vision_data(root / "data" / "chat.jsonl", RECORDS)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    config = transformers.AutoConfig.from_pretrained(model)
    return types.SimpleNamespace(root=root, model=model, data=data, tokenizer=tokenizer,
                                 config=config)  # fmt: skip


def _dataset(vision, path=None, seq_len=96):
    reader = ImageReader(vision.model, vision.config)
    return load_dataset(path or vision.data, vision.tokenizer, seq_len, images=reader)


def _whole_batch(vision) -> dict:
    dataset = _dataset(vision)
    return Batches(dataset, batch_size=len(dataset.examples), seed=0, pad_id=0).batch(0)


def test_image_tokens_and_pixels_are_the_processors(vision):
    from PIL import Image

    dataset = _dataset(vision)
    assert len(dataset.examples) == RECORDS
    processor = image_processor()
    pad = "<|image_pad|>"
    token = vision.tokenizer.convert_tokens_to_ids(pad)
    lines = vision.data.read_text().splitlines()
    for example, line in zip(dataset.examples, lines, strict=True):
        record = json.loads(line)
        text = vision.tokenizer.apply_chat_template(record["messages"], tokenize=False)
        images = [Image.open(vision.data.parent / name).convert("RGB") for name in record["images"]]
        pieces = text.split(pad)  # the processor's rule: each pad stands for its grid's tokens
        expanded = pieces[0]
        if images:
            grids = processor(images=images, return_tensors="pt")["image_grid_thw"]
            for grid, piece in zip(grids, pieces[1:], strict=True):
                expanded += pad * (int(grid.prod()) // MERGE**2) + piece
            assert example.grids == tuple(tuple(map(int, g)) for g in grids)
        ids = vision.tokenizer(expanded, add_special_tokens=False)["input_ids"]
        assert list(example.input_ids) == ids
        labelled = [i for i, label in zip(ids, example.labels, strict=True) if label != -100]
        assert token not in labelled and labelled  # images never carry loss; answers do
        answer = record["messages"][1]["content"][0]["text"]
        answer_ids = vision.tokenizer(answer, add_special_tokens=False)["input_ids"]
        assert labelled[: len(answer_ids)] == answer_ids
    batches = Batches(dataset, batch_size=RECORDS, seed=0, pad_id=0)
    batch = batches.batch(0)
    rows = batches._examples_of(0)  # the epoch's shuffled order: images go in row order
    opened = [Image.open(path).convert("RGB") for row in rows for path in row.images]
    want = processor(images=opened, return_tensors="pt")
    torch.testing.assert_close(batch["pixel_values"], want["pixel_values"], rtol=0, atol=0)
    assert torch.equal(batch["image_grid_thw"], want["image_grid_thw"])
    assert torch.equal(batch["mm_token_type_ids"], (batch["input_ids"] == token).int())


def test_a_batch_of_the_data_trains_as_the_transformers_model(vision):
    model = transformers.AutoModelForImageTextToText.from_pretrained(vision.model)
    assert_trains_as_hf(model, _whole_batch(vision), RoundPipeRunConfig(num_microbatch=4))


def test_the_train_command_reads_images_and_its_first_loss_is_the_models(vision):
    output = vision.root / "run"
    done = run_train(
        "--model", vision.model, "--data", vision.data, "--output", output, "--steps", "2",
        "--batch-size", str(RECORDS), "--seq-len", "96", "--devices", "emulated:2",
        "--microbatches", "3", "--lr", "1e-3",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    model = transformers.AutoModelForImageTextToText.from_pretrained(vision.model)
    with torch.no_grad():  # LoRA starts as the identity: step 1 is the base model's loss
        want = model(**_whole_batch(vision), use_cache=False).loss
    losses = [row["loss"] for row in metrics(output) if "loss" in row]
    assert len(losses) == 2
    assert losses[0] == pytest.approx(float(want), rel=1e-5)


@pytest.mark.parametrize(
    "record, message",
    [
        ({"images": ["a.png"]}, r'hold 0 image part\(s\).*"images" has 1'),
        ({"images": ["missing.png"], "parts": 1}, "no such file"),
        ({"images": 3, "parts": 1}, '"images" must be a list'),
    ],
)
def test_bad_vision_records_are_refused_naming_the_line(vision, tmp_path, record, message):
    from PIL import Image

    Image.new("RGB", (28, 28)).save(tmp_path / "a.png")
    parts = [{"type": "image"}] * record.pop("parts", 0) + [{"type": "text", "text": "hi"}]
    bad = {"messages": [{"role": "user", "content": parts},
                        {"role": "assistant", "content": "1 2"}], **record}  # fmt: skip
    path = tmp_path / "bad.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "1"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(DataError, match=rf"bad.jsonl:2: .*{message}"):
        _dataset(vision, path)


def test_images_a_sequence_cannot_hold_are_refused_not_cut(vision):
    with pytest.raises(DataError, match="image tokens cannot be cut; raise --seq-len"):
        _dataset(vision, seq_len=12)


def test_packing_images_and_a_text_model_with_images_exit_2(vision, train_files):
    packed = run_train("--model", vision.model, "--data", vision.data, "--output",
                       vision.root / "packed", "--packing", "--steps", "1")  # fmt: skip
    assert packed.returncode == 2 and "--packing with images" in packed.stderr
    text = run_train("--model", train_files["model"], "--data", vision.data, "--output",
                     vision.root / "text", "--steps", "1")  # fmt: skip
    assert text.returncode == 2 and "is a text model (no vision tower)" in text.stderr
