"""``roundpipe train --resume DIR``: continue from the checkpoint DIR of ``--output``.

The oracle is the uninterrupted run (``train_runs`` in ``conftest.py``): resumed from
its named step-5 checkpoint the run ends with the same adapter, bit for bit. A DIR that
is not one of ``--output``'s checkpoints, or older than some there, is refused (exit
code 2) before anything is written.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("yaml")

from support.train_cli import metrics, run_train  # noqa: E402

from roundpipe.cli import main  # noqa: E402

ADAPTER = "adapter_model.safetensors"


def copy_of(run: Path, into: Path, drop_steps=()) -> Path:
    shutil.copytree(run, into)
    for step in drop_steps:
        shutil.rmtree(into / "checkpoints" / f"step-{step}")
    (into / ADAPTER).unlink()
    return into


def refused(capsys, output: Path, *args) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--config", str(output / "run.yaml"), "--output", str(output), *args])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_resume_from_a_named_checkpoint_equals_the_uninterrupted_run(train_runs, tmp_path):
    uninterrupted = train_runs["prompt_completion"]  # --sync, 10 steps, checkpoints 5, 10
    output = copy_of(uninterrupted, tmp_path / "out", drop_steps=[10])
    step_5 = output / "checkpoints" / "step-5"
    resumed = run_train("--config", output / "run.yaml", "--output", output, "--resume", step_5)
    assert resumed.returncode == 0, resumed.stderr
    assert "step-5 (step 5)" in resumed.stdout
    assert (output / ADAPTER).read_bytes() == (uninterrupted / ADAPTER).read_bytes()
    assert [r["loss"] for r in metrics(output)] == [r["loss"] for r in metrics(uninterrupted)]


def test_resume_alone_still_takes_the_newest(train_runs, tmp_path):
    output = copy_of(train_runs["prompt_completion"], tmp_path / "out")
    resumed = run_train("--config", output / "run.yaml", "--output", output, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "step-10 (step 10)" in resumed.stdout  # writes the missing adapter only


def test_a_checkpoint_older_than_others_there_is_refused(train_runs, tmp_path, capsys):
    output = copy_of(train_runs["prompt_completion"], tmp_path / "out")
    err = refused(capsys, output, "--resume", str(output / "checkpoints" / "step-5"))
    assert "holds newer checkpoints (step-10)" in err and "delete them" in err
    assert sorted(p.name for p in (output / "checkpoints").iterdir()) == ["step-10", "step-5"]


def test_a_checkpoint_of_another_output_is_refused(train_runs, tmp_path, capsys):
    output = copy_of(train_runs["prompt_completion"], tmp_path / "out")
    other = train_runs["prompt_completion"] / "checkpoints" / "step-5"
    err = refused(capsys, output, "--resume", str(other))
    assert f"--resume {other}: not a checkpoint of --output {output}" in err


def test_a_missing_named_checkpoint_is_refused(train_runs, tmp_path, capsys):
    output = copy_of(train_runs["prompt_completion"], tmp_path / "out")
    err = refused(capsys, output, "--resume", str(output / "checkpoints" / "step-7"))
    assert "step-7: no complete checkpoint there" in err


@pytest.mark.parametrize(
    ("given", "resume"),
    [(["--resume"], True), (["--resume", "out/checkpoints/step-5"], "out/checkpoints/step-5"),
     (["--resume", "--steps", "3"], True), (["--no-resume"], False), ([], None)],
)  # fmt: skip
def test_resume_is_a_flag_that_may_name_a_checkpoint(given, resume):
    import argparse

    from roundpipe.train.command_line import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert vars(parser.parse_args(given)).get("resume") == resume
