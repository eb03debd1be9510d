"""``roundpipe train``: the real command in a subprocess, on a tiny Qwen3 built in code.

What a run writes and that it trains as the oracles do: a plain peft +
``torch.optim.AdamW`` loop on the same batches (the trained adapter and the logged
losses), ``transformers``/``peft`` loading the output, the model's own loss for the
logged eval loss. Options from a YAML file and the command line, epochs, the demo and
the console script. The runs are shared with the other train tests (``train_runs`` in
``conftest.py``); resuming and Ctrl-C: ``test_train_resume.py``; bad input:
``test_train_errors.py``.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("yaml")

from support.train_cli import checkpoint_steps, metrics, reference_schedule  # noqa: E402

import roundpipe  # noqa: E402
from roundpipe.cli import main  # noqa: E402

METRIC_KEYS = {"step", "epoch", "loss", "lr", "tokens", "num_tokens", "tokens_per_s", "elapsed_s"}


# -- training ------------------------------------------------------------------------


@pytest.mark.parametrize("data_format", ["text", "prompt_completion", "messages"])
def test_each_data_format_trains_and_the_loss_falls(train_runs, data_format):
    losses = [record["loss"] for record in metrics(train_runs[data_format])]
    assert len(losses) == 10
    assert sum(losses[-3:]) / 3 < 0.97 * sum(losses[:3]) / 3, losses  # beyond batch noise


def test_metrics_hold_one_line_per_step_with_cumulative_tokens_and_time(train_runs):
    records = metrics(train_runs["prompt_completion"])
    assert [r["step"] for r in records] == list(range(1, 11))
    assert all(set(r) >= METRIC_KEYS for r in records)
    assert [r["step"] for r in records if "eval_loss" in r] == [5, 10]
    for key in ("tokens", "elapsed_s"):
        values = [r[key] for r in records]
        assert values == sorted(values) and values[0] > 0
    assert all(r["tokens_per_s"] > 0 for r in records)
    steps_per_epoch = 48 // 8  # the data's 48 examples in batches of 8: Trainer's epoch
    assert [r["epoch"] for r in records] == [s / steps_per_epoch for s in range(1, 11)]
    assert all(r["num_tokens"] == r["tokens"] for r in records)


def test_the_loss_plot_and_the_resolved_options_are_written(train_runs):
    import yaml

    output = train_runs["prompt_completion"]
    assert (output / "loss.png").read_bytes().startswith(b"\x89PNG")
    resolved = yaml.safe_load((output / "run.yaml").read_text())
    assert resolved["devices"] == "emulated:2" and resolved["precision"] == "fp32"
    assert resolved["lora_r"] == 4 and resolved["seq_len"] == 32 and resolved["sync"] is True


def test_config_file_options_apply_and_command_line_flags_override_them(train_runs):
    import yaml

    resolved = yaml.safe_load((train_runs["text"] / "run.yaml").read_text())
    assert (resolved["warmup_steps"], resolved["schedule"], resolved["weight_decay"]) == (
        1,
        "linear",
        0.1,
    )  # from the YAML
    assert resolved["lr"] == 1e-2  # the flag wins over the YAML's 5e-3
    lrs = [r["lr"] for r in metrics(train_runs["text"])]
    assert lrs[0] == 0.0 and lrs[-1] == pytest.approx(1e-2 * (1 - 8 / 9))  # Trainer's warm-up


def test_config_values_convert_as_on_the_command_line(tmp_path):
    from roundpipe.train.options import read_config

    config = tmp_path / "run.yaml"
    config.write_text("lr: 2e-4\nlora_targets: [q_proj, v_proj]\nsteps: null\nsync: true\n")
    assert read_config(config) == {"lr": 2e-4, "lora_targets": "q_proj,v_proj", "sync": True}


def test_only_the_newest_checkpoints_are_kept(train_runs):
    # saves at 3, 6, 9 and 10 (the end); two are kept
    assert checkpoint_steps(train_runs["text"]) == [9, 10]


def test_lora_training_equals_a_plain_peft_adamw_loop(train_runs, tmp_path):
    """The adapter written by the command equals peft + AdamW trained on the same
    batches from the same initial adapter, with the same schedule and clipping."""
    from roundpipe.train.loop import build_pipe
    from roundpipe.train.options import read_config, resolve
    from roundpipe.train.preflight import prepare

    output = train_runs["prompt_completion"]
    options = resolve({"output": tmp_path}, read_config(output / "run.yaml"))
    prepared = prepare(options)  # the run's own batches
    pipe, _ = build_pipe(prepared.options)  # the initial adapter, as the command built it
    with pipe:
        initial = {k: v.detach().clone() for k, v in pipe.hf_model.state_dict().items()}
    base = transformers.AutoModelForCausalLM.from_pretrained(options.model, dtype=torch.float32)
    lora = peft.LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj", "down_proj"])
    reference = peft.get_peft_model(base, lora)
    reference.load_state_dict(initial)
    params = [p for p in reference.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    losses, accuracies = [], []
    for step in range(10):
        for group in optimizer.param_groups:
            group["lr"] = reference_schedule(step, warmup=2, total=10, peak=1e-2)
        batch = prepared.train_batches.batch(step)
        out = reference(**batch)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(out.loss.item())
        accuracies.append(trl_token_accuracy(out.logits, batch["labels"]))
    records = metrics(output)
    assert [r["loss"] for r in records] == pytest.approx(losses, rel=1e-4)
    assert [r["mean_token_accuracy"] for r in records] == pytest.approx(accuracies, abs=1e-12)
    assert [r["lr"] for r in records] == pytest.approx(
        [reference_schedule(s, 2, 10, 1e-2) for s in range(10)], rel=1e-12
    )
    base = transformers.AutoModelForCausalLM.from_pretrained(options.model, dtype=torch.float32)
    trained = peft.PeftModel.from_pretrained(base, output)
    want = dict(reference.named_parameters())
    for name, got in trained.named_parameters():
        if "lora_" in name:
            torch.testing.assert_close(got, want[name], rtol=1e-3, atol=1e-5)


def test_the_logged_eval_loss_is_the_trained_models_mean_token_loss(
    train_runs, train_files, tmp_path
):
    from roundpipe.train.options import read_config, resolve
    from roundpipe.train.preflight import prepare

    output = train_runs["prompt_completion"]
    prepared = prepare(resolve({"output": tmp_path}, read_config(output / "run.yaml")))
    base = transformers.AutoModelForCausalLM.from_pretrained(
        train_files["model"], dtype=torch.float32
    )
    trained = peft.PeftModel.from_pretrained(base, output).eval()
    total, count, accuracies = 0.0, 0, []
    with torch.no_grad():
        for index in range(prepared.eval_batches.steps_per_epoch):
            batch = prepared.eval_batches.batch(index)
            tokens = int((batch["labels"][:, 1:] != -100).sum())
            out = trained(**batch)
            total += out.loss.item() * tokens  # the model's mean, re-weighted
            count += tokens
            accuracies.append(trl_token_accuracy(out.logits, batch["labels"]))
    assert metrics(output)[-1]["eval_loss"] == pytest.approx(total / count, rel=1e-4)
    # as TRL logs it: the mean over the evaluation's batches of each one's accuracy
    want = sum(accuracies) / len(accuracies)
    assert metrics(output)[-1]["eval_mean_token_accuracy"] == pytest.approx(want, abs=1e-12)


def trl_token_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """SFTTrainer's ``mean_token_accuracy`` of one batch: the share of its label tokens
    (shifted by one, -100 ignored) that are the logits' argmax."""
    shift_labels = labels[..., 1:]
    mask = shift_labels != -100
    correct = (logits[..., :-1, :].argmax(dim=-1) == shift_labels) & mask
    return (correct.sum() / mask.sum()).item()


def test_a_full_fine_tune_writes_a_model_that_transformers_loads_as_trained(
    train_runs, train_files
):
    """The output directory loads on its own (model and tokenizer) and computes what
    the final checkpoint, restored into a pipe, computes."""

    output = train_runs["text"]
    model = transformers.AutoModelForCausalLM.from_pretrained(output, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(output)
    batch = tokenizer(["count from 2 to 6 2 3 4 5 6", "count from 1 to 4"], padding=True,
                      return_tensors="pt")  # fmt: skip
    with roundpipe.from_pretrained(
        train_files["model"], torch_dtype=torch.float32, devices="emulated:1"
    ) as pipe:
        pipe.load_checkpoint(output / "checkpoints" / "step-10")
        with torch.no_grad():
            want = pipe(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    with torch.no_grad():
        got = model(**batch).logits
    mask = batch["attention_mask"].bool()
    torch.testing.assert_close(got[mask], want[mask], rtol=1e-5, atol=1e-5)


def test_epochs_count_whole_passes_over_the_data(train_files, tmp_path):
    from roundpipe.train.options import resolve
    from roundpipe.train.preflight import prepare

    given = {"model": train_files["model"], "data": train_files["text"], "output": tmp_path,
             "epochs": 3, "batch_size": 5, "seq_len": 32}  # fmt: skip
    prepared = prepare(resolve(given))
    assert prepared.train_batches.steps_per_epoch == math.ceil(48 / 5)
    assert prepared.total_steps == 3 * math.ceil(48 / 5)


# -- the demo, the console script ------------------------------------------------------


def test_demo_trains_with_its_preset_prints_samples_and_starts_over_when_run_again(
    tmp_path, monkeypatch, capsys
):
    import yaml

    import roundpipe.train.demo as demo

    seen = {}

    def fake_samples(base_dir, trained_dir, prompts, max_new_tokens=32):
        seen.update(base=base_dir, trained=trained_dir)
        return [(prompts[0], "before", "after")]

    monkeypatch.setattr(demo, "sample_generations", fake_samples)
    demo_run = ["train", "--demo", "--output", str(tmp_path), "--batch-size", "4"]
    assert main([*demo_run, "--steps", "2", "--seq-len", "64"]) == 0
    assert main([*demo_run, "--steps", "1"]) == 0  # the first run's checkpoints are removed
    assert checkpoint_steps(tmp_path) == [1]
    resolved = yaml.safe_load((tmp_path / "run.yaml").read_text())
    preset = demo.prepare_demo(tmp_path).options
    assert resolved["full"] is True and resolved["lr"] == preset["lr"]
    assert (resolved["steps"], resolved["batch_size"]) == (1, 4)  # the flags win
    assert resolved["seq_len"] == preset["seq_len"]
    assert seen == {"base": tmp_path / "base-model", "trained": tmp_path.absolute()}
    assert "before" in capsys.readouterr().out
    assert (tmp_path / "model.safetensors").exists()


def test_the_console_script_runs_the_train_command():
    script = Path(sys.executable).with_name("roundpipe")
    if not script.exists():
        pytest.skip("the roundpipe console script is not installed in this environment")
    done = subprocess.run([script, "train", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "--lora-targets" in done.stdout and "--resume" in done.stdout


def test_the_run_yaml_of_a_full_run_works_as_its_config(tmp_path):
    """It records no LoRA options (``--full`` refuses them); a checkpoint of an earlier
    full run, whose record holds them, still resumes."""
    from roundpipe.train.checkpoints import Found, Position, check_compatible
    from roundpipe.train.options import read_config, resolve, write_run_yaml

    options = resolve({"model": "m", "data": "d", "output": tmp_path, "full": True})
    write_run_yaml(options, tmp_path / "run.yaml")
    config = read_config(tmp_path / "run.yaml")
    assert not [key for key in config if key.startswith("lora_")]
    assert resolve({}, config) == options
    earlier = {**options.run_record(), "lora_r": 16, "lora_targets": "all-linear"}
    check_compatible(Found(tmp_path, Position(1, 0, 0.0), earlier, 1), options)
