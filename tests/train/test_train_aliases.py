"""The option names ``roundpipe train`` shares with ``transformers``' ``TrainingArguments``
and TRL: those meaning the same are accepted (command line and ``--config``), those
meaning something else and unknown ones are refused with the nearest option; ``--help``
shows every default; ``simulate --help`` is plain text."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("yaml")

from roundpipe.cli import main  # noqa: E402
from roundpipe.train.aliases import BATCH_NOTE, HF_NAMES, OTHER_MEANING  # noqa: E402
from roundpipe.train.command_line import add_arguments, given_options  # noqa: E402
from roundpipe.train.options import OPTIONS, UsageError, read_config  # noqa: E402

TRL_ONLY = {"model_name_or_path", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules",
            "dataset_name", "dataset_train_split", "max_length", "max_seq_length", "loss_type",
            "label_smoothing", "desirable_weight", "undesirable_weight",
            "precompute_ref_log_probs"}  # fmt: skip
"""TRL's ``ModelConfig``, ``ScriptArguments``, ``SFTConfig``, ``DPOConfig`` and
``KTOConfig`` names (the rest are ``TrainingArguments``')."""


def parsed(*args: str) -> dict:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return given_options(vars(parser.parse_args(list(args)))).command_line


def test_the_aliases_are_training_arguments_names():
    names = {f.name for f in fields(transformers.TrainingArguments)} | {"warmup_ratio"}  # < v5
    assert set(HF_NAMES) - TRL_ONLY <= names
    assert set(OTHER_MEANING) <= names


def test_the_preference_aliases_are_trls_config_names():
    trl = pytest.importorskip("trl")
    names = {f.name for f in fields(trl.DPOConfig)} | {f.name for f in fields(trl.KTOConfig)}
    preference = {"loss_type", "label_smoothing", "desirable_weight", "undesirable_weight",
                  "precompute_ref_log_probs"}  # fmt: skip
    assert preference <= names and preference <= set(HF_NAMES)


def test_trainer_names_on_the_command_line_set_our_options():
    got = parsed(
        "--learning_rate", "1e-4", "--num_train_epochs", "2", "--warmup_steps", "3",
        "--warmup_ratio", "0.1", "--weight_decay", "0.01", "--max_grad_norm", "0.5",
        "--seed", "7", "--output_dir", "out", "--model_name_or_path", "org/model",
        "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0.05", "--report_to", "none",
    )  # fmt: skip
    assert got == {
        "lr": 1e-4, "epochs": 2, "warmup_steps": 3, "warmup_ratio": 0.1,
        "weight_decay": 0.01, "grad_clip": 0.5, "seed": 7, "output": Path("out"),
        "model": "org/model", "lora_r": 8, "lora_alpha": 16.0, "lora_dropout": 0.05,
        "report_to": "none",
    }  # fmt: skip
    assert parsed("--max_steps", "5") == {"steps": 5}


def test_lora_target_modules_takes_trls_list_or_our_comma_list():
    assert parsed("--lora_target_modules", "q_proj", "v_proj") == {"lora_targets": "q_proj,v_proj"}
    assert parsed("--lora-targets", "q_proj,v_proj") == {"lora_targets": "q_proj,v_proj"}


def test_trainer_names_in_a_config_file_set_our_options(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("learning_rate: 1e-4\nmax_steps: 5\nmax_grad_norm: 0\n"
                      "lora_target_modules: [q_proj, v_proj]\noutput_dir: out\n")  # fmt: skip
    assert read_config(config) == {
        "lr": 1e-4, "steps": 5, "grad_clip": 0.0, "lora_targets": "q_proj,v_proj",
        "output": Path("out"),
    }  # fmt: skip


def test_a_config_file_giving_one_option_under_two_names_is_refused(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("lr: 1e-4\nlearning_rate: 2e-4\n")
    with pytest.raises(UsageError, match="'lr' and 'learning_rate' are the same option"):
        read_config(config)


def refusal(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exited:
        main(["train", *args])
    assert exited.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "given, nearest",
    [("--learning-rat", "--learning_rate"), ("--warmup-ratoi", "--warmup-ratio"),
     ("--lora_targets", "--lora-targets"), ("--eval_every=5", "--eval-every")],
)  # fmt: skip
def test_an_unknown_option_is_refused_naming_the_nearest(capsys, given, nearest):
    err = refusal(capsys, given, "1")
    name = given.split("=")[0]
    assert f"roundpipe train: error: unknown option {name} (did you mean {nearest}?)" in err


@pytest.mark.parametrize("name", sorted(OTHER_MEANING))
def test_trainers_batch_options_are_refused_saying_how_ours_differ(capsys, name):
    err = refusal(capsys, f"--{name}", "4")
    nearest = "--" + OTHER_MEANING[name].replace("_", "-")
    assert f"unknown option --{name} (did you mean {nearest}? it means something else" in err
    assert "--batch-size is the global number of sequences per step" in err
    assert "not accumulation steps" in err and len(err.strip().splitlines()[0]) > 100


def test_trainers_batch_options_in_a_config_file_are_refused_the_same_way(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("gradient_accumulation_steps: 4\n")
    with pytest.raises(UsageError, match="did you mean 'microbatches'") as refused:
        read_config(config)
    assert BATCH_NOTE in str(refused.value)


def test_help_shows_every_default_zeros_and_flags_included(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option in OPTIONS:
        if option.default is True:  # on unless --no-NAME
            assert f"--no-{option.name} {option.help}" in text
        if option.default is None or option.default is True:
            continue
        shown = "off" if option.default is False else option.default
        assert re.search(rf"--{option.name}\b[^-]*?.*?\(default {re.escape(str(shown))}\)", text)
    for zero in ("(default 0)", "(default 0.0)", "(default off)"):
        assert zero in text
    assert "--lr LR, --learning_rate LR" in text


def test_simulate_help_is_plain_text(capsys):
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    out = capsys.readouterr().out
    assert "--layers" in out
    assert "``" not in out and not re.search(r":(mod|class|func|meth):", out)
