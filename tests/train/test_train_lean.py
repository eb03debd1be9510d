"""``roundpipe train --full`` with lean settings: ``--optimizer-states fp32|bf16|int8``,
``--master-weights fp32|bf16``, and ``--quantize nf4`` for LoRA (docs/design.md#train-options).

The options: each contradiction exits 2 in one line, naming the option; ``run.yaml``
records them (and works as ``--config``); a resumed run cannot change them. The runs:
each setting's optimizer steps equal plain PyTorch running the same optimizer
(``roundpipe.optim.make_adamw``'s, on plain tensors) on the run's own gradients, bit for
bit, those gradients are the model's (``transformers`` autograd on the same batch) and
the saved model is the masters; a resumed ``int8`` run equals the uninterrupted one bit
for bit; a LoRA run on an NF4 base trains and its adapter loads with peft on the plain
base.

The model is the tiny Qwen3 of ``support/train_fixtures.py`` with a wider MLP: torchao
keeps the moments of tensors under 4096 values in fp32, so the 32x128 projections are
what exercises the 8-bit state. The runs go through ``roundpipe.cli.main`` in this
process, so torchao compiles its step once per shape for all of them.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("yaml")
pytest.importorskip("torchao")  # every lean optimizer (and the options' check builds one)

from support.train_cli import metrics  # noqa: E402
from support.train_fixtures import (  # noqa: E402
    MAX_POSITIONS,
    build_tokenizer,
    tiny_qwen3_config,
    write_data,
)
from support.train_lean_oracle import recording, replay  # noqa: E402

import roundpipe  # noqa: E402
from roundpipe.cli import main  # noqa: E402
from roundpipe.train.checkpoints import Found, Position, check_compatible  # noqa: E402
from roundpipe.train.options import (  # noqa: E402
    UsageError,
    read_config,
    resolve,
    write_run_yaml,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

RUN = ("--seq-len", "32", "--batch-size", "8", "--devices", "emulated:2", "--lr", "1e-2",
       "--schedule", "constant", "--grad-clip", "0", "--weight-decay", "0.1", "--full")  # fmt: skip
"""Constant rates (a resumed run's total does not change them), no clipping (the
recorded gradients are the model's), weight decay on the decayed group."""


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lean")
    return {
        "model": wide_model_dir(root / "model"),
        "data": write_data(root / "text.jsonl", "text"),
    }


def wide_model_dir(directory: Path) -> Path:
    """``build_model_dir``'s Qwen3 with ``intermediate_size`` 128: its MLP weights hold
    4096 values each, the least torchao quantizes."""
    tokenizer = build_tokenizer()
    config = tiny_qwen3_config(
        len(tokenizer), intermediate_size=128,
        max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False,
        attn_implementation="sdpa", eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.Qwen3ForCausalLM(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def usage_error(capture, *args) -> str:
    """The one line of a refused command (argparse's own refusals, of a value not among
    an option's choices, are followed by where the help is)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *map(str, args)])
    assert exit_info.value.code == 2
    lines = capture.readouterr().err.strip().splitlines()
    if lines[-1] == "see roundpipe train --help":
        lines = lines[:-1]
    assert len(lines) == 1, lines
    return lines[0]


# -- the options ---------------------------------------------------------------------------

BASE = {"model": "m", "data": "d", "output": Path("out"), "devices": "emulated:2"}

REFUSED = {  # options given, and what the message says
    "int8 states with LoRA": (
        {"optimizer_states": "int8"}, "--optimizer-states: the optimizer of every weight"),
    "bf16 masters with LoRA": (
        {"master_weights": "bf16", "precision": "bf16"}, "--master-weights: the optimizer"),
    "both with LoRA": (
        {"optimizer_states": "fp32", "master_weights": "fp32"},
        "--master-weights, --optimizer-states: the optimizer of every weight, for --full only"),
    "nf4 with --full": ({"full": True, "quantize": "nf4"}, "it contradicts --quantize"),
    "bf16 masters of fp32 weights": (
        {"full": True, "master_weights": "bf16"},
        "--master-weights bf16 updates the model's own bf16 weights: it needs --precision bf16 "
        "(this run's is fp32)"),
    "bf16 masters of fp16 weights": (
        {"full": True, "master_weights": "bf16", "precision": "fp16"},
        "needs --precision bf16 (this run's is fp16)"),
    "unknown states": ({"full": True, "optimizer_states": "int4"},
                       "--optimizer-states must be one of fp32, bf16, int8, got 'int4'"),
}  # fmt: skip


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_each_contradiction_is_refused_naming_the_option(case):
    given, message = REFUSED[case]
    with pytest.raises(UsageError) as refused:
        resolve({**BASE, **given})
    assert message in str(refused.value)


CLI_REFUSED = {
    "int8 states with LoRA": (["--optimizer-states", "int8"], "for --full only"),
    "nf4 with --full": (["--full", "--quantize", "nf4"], "it contradicts --quantize"),
    "bf16 masters, fp32 weights": (["--full", "--master-weights", "bf16"],
                                   "needs --precision bf16 (this run's is fp32)"),
    "a bad choice": (["--full", "--master-weights", "fp16"], "invalid choice: 'fp16'"),
}  # fmt: skip


@pytest.mark.parametrize("case", CLI_REFUSED, ids=list(CLI_REFUSED))
def test_the_command_exits_2_in_one_line_writing_nothing(files, tmp_path, capfd, case):
    extra, message = CLI_REFUSED[case]
    args = ["--model", files["model"], "--data", files["data"], "--output", tmp_path / "out"]
    assert message in usage_error(capfd, *args, *extra)
    assert not (tmp_path / "out").exists()


def test_a_config_file_gives_them_as_the_command_line_does(tmp_path):
    config = tmp_path / "lean.yaml"
    config.write_text("optimizer-states: int8\nmaster_weights: bf16\nprecision: bf16\n")
    options = resolve({**BASE, "full": True}, read_config(config))
    assert (options.optimizer_states, options.master_weights) == ("int8", "bf16")
    with pytest.raises(UsageError, match="for --full only"):
        resolve(BASE, read_config(config))  # without --full


def test_help_shows_them_with_their_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--optimizer-states {fp32,bf16,int8}" in text
    assert "--master-weights {fp32,bf16}" in text and "--quantize {none,nf4}" in text
    for name, default in (("optimizer-states", "fp32"), ("master-weights", "fp32"),
                          ("quantize", "none")):  # fmt: skip
        after = text.rsplit(f"--{name} {{", 1)[1]  # its help, after the usage lines
        assert after.index("(default ") == after.index(f"(default {default})")


@pytest.mark.parametrize(
    "given",
    [{"full": True, "optimizer_states": "int8"},
     {"full": True, "optimizer_states": "bf16", "master_weights": "bf16", "precision": "bf16"},
     {"quantize": "nf4"}, {}],
    ids=["int8", "bf16-bf16", "lora-nf4", "lora"],
)  # fmt: skip
def test_run_yaml_records_them_and_works_as_the_config(tmp_path, given):
    """A ``--full`` run records its optimizer's settings and no ``quantize``; a LoRA run
    the reverse (``--config`` refuses the other mode's options)."""
    options = resolve({**BASE, "output": tmp_path, **given})
    write_run_yaml(options, tmp_path / "run.yaml")
    config = read_config(tmp_path / "run.yaml")
    if options.full:
        assert config["optimizer_states"] == options.optimizer_states and "quantize" not in config
        assert config["master_weights"] == options.master_weights
    else:
        assert config["quantize"] == options.quantize and "optimizer_states" not in config
        assert "master_weights" not in config
    assert resolve({}, config) == options


def found(record: dict) -> Found:
    return Found(Path("checkpoints/step-1"), Position(1, 0, 0.0), record, 1)


@pytest.mark.parametrize(
    "saved, now, message",
    [({"optimizer_states": "int8"}, {}, "--optimizer-states 'int8' there, 'fp32' here"),
     ({}, {"optimizer_states": "int8"}, "--optimizer-states 'fp32' there, 'int8' here"),
     ({"master_weights": "bf16", "optimizer_states": "bf16"},
      {"master_weights": "fp32", "optimizer_states": "bf16"},
      "--master-weights 'bf16' there, 'fp32' here"),
     ({"full": False, "quantize": "nf4"}, {"full": False}, "--quantize 'nf4' there, 'none' here"),
     ({"full": False}, {"full": False, "quantize": "nf4"}, "--quantize 'none' there, 'nf4' here")],
)  # fmt: skip
def test_resume_refuses_another_optimizer_state_or_base(saved, now, message):
    """An older record, without the keys, holds the defaults."""
    given = {"full": True, **now}
    if given.get("master_weights") == "bf16" or saved.get("master_weights") == "bf16":
        given["precision"] = "bf16"
    options = resolve({**BASE, **given})
    record = {k: v for k, v in options.run_record().items() if k not in
              ("optimizer_states", "master_weights", "quantize")}  # fmt: skip
    with pytest.raises(UsageError) as refused:
        check_compatible(found({**record, **saved}), options)
    assert message in str(refused.value) and "cannot change" in str(refused.value)


def test_resume_after_changing_the_precision_is_refused_naming_it():
    options = resolve({**BASE, "precision": "fp32"})
    with pytest.raises(UsageError) as refused:
        check_compatible(found({**options.run_record(), "precision": "bf16"}), options)
    assert "--precision 'bf16' there, 'fp32' here" in str(refused.value)


def test_resume_accepts_the_same_settings_and_an_older_records_defaults():
    for given in ({"full": True}, {"full": True, "optimizer_states": "int8"}, {}):
        options = resolve({**BASE, **given})
        check_compatible(found(options.run_record()), options)
    older = {k: v for k, v in resolve({**BASE, "full": True}).run_record().items()
             if k not in ("optimizer_states", "master_weights")}  # fmt: skip
    check_compatible(found(older), resolve({**BASE, "full": True}))


def test_without_torchao_a_lean_setting_exits_2_with_the_install_hint(monkeypatch):
    import roundpipe.optim.factory as factory
    from roundpipe.errors import install_hint

    def missing():
        raise ImportError(f"these optimizer states need torchao: {install_hint('torchao')}")

    monkeypatch.setattr(factory, "_lean_module", missing)
    with pytest.raises(UsageError, match=r"--optimizer-states int8 with --master-weights fp32: .*"
                       r"pip install 'roundpipe-ft\[torchao\]'"):  # fmt: skip
        resolve({**BASE, "full": True, "optimizer_states": "int8"})
    resolve({**BASE, "full": True})  # the default needs no torchao


# -- the runs ------------------------------------------------------------------------------


def train(files, output: Path, *extra) -> None:
    args = ["train", "--model", files["model"], "--data", files["data"], "--output", output]
    assert main([*map(str, args), *RUN, *map(str, extra)]) == 0


def autograd_gradients(files, output: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The gradients of the run's first batch in ``transformers``' model of ``dtype``."""
    from roundpipe.train.preflight import prepare

    prepared = prepare(resolve({"output": output}, read_config(output / "run.yaml")))
    model = transformers.AutoModelForCausalLM.from_pretrained(files["model"], dtype=dtype)
    model(**prepared.train_batches.batch(0)).loss.backward()
    return {name: p.grad for name, p in model.named_parameters()}


SETTINGS = {  # (--optimizer-states, --master-weights): the state class expected
    ("int8", "fp32"): "OptimState8bit",
    ("bf16", "bf16"): "Tensor",
    ("int8", "bf16"): "OptimState8bit",
    ("bf16", "fp32"): "Tensor",
    ("fp32", "bf16"): "Tensor",
}
MORE = {("bf16", "fp32"), ("fp32", "bf16")}
"""The two other combinations (each compiles a step of its own): slow."""


@pytest.mark.parametrize(
    "setting",
    [pytest.param(s, marks=[pytest.mark.slow] if s in MORE else []) for s in SETTINGS],
    ids=["-".join(s) for s in SETTINGS],
)
def test_each_setting_steps_as_plain_pytorch_on_the_models_gradients(
    files, tmp_path, monkeypatch, capsys, setting
):
    states, masters = setting
    precision = ["--precision", "bf16"] if masters == "bf16" else []
    built = recording(monkeypatch)
    output = tmp_path / "out"
    train(files, output, "--sync", "--steps", "3", "--optimizer-states", states,
          "--master-weights", masters, *precision, "--seed", "3")  # fmt: skip
    (record,) = built
    notes = [f"optimizer states {states}"] * (states != "fp32") + ["bf16 masters"] * bool(precision)
    said = ", ".join(["bf16" if precision else "fp32", *notes, "steps 1-3"])
    assert said in capsys.readouterr().out
    dtype = torch.bfloat16 if masters == "bf16" else torch.float32
    assert {p.dtype for p in record.steps[0].before} == {dtype}
    kinds = {type(v).__name__ for s in record.optimizer.state.values()
             for k, v in s.items() if k.startswith("exp_avg")}  # fmt: skip
    assert SETTINGS[setting] in kinds
    if states != "int8":
        moments = [v for s in record.optimizer.state.values() for k, v in s.items()
                   if k.startswith("exp_avg")]  # fmt: skip
        assert {m.dtype for m in moments} == {torch.bfloat16 if states == "bf16" else torch.float32}
    replay(record, states, masters, seed=3)
    want = autograd_gradients(files, output, dtype)
    for name, grad in zip(record.names, record.steps[0].grads, strict=True):
        error = (grad.float() - want[name].float()).norm() / want[name].float().norm()
        assert error < (2e-2 if masters == "bf16" else 1e-4), name
    trained = transformers.AutoModelForCausalLM.from_pretrained(output, dtype=dtype)
    weights = dict(trained.named_parameters())
    for name, master in zip(record.names, record.steps[-1].after, strict=True):
        assert torch.equal(weights[name], master.to(dtype)), name  # the model is the masters


def test_an_int8_run_resumed_equals_the_uninterrupted_one_bit_for_bit(files, tmp_path, capfd):
    from safetensors.torch import load_file

    int8 = ("--sync", "--optimizer-states", "int8")
    interrupted, whole = tmp_path / "interrupted", tmp_path / "whole"
    train(files, interrupted, *int8, "--steps", "2")
    train(files, whole, *int8, "--steps", "4")
    err = usage_error(capfd, "--model", files["model"], "--data", files["data"], "--output",
                      interrupted, *RUN, "--sync", "--steps", "4", "--resume",
                      "--optimizer-states", "fp32")  # fmt: skip
    assert "--optimizer-states 'int8' there, 'fp32' here" in err
    capfd.readouterr()
    train(files, interrupted, *int8, "--steps", "4", "--resume")
    assert "resuming from" in capfd.readouterr().out
    got = load_file(interrupted / "model.safetensors")
    want = load_file(whole / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


@pytest.mark.parametrize(
    "given, keywords",
    [({"full": True}, {}), ({}, {}), ({"quantize": "nf4"}, {"quantize": "nf4"}),
     ({"full": True, "master_weights": "bf16", "precision": "bf16"},
      {"optim_dtype": torch.bfloat16}),
     ({"full": True, "optimizer_states": "int8"}, {})],
    ids=["full", "lora", "lora-nf4", "bf16-masters", "int8-states"],
)  # fmt: skip
def test_the_pipe_is_built_with_bf16_masters_or_an_nf4_base_as_asked(given, keywords):
    """The defaults add no keyword: the pipe is built as before."""
    from roundpipe.train.optim import lean_pipe_options

    assert lean_pipe_options(resolve({**BASE, **given})) == keywords


NF4 = "quantize" in inspect.signature(roundpipe.from_pretrained).parameters


@pytest.mark.skipif(not NF4, reason="from_pretrained has no quantize keyword yet")
def test_a_lora_run_on_an_nf4_base_trains_and_its_adapter_loads_on_the_plain_base(files, tmp_path):
    peft = pytest.importorskip("peft")
    output = tmp_path / "out"
    args = ["train", "--model", files["model"], "--data", files["data"], "--output", output,
            "--seq-len", "32", "--batch-size", "8", "--devices", "emulated:2", "--lr", "1e-2",
            "--steps", "6", "--sync", "--quantize", "nf4"]  # fmt: skip
    assert main([*map(str, args)]) == 0
    assert read_config(output / "run.yaml")["quantize"] == "nf4"
    losses = [r["loss"] for r in metrics(output)]
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0]
    base = transformers.AutoModelForCausalLM.from_pretrained(files["model"])
    model = peft.PeftModel.from_pretrained(base, output)
    assert any("lora_" in name for name, _ in model.named_parameters())
