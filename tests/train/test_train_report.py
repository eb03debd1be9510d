"""What ``loss.png`` shows: the run in its title, the loss on a log scale (evaluation
loss beside it), and the learning rate in a panel below, against the step."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from roundpipe.train.report import loss_figure, plot_losses  # noqa: E402

ROWS = [
    {"step": 1, "loss": 2.5, "lr": 1e-4, "eval_loss": 2.6},
    {"step": 2, "loss": 1.5, "lr": 2e-4},
    {"step": 3, "loss": 0.7, "lr": 1e-4, "eval_loss": 0.9},
]


def test_the_plot_is_titled_by_the_run_with_a_log_loss_and_the_lr_below():
    from matplotlib import pyplot as plt

    figure = loss_figure(ROWS, "out: tiny, LoRA r16")
    try:
        losses, rates = figure.axes
        assert losses.get_title() == "out: tiny, LoRA r16"
        assert losses.get_yscale() == "log"
        assert [line.get_label() for line in losses.get_lines()] == ["training loss", "eval loss"]
        assert rates.get_ylabel() == "learning rate"
        assert list(rates.get_lines()[0].get_ydata()) == [1e-4, 2e-4, 1e-4]
        assert rates.get_xlabel() == "step"
    finally:
        plt.close(figure)


def test_a_loss_at_or_below_zero_keeps_a_linear_axis(tmp_path):
    from matplotlib import pyplot as plt

    figure = loss_figure([{"step": 1, "loss": 0.0, "lr": 1e-4}])
    try:
        assert figure.axes[0].get_yscale() == "linear"
    finally:
        plt.close(figure)
    plot_losses(ROWS, tmp_path / "loss.png", "run")
    assert (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG")


def test_an_epoch_run_shows_its_epoch_on_each_line():
    from roundpipe.train.progress import StepReport, describe

    by_epoch = describe(StepReport(3, 1.25, 1e-4, 900.0, epoch=0.5), total=12)
    assert by_epoch.startswith("epoch 0.50  step 3/12  loss 1.2500")
    assert describe(StepReport(3, 1.25, 1e-4, 900.0), total=12).startswith("step 3/12")


def test_the_start_tells_examples_tokens_packing_and_shows_an_example_as_trained(tmp_path):
    from support.train_fixtures import build_tokenizer, write_data

    from roundpipe.train.batches import Batches
    from roundpipe.train.data import load_dataset
    from roundpipe.train.data_summary import data_summary

    tokenizer = build_tokenizer()
    path = write_data(tmp_path / "pc.jsonl", "prompt_completion", lines=10)
    dataset = load_dataset(path, tokenizer, 32)
    batches = Batches(dataset, batch_size=2, seed=0, packing=True, pad_id=0)
    lines = data_summary(dataset, batches, tokenizer)
    tokens = sum(len(e.input_ids) for e in dataset.examples)
    trained = sum(e.num_label_tokens for e in dataset.examples)
    assert lines[0] == (
        f'training data pc.jsonl ("prompt"+"completion"): 10 examples, {tokens} tokens, '
        f"{trained} with a loss"
    )
    windows = len(batches.rows)
    assert lines[1] == (
        f"packed into {windows} windows of 32 tokens, {tokens / (windows * 32):.0%} filled"
    )
    first = dataset.examples[0]
    trained = zip(first.input_ids, first.labels, strict=True)
    answer = tokenizer.decode([t for t, label in trained if label != -100])
    shown = lines[2].split("\n", 1)[1]
    assert shown.count("[[") == 1 and shown.split("[[")[1].split("]]")[0] == answer
    assert shown.startswith("count from")


@pytest.mark.parametrize(
    "steps, epochs, says",
    [
        (10, None, "all 10 steps are done (step-10) and the LoRA adapter is written; nothing "
                   "to do (raise --steps to train further)"),
        (None, 2.5, "all 2.5 epochs (10 steps) are done (step-10) and the LoRA adapter "
                    "is written; nothing to do (raise --epochs to train further)"),
    ],
)  # fmt: skip
def test_a_finished_run_says_which_option_trains_further(steps, epochs, says, tmp_path, capsys):
    from pathlib import Path
    from types import SimpleNamespace

    from roundpipe.train.command import _print_finished

    options = SimpleNamespace(output=tmp_path, steps=steps, epochs=epochs, full=False)
    found = SimpleNamespace(path=Path("checkpoints/step-10"))
    prepared = SimpleNamespace(resume_from=[found], options=options, total_steps=10)
    _print_finished(prepared, main=True)
    assert capsys.readouterr().out == f"{tmp_path} is finished: {says}\n"


def test_without_matplotlib_a_run_trains_and_says_it_draws_no_plot(
    train_files, tmp_path, monkeypatch, capsys
):
    import sys

    from support.train_cli import COMMON

    from roundpipe.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    output = tmp_path / "out"
    argv = ["train", "--model", train_files["model"], "--data", train_files["text"],
            "--output", output, "--steps", "2", *COMMON]  # fmt: skip
    assert main([str(a) for a in argv]) == 0
    out = capsys.readouterr().out
    assert "loss.png is not drawn: matplotlib is not installed (pip install" in out
    assert (output / "metrics.jsonl").exists() and not (output / "loss.png").exists()
