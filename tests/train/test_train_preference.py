"""``roundpipe train --method dpo|kto``: the real command against TRL 1.16's trainers.

The oracle is TRL's ``DPOTrainer``/``KTOTrainer`` trained to the end (``train()``) on
the same tiny model directory, records, seed, batch, learning rate, schedule and
clipping, fp32 (``support/preference_cli.py``): every step's loss and TRL's metrics,
the trained adapter or model, and ``evaluate()`` on the records ``--eval-split`` holds
out. Also: ``--resume`` with ``--sync`` continues as the uninterrupted run did, bit for
bit (a full fine-tune's reference is recomputed before the checkpoint loads); bad data
and options exit with code 2 in one line; a reference that is not finite exits 1.
One step against TRL's loss, metrics and gradients: tests/preference/.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("peft")
pytest.importorskip("yaml")

from support.preference_cli import (  # noqa: E402
    Case,
    assert_weights_match,
    crashed_copy,
    saved_weights,
    train_ours,
    train_trl,
    write_records,
)
from support.train_cli import metrics, run_train  # noqa: E402
from support.train_fixtures import build_model_dir, write_data  # noqa: E402
from support.trl_oracle import paired_records, unpaired_records  # noqa: E402

from roundpipe.cli import main  # noqa: E402

LABELS = [True, False, False, True, True, False, True, False]
CASES = {
    # LoRA, TRL's default loss, 2 of the 8 pairs held out: 6 steps of 6 pairs
    "dpo-lora-sigmoid": Case(
        "dpo", paired_records(8), lora=True, eval_split=0.25, save_every=3,
        settings={"max_steps": 6, "learning_rate": 1e-2, "lr_scheduler_type": "linear",
                  "beta": 0.1, "loss_type": "sigmoid"},
    ),
    # every weight, IPO, conversations through the chat template (our reference
    # precomputed before the first step, TRL's a second copy of the model)
    "dpo-full-ipo-chat": Case(
        "dpo", paired_records(8, seed=1, conversational=True), lora=False, save_every=3,
        settings={"max_steps": 6, "learning_rate": 1e-3, "lr_scheduler_type": "cosine",
                  "beta": 0.5, "loss_type": "ipo"},
    ),
    "kto-lora": Case(
        "kto", unpaired_records(LABELS, seed=2), lora=True,
        settings={"max_steps": 4, "learning_rate": 1e-2, "lr_scheduler_type": "cosine",
                  "beta": 0.2, "desirable_weight": 1.3, "undesirable_weight": 0.8},
    ),
}  # fmt: skip
LOGGED = {  # in metrics.jsonl under TRL's names
    "dpo": ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
            "rewards/margins", "logps/chosen", "logps/rejected", "mean_token_accuracy"),
    "kto": ("loss", "grad_norm", "kl", "rewards/chosen", "rewards/rejected",
            "rewards/margins", "logps/chosen", "logps/rejected"),
}  # fmt: skip
EXACT = {"learning_rate": "lr", "num_tokens": "num_tokens", "epoch": "epoch"}
"""TRL's name -> ours of what both count alike."""
DIFFERENCES = ("rewards/", "kl", "eval_rewards/")
"""Metrics made of differences of two log-probabilities, each near -15 in fp32 (spacing
2e-6 there): they agree to about twice that, :data:`ROUNDING`, more than 1e-5 relative
of a small difference."""
ROUNDING = 4e-6
EVALUATED = ("eval_loss", "eval_rewards/chosen", "eval_rewards/rejected",
             "eval_rewards/accuracies", "eval_rewards/margins", "eval_logps/chosen",
             "eval_logps/rejected")  # fmt: skip


def approx(key: str, expected: float):
    """TRL's value of metric ``key`` to 1e-5 relative, or :data:`ROUNDING` where it is a
    difference of log-probabilities (else 1e-6)."""
    return pytest.approx(expected, rel=1e-5, abs=ROUNDING if key.startswith(DIFFERENCES) else 1e-6)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("preference") / "model")


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    """``runs(name)``: case ``name`` trained by us and by TRL, once per module:
    ``(our --output, TRL's run)``."""

    @functools.cache
    def run(name: str):
        case, root = CASES[name], tmp_path_factory.mktemp(name)
        data = write_records(root / "data.jsonl", case.records)
        train_ours(case, model_dir, data, root / "ours")
        return root / "ours", train_trl(case, model_dir, root / "trl")

    return run


# -- against TRL ----------------------------------------------------------------------


@pytest.mark.parametrize("name", CASES)
def test_every_step_logs_trls_loss_and_metrics(runs, name):
    output, trl = runs(name)
    case = CASES[name]
    ours = metrics(output)
    assert (
        [r["step"] for r in ours]
        == [r["step"] for r in trl.rows]
        == list(range(1, case.settings["max_steps"] + 1))
    )
    for mine, theirs in zip(ours, trl.rows, strict=True):
        for key in LOGGED[case.method]:
            assert mine[key] == approx(key, theirs[key]), (mine["step"], key)
        for trl_name, our_name in EXACT.items():
            assert mine[our_name] == pytest.approx(theirs[trl_name], rel=1e-12), trl_name
    assert ours[-1]["loss"] < ours[0]["loss"]  # it trained


@pytest.mark.parametrize("name", CASES)
def test_the_trained_adapter_or_model_equals_trls(runs, name):
    output, trl = runs(name)
    case = CASES[name]
    assert_weights_match(
        saved_weights(output, case.lora), trl.weights, case.settings["learning_rate"]
    )


def test_the_held_out_loss_and_rewards_equal_trls_evaluate(runs):
    output, trl = runs("dpo-lora-sigmoid")
    last = metrics(output)[-1]
    assert [r["step"] for r in metrics(output) if "eval_loss" in r] == [6]
    for key in EVALUATED:
        assert last[key] == approx(key, trl.evaluated[key]), key


# -- resuming -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dpo-lora-sigmoid", "dpo-full-ipo-chat"])
def test_a_resumed_run_equals_the_uninterrupted_one_bit_for_bit(runs, name, tmp_path):
    """Stopped after step 3's checkpoint; resumed, it ends with the same weights and
    rows (a full fine-tune recomputes its reference from the weights as loaded)."""
    uninterrupted, _ = runs(name)
    lora = CASES[name].lora
    output = crashed_copy(uninterrupted, tmp_path / "out", after=3, lora=lora)
    resumed = run_train("--config", output / "run.yaml", "--output", output, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "step-3 (step 3)" in resumed.stdout
    assert saved_weights(output, lora).keys() == saved_weights(uninterrupted, lora).keys()
    for key, value in saved_weights(uninterrupted, lora).items():
        assert torch.equal(saved_weights(output, lora)[key], value), key
    assert metrics(output) == [
        {**record, "tokens_per_s": got["tokens_per_s"], "elapsed_s": got["elapsed_s"]}
        for record, got in zip(metrics(uninterrupted), metrics(output), strict=True)
    ]


# -- bad input ------------------------------------------------------------------------


def usage_error(capture, *args) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *map(str, args)])
    assert exit_info.value.code == 2
    return capture.readouterr().err


PAIR = {"prompt": "count from 1 to 3", "chosen": " 1 2 3", "rejected": " 3 2 1"}
BAD_DATA = {  # (method, records, extra flags, what the one line says)
    "sft data": ("dpo", [{"prompt": "count from 1 to 3", "completion": "1 2 3"}], [],
                 ':1: --method dpo needs "chosen" and "rejected"'),
    "identical pair": ("dpo", [PAIR, {**PAIR, "rejected": " 1 2 3"}], [],
                       ':2: "chosen" and "rejected" are identical'),
    "empty completion": ("dpo", [PAIR, PAIR, {**PAIR, "chosen": ""}], [],
                         ':3: "chosen" is empty; give it a completion'),
    "prompt over max length": ("dpo", [PAIR, {**PAIR, "prompt": "count " * 12}],
                               ["--seq-len", "8"], ":2: its prompt has 12 tokens"),
    "desirable only": ("kto", [{"prompt": "say", "completion": " hello", "label": True}] * 3,
                       [], ": all 3 examples are desirable (label true)"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_DATA)
def test_bad_preference_data_exits_2_naming_the_record(model_dir, tmp_path, capfd, case):
    method, records, extra, says = BAD_DATA[case]
    data = write_records(tmp_path / "data.jsonl", records)
    err = usage_error(capfd, "--model", model_dir, "--data", data, "--output",
                      tmp_path / "out", "--method", method, *extra)  # fmt: skip
    assert f"{data}{says}" in err, err
    assert len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


BAD_OPTIONS = {  # (method, flags, what the one line says)
    "beta 0": ("dpo", ["--beta", "0"], "--beta must be a positive finite number, got 0.0"),
    "smoothing without robust": ("dpo", ["--label-smoothing", "0.2", "--loss-type", "sigmoid"],
                                 "--label-smoothing 0.2 is used by the robust DPO loss only"),
    "kto option for dpo": ("dpo", ["--desirable-weight", "2"],
                           "--desirable-weight: not an option of --method dpo"),
    "beta for sft": ("sft", ["--beta", "0.2"], "--beta: not an option of --method sft"),
    "packing": ("dpo", ["--packing"],
                "--packing is an SFT option: --method dpo scores completions"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_OPTIONS)
def test_bad_preference_options_exit_2_naming_the_option(model_dir, tmp_path, capfd, case):
    method, flags, says = BAD_OPTIONS[case]
    if method == "sft":
        data = write_data(tmp_path / "data.jsonl", "prompt_completion", lines=4)
    else:
        data = write_records(tmp_path / "data.jsonl", [PAIR, PAIR])
    err = usage_error(capfd, "--model", model_dir, "--data", data, "--output",
                      tmp_path / "out", "--method", method, *flags)  # fmt: skip
    assert says in err, err
    assert len(err.splitlines()) == 1, err


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_a_reference_that_is_not_finite_stops_the_run_with_exit_1(tmp_path, capfd, lora):
    """A model whose output is NaN (its final norm's weight): the reference (LoRA: the
    pipe with its adapters off; full: computed before the first step) is refused
    before any weight changes."""
    from safetensors.torch import load_file, save_file

    model = build_model_dir(tmp_path / "model")
    weights = load_file(str(model / "model.safetensors"))
    weights["model.norm.weight"] = torch.full_like(weights["model.norm.weight"], float("nan"))
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    data = write_records(tmp_path / "data.jsonl", [PAIR, PAIR])
    output = tmp_path / "out"
    code = main(["train", "--model", str(model), "--data", str(data), "--output", str(output),
                 "--method", "dpo", "--devices", "emulated:2", "--steps", "2", "--batch-size",
                 "2", *([] if lora else ["--full"])])  # fmt: skip
    err = capfd.readouterr().err
    assert code == 1, err
    assert "step 1: the reference log-probabilities are not finite" in err
    assert sorted(p.name for p in output.iterdir()) == ["metrics.jsonl", "run.lock", "run.yaml"]
