"""``roundpipe train`` on bad input: exit code 2 and a message naming the problem.

Each error comes in one line, before anything is written. Checked in-process through
``roundpipe.cli.main`` (the exit code, and everything written to the stderr file
descriptor), two of them also through a real process. The inputs and finished runs
are shared with the other train tests (``train_files`` and ``train_runs`` in
``conftest.py``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("yaml")

from support.train_bad_models import (  # noqa: E402
    bert_dir,
    mxfp4_gpt_oss_dir,
    t5_dir,
    truncated_copy,
)
from support.train_cli import COMMON, run_train  # noqa: E402
from support.train_fixtures import architecture_dir, build_model_dir  # noqa: E402

from roundpipe.cli import main  # noqa: E402


def usage_error(capture, *args) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *map(str, args)])
    assert exit_info.value.code == 2
    return capture.readouterr().err


@pytest.fixture(scope="module")
def broken(train_files) -> dict[str, Path]:
    root = train_files["root"]
    no_tokenizer = build_model_dir(root / "no-tokenizer", with_tokenizer=False)
    no_weights = root / "no-weights"
    no_weights.mkdir()
    shutil.copy(train_files["model"] / "config.json", no_weights)
    bin_only = root / "bin-only"  # weights roundpipe.from_pretrained does not load
    bin_only.mkdir()
    shutil.copy(train_files["model"] / "config.json", bin_only)
    (bin_only / "pytorch_model.bin").write_bytes(b"")
    bad_data = root / "bad.jsonl"
    bad_data.write_text('{"text": "count from 1 to 4 1 2 3 4"}\n\n{"text": oops}\n')
    unknown_key = root / "unknown.yaml"
    unknown_key.write_text("lora-rank: 8\n")
    return {"no_tokenizer": no_tokenizer, "no_weights": no_weights, "bin_only": bin_only,
            "bad_data": bad_data, "unknown_key": unknown_key, "t5": t5_dir(root / "t5"),
            "gemma3n": architecture_dir("gemma3n_text", root / "gemma3n"),
            "bert": bert_dir(root / "bert"), "mxfp4": mxfp4_gpt_oss_dir(root / "mxfp4"),
            "truncated": truncated_copy(train_files["model"], root / "truncated")}  # fmt: skip


ERRORS = {  # options changed or added to a good command line, and the message expected
    "model directory missing": ({"--model": "{root}/nothing"}, "no such directory"),
    "config.json missing": ({"--model": "{root}"}, "no config.json"),
    "weights missing": ({"--model": "{no_weights}"}, "no weights"),
    "only .bin weights": ({"--model": "{bin_only}"}, "a .bin checkpoint: convert it"),
    "tokenizer missing": ({"--model": "{no_tokenizer}"}, "no tokenizer"),
    "bad data line": ({"--data": "{bad_data}"}, "bad.jsonl:3: not valid JSON"),
    "seq-len too long": ({"--seq-len": "65"}, "--seq-len 65 exceeds the model's maximum of 64"),
    "resume without checkpoint": ({"--resume": None}, "--resume: no checkpoint"),
    "full with lora": ({"--full": None, "--lora-r": "4"}, "--full trains every weight"),
    "steps and epochs": ({"--steps": "3", "--epochs": "1"}, "not both"),
    "eval-every alone": ({"--eval-every": "3"}, "--eval-every needs --eval-data"),
    "demo with model": ({"--demo": None}, "--demo brings its own model and data"),
    "zero steps": ({"--steps": "0"}, "--steps must be a positive number"),
    "negative batch": ({"--batch-size": "-1"}, "--batch-size must be a positive number"),
    "zero lr": ({"--lr": "0"}, "--lr must be positive"),
    "infinite lr": ({"--lr": "inf"}, "--lr must be a finite number, got inf"),
    "NaN lr": ({"--lr": "nan"}, "--lr must be a finite number, got nan"),
    "NaN weight decay": ({"--weight-decay": "nan"}, "--weight-decay must be a finite number"),
    "infinite lora alpha": ({"--lora-alpha": "inf"}, "--lora-alpha must be a finite number"),
    "NaN grad clip": ({"--grad-clip": "nan"}, "--grad-clip must be a finite number, got nan"),
    "too many microbatches": ({"--microbatches": "9"}, "--microbatches 9 exceeds"),
    "bad devices": ({"--devices": "tpu:3"}, "--devices 'tpu:3'"),
    "unknown yaml key": ({"--config": "{unknown_key}"}, "unknown option 'lora-rank'"),
    "T5": ({"--model": "{t5}"}, "model_type 't5' is an encoder-decoder model"),
    "BERT": ({"--model": "{bert}"}, "model_type 'bert': no list of decoder layers"),
    "Gemma 3n": (
        {"--model": "{gemma3n}", "--full": None},
        "model_type 'gemma3n_text': its decoder does more than pass each layer's output",
    ),
    "LoRA on lm_head": (
        {"--lora-targets": "q_proj,lm_head"},
        "LoRA on the output layer (lm_head) is not supported",
    ),
    "lora targets naming no module": ({"--lora-targets": "qproj"}, "'qproj' names no module"),
    "a lora target naming no module": ({"--lora-targets": "q_proj,v_prj"}, "'v_prj' names no"),
    "truncated weights": ({"--model": "{truncated}"}, "model.safetensors is truncated"),
    "MXFP4 weights": ({"--model": "{mxfp4}"}, "holds quantized weights (quant_method 'mxfp4'"),
    "output is a file": ({"--output": "{tmp}/a-file"}, "a-file is a file, not a directory"),
}


def written(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("case", ERRORS, ids=list(ERRORS))
def test_bad_input_exits_2_in_one_line_before_writing_anything(
    train_files, broken, tmp_path, capfd, case
):
    changes, message = ERRORS[case]
    (tmp_path / "a-file").write_text("not a directory")
    before = written(tmp_path)
    names = {**train_files, **broken, "tmp": tmp_path}
    changed = {flag: value and value.format(**names) for flag, value in changes.items()}
    args = {
        "--model": train_files["model"],
        "--data": train_files["text"],
        "--output": tmp_path / "out",
    }
    args.update(changed)
    argv = [str(x) for flag, value in args.items() for x in (flag, value) if x is not None]
    err = usage_error(capfd, *argv)
    assert message in err
    assert len(err.splitlines()) == 1, err
    assert written(tmp_path) == before


def test_resume_refuses_a_checkpoint_of_another_adapter_shape_or_model(
    train_runs, train_files, capsys
):
    output = train_runs["prompt_completion"]
    common = ("--data", train_files["prompt_completion"], "--output", output, "--resume",
              "--steps", "20", *COMMON)  # fmt: skip
    other_rank = usage_error(capsys, "--model", train_files["model"], *common, "--lora-r", "8",
                             "--lora-targets", "q_proj,v_proj,down_proj")  # fmt: skip
    assert "--lora-r 4 there, 8 here" in other_rank
    other_model = build_model_dir(train_files["root"] / "other-model", seed=1)
    err = usage_error(capsys, "--model", other_model, *common, "--lora-r", "4",
                      "--lora-targets", "q_proj,v_proj,down_proj")  # fmt: skip
    assert "another model" in err and "other-model" in err


def test_a_new_run_refuses_an_output_holding_checkpoints(train_runs, train_files, capsys):
    err = usage_error(capsys, "--model", train_files["model"], "--data", train_files["text"],
                      "--output", train_runs["text"])  # fmt: skip
    assert "holds checkpoints of an earlier run (step 10)" in err and "--resume" in err


def test_a_missing_dependency_is_named_with_the_install_command(train_files, capsys, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "peft" else find_spec(name, *a),
    )
    err = usage_error(capsys, "--model", train_files["model"], "--data", train_files["text"],
                      "--output", train_files["root"] / "unused")  # fmt: skip
    assert (
        "needs peft" in err
        and "pip install 'roundpipe-ft[train]' (from a checkout: pip install -e '.[train]')" in err
    )


def test_several_processes_without_torchruns_variables_exit_2(
    train_files, tmp_path, capsys, monkeypatch
):
    """(Training under torchrun: tests/train/test_train_multinode.py.)"""
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    err = usage_error(capsys, "--model", train_files["model"], "--data", train_files["text"],
                      "--output", tmp_path)  # fmt: skip
    assert "WORLD_SIZE=2 but RANK, MASTER_ADDR, MASTER_PORT not set" in err and "torchrun" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "2", "--epochs", "2"], "not both"),
        (["--data", "{bad_data}"], "bad.jsonl:3"),
    ],
)
def test_the_real_process_exits_2_on_bad_input(train_files, broken, tmp_path, args, message):
    args = [a.format(**broken) for a in args]
    data = [] if "--data" in args else ["--data", train_files["text"]]
    done = run_train("--model", train_files["model"], *data, "--output", tmp_path, *args)
    assert done.returncode == 2 and message in done.stderr
    assert "Traceback" not in done.stderr
