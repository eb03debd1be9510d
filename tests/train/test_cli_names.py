"""The names a Trainer or TRL user types, through the parse path ``roundpipe train`` takes
(its parser, :func:`command_line_of`, :func:`given_options`, :func:`resolve`): each maps
to what our option means, on the command line and in YAML; a Trainer value we cannot
honour is refused in one line. No abbreviations, no misleading "did you mean"; a
usage error is one line and the ``--help`` hint. ``--resume`` continues from
``run.yaml`` with nothing retyped; ``export`` takes a run directory."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("yaml")

from support.train_cli import COMMON, checkpoint_steps, metrics, run_train  # noqa: E402
from support.train_fixtures import build_model_dir, write_data  # noqa: E402

from roundpipe.cli import _parser, main  # noqa: E402
from roundpipe.train.aliases import hint  # noqa: E402
from roundpipe.train.checkpoints import changed_options  # noqa: E402
from roundpipe.train.command_line import command_line_of, given_options  # noqa: E402
from roundpipe.train.options import (  # noqa: E402
    UsageError,
    read_config,
    resolve,
    write_run_yaml,
)

REQUIRED = ("--model", "m", "--data", "d.jsonl", "--output", "out", "--devices", "emulated:2")


def resolved(*args: str, required=REQUIRED):
    """The options and notes ``roundpipe train *args`` runs with."""
    given = given_options(command_line_of(_parser().parse_args(["train", *required, *args])))
    return resolve(given.command_line, given.config), given.notes


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--dataset_name", "org/set"], {"data": "org/set"}),
        (["--bf16"], {"precision": "bf16"}),
        (["--bf16", "true"], {"precision": "bf16"}),
        (["--fp16"], {"precision": "fp16"}),
        (["--bf16", "false"], {"precision": "fp32"}),
        (["--bf16", "false", "--fp16", "True"], {"precision": "fp16"}),
        (["--torch_dtype", "bfloat16"], {"precision": "bf16"}),
        (["--dtype", "float32"], {"precision": "fp32"}),
        (["--bf16", "--dtype", "float32"], {"precision": "bf16"}),
        (["--bf16", "false", "--dtype", "bfloat16"], {"precision": "bf16"}),
        (["--max_length", "64"], {"seq_len": 64}),
        (["--max_seq_length", "64"], {"seq_len": 64}),
        (["--save_steps", "5"], {"save_every": 5}),
        (["--eval_steps", "5", "--eval-data", "e.jsonl"], {"eval_every": 5}),
        (["--save_total_limit", "3"], {"keep_checkpoints": 3}),
        (["--use_peft"], {"full": False}),
        (["--use_peft", "false"], {"full": True}),
        (["--load_in_4bit"], {"quantize": "nf4"}),
        (["--assistant_only_loss"], {"train_on_prompt": False}),
        (["--completion_only_loss"], {"train_on_prompt": False}),
        (["--completion_only_loss", "false"], {"train_on_prompt": True}),
        (["--assistant_only_loss", "false", "--completion_only_loss", "false"],
         {"train_on_prompt": True}),
        (["--resume_from_checkpoint"], {"resume": True}),
        (["--resume_from_checkpoint", "out/checkpoints/step-5"],
         {"resume": "out/checkpoints/step-5"}),
        (["--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0.1",
          "--lora_target_modules", "q_proj", "v_proj"],
         {"lora_r": 8, "lora_alpha": 16.0, "lora_dropout": 0.1, "lora_targets": "q_proj,v_proj"}),
        (["--optim", "adamw_torch"], {"optimizer_states": "fp32"}),
        (["--optim", "adamw_torch_fused", "--full"], {"optimizer_states": "fp32"}),
        (["--optim", "adamw_8bit", "--full"], {"optimizer_states": "int8"}),
        (["--optim", "paged_adamw_8bit", "--use_peft", "false"], {"optimizer_states": "int8"}),
        (["--report_to", "tensorboard"], {"report_to": "tensorboard"}),
        (["--seed", "3", "--warmup_ratio", "0.1", "--weight_decay", "0.01"],
         {"seed": 3, "warmup_ratio": 0.1, "weight_decay": 0.01}),
        (["--max_steps", "-1", "--num_train_epochs", "2"], {"steps": None, "epochs": 2}),
        (["--max_steps", "7", "--num_train_epochs", "2"], {"steps": 7, "epochs": None}),
        (["--max_steps", "7", "--epochs", "2"], {"steps": 7, "epochs": None}),
        (["--epochs", "0.5"], {"epochs": 0.5}),
        (["--lr_scheduler_type", "constant_with_warmup"], {"schedule": "constant"}),
        (["--no-memory-check"], {"memory_check": False}),
        (["--chat-template", "chatml"], {"chat_template": "chatml"}),
    ],
)  # fmt: skip
def test_a_trainer_name_on_the_command_line_sets_what_it_means_here(args, expected):
    options, _ = resolved(*args)
    assert {key: getattr(options, key) for key in expected} == expected


def test_trainer_names_that_change_nothing_here_say_why_in_one_line():
    _, notes = resolved("--gradient_checkpointing", "--logging_steps", "10")
    assert len(notes) == 2
    assert "always recomputes activations layer by layer" in notes[0]
    assert "--logging_steps 10" in notes[1] and "every step" in notes[1]
    options, notes = resolved("--optim", "paged_adamw_8bit")  # LoRA: an adapter's states
    assert options.optimizer_states == "fp32" and "LoRA" in notes[0]


def test_a_trl_config_file_sets_the_same_options(tmp_path):
    config = tmp_path / "trl.yaml"
    config.write_text(
        "model_name_or_path: org/model\ndataset_name: org/set\noutput_dir: out\n"
        "bf16: true\ndtype: bfloat16\nuse_peft: true\nload_in_4bit: true\n"
        "lora_target_modules: [q_proj, v_proj]\ngradient_checkpointing: true\n"
        "max_steps: -1\nnum_train_epochs: 0.5\nmax_length: 64\nlogging_steps: 10\n"
        "save_steps: 5\nsave_total_limit: 1\nassistant_only_loss: true\n"
        "optim: adamw_torch\nreport_to: [tensorboard]\nlr_scheduler_type: cosine\n"
    )
    options, notes = resolved("--config", str(config), required=("--devices", "emulated:2"))
    got = {k: getattr(options, k) for k in ("model", "data", "output", "precision", "full",
           "quantize", "lora_targets", "steps", "epochs", "seq_len", "save_every",
           "keep_checkpoints", "train_on_prompt", "report_to", "schedule")}  # fmt: skip
    assert got == {
        "model": "org/model", "data": "org/set", "output": Path("out"), "precision": "bf16",
        "full": False, "quantize": "nf4", "lora_targets": "q_proj,v_proj", "steps": None,
        "epochs": 0.5, "seq_len": 64, "save_every": 5, "keep_checkpoints": 1,
        "train_on_prompt": False, "report_to": "tensorboard", "schedule": "cosine",
    }  # fmt: skip
    assert len(notes) == 2  # gradient_checkpointing, logging_steps
    assert read_config(config)["epochs"] == 0.5  # read on its own, as --config reads it


@pytest.mark.parametrize(
    "args, message",
    [
        (["--optim", "adafactor"], "--optim adafactor: not an optimizer roundpipe has; use "
         "adamw_torch, adamw_torch_fused"),
        (["--optim", "adamw_torch_4bit", "--full"], "adamw_8bit, paged_adamw_8bit"),
        (["--bf16", "--fp16"], "--bf16 and --fp16"),
        (["--dtype", "auto"], "--dtype auto"),
        (["--assistant_only_loss", "false"], "--train-on-prompt"),
        (["--assistant_only_loss", "--completion_only_loss", "false"], "one switch"),
        (["--use_peft", "--full"], "--use_peft means no --full, --full says otherwise"),
        (["--precision", "fp16", "--fp16", "false"],
         "--fp16 false means --precision fp32, --precision fp16 says otherwise"),
        (["--lr_scheduler_type", "polynomial"], "cosine, linear, constant"),
        (["--steps", "5", "--epochs", "2"], "give --steps (5) or --epochs (2), not both"),
    ],
)  # fmt: skip
def test_a_trainer_value_that_cannot_be_honoured_is_refused_naming_it(args, message):
    with pytest.raises(UsageError) as refused:
        resolved(*args)
    assert message in str(refused.value)


def usage_error(capsys, *args: str) -> list[str]:
    with pytest.raises(SystemExit) as exited:
        main(list(args))
    assert exited.value.code == 2
    return capsys.readouterr().err.splitlines()


@pytest.mark.parametrize(
    "args, error",
    [
        (["train", "--nonsense", "1"], "unknown option --nonsense"),
        (["train", "--lr", "fast"], "argument --lr/--learning_rate: invalid float value: 'fast'"),
        (["export", "--checkpoint", "c"], "the following arguments are required: --output"),
        (["export", "--nonsense", "1", "--checkpoint", "c", "--output", "o"],
         "unrecognized arguments: --nonsense 1"),
        (["simulate", "--gpus", "x"], "argument --gpus: unknown GPU preset 'x'; known presets: "
         "rtx3090, rtx4090, rtx5090, a800, h100, h200 (write a count N or NAMExCOUNT, e.g. "
         "rtx4090x4,rtx3090x4)"),
    ],
)  # fmt: skip
def test_a_usage_error_is_one_line_and_the_help_hint(capsys, args, error):
    command = args[0]
    lines = usage_error(capsys, *args)
    assert lines == [f"roundpipe {command}: error: {error}", f"see roundpipe {command} --help"]


@pytest.mark.parametrize("given", ["--keep", "--optimizer", "--warmup"])
def test_an_abbreviated_option_is_refused(capsys, given):
    lines = usage_error(capsys, "train", given, "3")
    assert lines[0].startswith(f"roundpipe train: error: unknown option {given}")


@pytest.mark.parametrize("given", ["--save_strategy", "--eval_strategy", "--resume_from"])
def test_an_unknown_trainer_option_gets_no_suggestion_of_another_meaning(capsys, given):
    lines = usage_error(capsys, "train", given, "steps")
    assert lines[0] == f"roundpipe train: error: unknown option {given}"


def test_a_suggestion_is_a_spelling_of_the_same_option():
    assert hint("save_steps", ["max_steps", "save_every"], str) == ""
    assert hint("resume_from_checkpoint", ["keep_checkpoints", "resume"], str) == ""
    assert hint("max_step", ["max_steps", "save_steps"], lambda k: "--" + k) == (
        " (did you mean --max_steps?)"
    )


def test_the_help_lists_the_trainer_names_with_what_they_mean(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--gradient_checkpointing" in text and "--optim" in text and "--bf16" in text
    assert "--no-memory-check" in text and "--chat-template" in text


def test_the_real_command_refuses_an_abbreviation_in_two_lines():
    done = run_train("--model", "m", "--keep", "3")  # not --keep-checkpoints
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "roundpipe train: error: unknown option --keep",
        "see roundpipe train --help",
    ]


def test_new_options_round_trip_through_run_yaml(tmp_path):
    options, _ = resolved("--no-memory-check", "--chat-template", "llama3")
    write_run_yaml(options, tmp_path / "run.yaml")
    assert resolve({}, read_config(tmp_path / "run.yaml")) == options
    assert resolve({}, read_config(tmp_path / "run.yaml")).memory_check is False


def test_a_record_older_than_the_new_options_shows_no_change():
    options, _ = resolved()
    new = ("memory_check", "chat_template")
    older = {k: v for k, v in options.run_record().items() if k not in new}
    assert changed_options(older, options) == {}


def test_fractional_epochs_round_the_steps_up_as_trainer_does():
    options, _ = resolved("--epochs", "0.5")
    assert options.total_steps(7) == math.ceil(0.5 * 7) == 4
    assert resolved("--epochs", "2.5")[0].total_steps(4) == 10
    assert resolved("--steps", "3")[0].total_steps(100) == 3
    assert resolved()[0].total_steps(6) == 6  # one epoch by default


@pytest.mark.parametrize(
    "now, expected",
    [
        ({"resume": True, "epochs": 1}, (None, 1)),
        ({"resume": True, "steps": 9}, (9, None)),
        ({"resume": True}, (2, None)),
        ({"resume_from_checkpoint": True, "max_steps": 5}, (5, None)),
    ],
)
def test_resume_reads_run_yaml_and_a_flag_overrides_it(tmp_path, now, expected):
    earlier, _ = resolved("--steps", "2", "--lr", "3e-3", required=(
        "--model", "m", "--data", "d.jsonl", "--output", str(tmp_path), "--devices",
        "emulated:2"))  # fmt: skip
    write_run_yaml(earlier, tmp_path / "run.yaml")
    given = given_options({"output": tmp_path, **now})  # as parsed
    options = resolve(given.command_line, given.config)
    assert (options.steps, options.epochs) == expected
    assert (options.model, options.lr, options.resume) == ("m", 3e-3, True)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A tiny model and 16 examples (2 steps of 8 an epoch)."""
    root = tmp_path_factory.mktemp("names")
    model = build_model_dir(root / "model")
    return root, model, write_data(root / "data.jsonl", "prompt_completion", lines=16)


def test_a_fraction_of_an_epoch_is_that_share_of_its_steps_rounded_up(inputs, tmp_path):
    from roundpipe.train.preflight import prepare

    _, model, data = inputs
    options, _ = resolved("--num_train_epochs", "1.5", "--batch-size", "8", required=(
        "--model", str(model), "--data", str(data), "--output", str(tmp_path), "--devices",
        "emulated:2", "--no-memory-check"))  # fmt: skip
    prepared = prepare(options)
    assert prepared.train_batches.steps_per_epoch == 2
    assert prepared.total_steps == 3


@pytest.fixture(scope="module")
def resumed_run(inputs):
    """A 2-step LoRA run, then ``--output O --resume --steps 3`` with nothing else."""
    root, model, data = inputs
    output = root / "out"
    first = run_train("--model", model, "--data", data, "--output", output, *COMMON,
                      "--max_steps", "2", "--gradient_checkpointing", "--lora_r", "4")  # fmt: skip
    assert first.returncode == 0, first.stderr
    resumed = run_train("--output", output, "--resume", "--steps", "3")
    return {"first": first, "resumed": resumed, "output": output}


def test_resume_with_only_output_continues_the_run(resumed_run):
    first, resumed, output = (resumed_run[k] for k in ("first", "resumed", "output"))
    assert "always recomputes activations layer by layer" in first.stdout
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stdout and "step-2 (step 2)" in resumed.stdout
    assert [row["step"] for row in metrics(output)] == [1, 2, 3]
    assert checkpoint_steps(output)[-1] == 3


def test_export_of_a_run_directory_takes_its_newest_checkpoint(resumed_run, tmp_path, capsys):
    import safetensors.torch

    output = resumed_run["output"]
    assert main(["export", "--checkpoint", str(output), "--output", str(tmp_path / "e")]) == 0
    out = capsys.readouterr().out
    newest = output / "checkpoints" / "step-3"
    assert f"exporting {newest}, the newest checkpoint of {output}; the run finished" in out
    adapter = "adapter_model.safetensors"
    exported = safetensors.torch.load_file(tmp_path / "e" / adapter)
    final = safetensors.torch.load_file(output / adapter)  # the run's own result
    assert exported.keys() == final.keys()
    assert all(exported[k].equal(final[k]) for k in final)


def test_export_of_a_directory_without_checkpoints_is_refused(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.yaml").write_text("lr: 1\n")
    lines = usage_error(capsys, "export", "--checkpoint", str(tmp_path / "run"), "--output",
                        str(tmp_path / "e"))  # fmt: skip
    assert lines[0].endswith(
        f"a run directory without a checkpoint (none in {tmp_path}/run/checkpoints)"
    )
