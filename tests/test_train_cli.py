"""``roundpipe train``: the real command in a subprocess, on a tiny Qwen3 built in code.

Oracles: a plain peft + ``torch.optim.AdamW`` loop on the same batches (the trained
adapter and the logged losses), ``transformers``/``peft`` loading the output, the
model's own loss for the logged eval loss, and an uninterrupted run for ``--resume``.
Errors are checked in-process through ``roundpipe.cli.main`` (exit code 2 and the
message), two of them also through a real process.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("yaml")

from support.train_fixtures import build_model_dir, write_data  # noqa: E402

import roundpipe  # noqa: E402
from roundpipe.cli import main  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
COMMON = ("--seq-len", "32", "--batch-size", "8", "--devices", "emulated:2", "--lr", "1e-2")
METRIC_KEYS = {"step", "loss", "lr", "tokens", "tokens_per_s", "elapsed_s"}
RUN_LIMIT_S = 180


def train_process(*args, env: dict | None = None, **popen) -> subprocess.Popen:
    environment = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    command = [sys.executable, "-m", "roundpipe", "train", *map(str, args)]
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment,
        cwd=REPO, **popen,
    )  # fmt: skip


def run_train(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    process = train_process(*args, env=env)
    out, err = process.communicate(timeout=RUN_LIMIT_S)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def metrics(output: Path) -> list[dict]:
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


def checkpoint_steps(output: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (output / "checkpoints").glob("step-*"))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("train")
    found = {"root": root, "model": build_model_dir(root / "model")}
    for data_format in ("text", "prompt_completion", "messages"):
        found[data_format] = write_data(root / f"{data_format}.jsonl", data_format)
    found["eval"] = write_data(root / "eval.jsonl", "prompt_completion", lines=12, seed=1)
    return found


@pytest.fixture(scope="module")
def runs(files) -> dict[str, Path]:
    """One finished run per data format, each exercising other options."""
    root, model = files["root"], files["model"]
    config = root / "text.yaml"
    config.write_text(
        "warmup-steps: 1\nlr: 5.0e-3\nschedule: linear\nweight_decay: 0.1\nsave_every: 3\n"
    )
    plan = {
        # full fine-tune, options from YAML (lr overridden here), a torchrun of one process
        "text": (["--full", "--config", config, "--lr", "1e-2"], {"WORLD_SIZE": "1", "RANK": "0"}),
        # LoRA with exact steps, warm-up, clipping, evaluation and a checkpoint half-way
        "prompt_completion": (
            ["--sync", "--warmup-steps", "2", "--grad-clip", "0.5", "--eval-data", files["eval"],
             "--eval-every", "5", "--lora-r", "4", "--lora-targets", "q_proj,v_proj,down_proj",
             "--save-every", "5"],
            None,
        ),
        # LoRA with asynchronous steps on packed sequences
        "messages": (["--packing"], None),
    }  # fmt: skip
    outputs = {}
    for name, (extra, env) in plan.items():
        output = root / f"out-{name}"
        done = run_train(
            "--model", model, "--data", files[name], "--output", output, *COMMON, "--steps",
            "10", *extra, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        outputs[name] = output
    return outputs


# -- training ------------------------------------------------------------------------


@pytest.mark.parametrize("data_format", ["text", "prompt_completion", "messages"])
def test_each_data_format_trains_and_the_loss_falls(runs, data_format):
    losses = [record["loss"] for record in metrics(runs[data_format])]
    assert len(losses) == 10
    assert sum(losses[-3:]) / 3 < 0.97 * sum(losses[:3]) / 3, losses  # beyond batch noise


def test_metrics_hold_one_line_per_step_with_cumulative_tokens_and_time(runs):
    records = metrics(runs["prompt_completion"])
    assert [r["step"] for r in records] == list(range(1, 11))
    assert all(set(r) >= METRIC_KEYS for r in records)
    assert [r["step"] for r in records if "eval_loss" in r] == [5, 10]
    for key in ("tokens", "elapsed_s"):
        values = [r[key] for r in records]
        assert values == sorted(values) and values[0] > 0
    assert all(r["tokens_per_s"] > 0 for r in records)


def test_the_loss_plot_and_the_resolved_options_are_written(runs):
    import yaml

    output = runs["prompt_completion"]
    assert (output / "loss.png").read_bytes().startswith(b"\x89PNG")
    resolved = yaml.safe_load((output / "run.yaml").read_text())
    assert resolved["devices"] == "emulated:2" and resolved["precision"] == "fp32"
    assert resolved["lora_r"] == 4 and resolved["seq_len"] == 32 and resolved["sync"] is True


def test_config_file_options_apply_and_command_line_flags_override_them(runs):
    import yaml

    resolved = yaml.safe_load((runs["text"] / "run.yaml").read_text())
    assert (resolved["warmup_steps"], resolved["schedule"], resolved["weight_decay"]) == (
        1,
        "linear",
        0.1,
    )  # from the YAML
    assert resolved["lr"] == 1e-2  # the flag wins over the YAML's 5e-3
    lrs = [r["lr"] for r in metrics(runs["text"])]
    assert lrs[0] == pytest.approx(1e-2 / 2) and lrs[-1] == pytest.approx(1e-2 * (1 - 8 / 9))


def test_config_values_convert_as_on_the_command_line(tmp_path):
    from roundpipe.train.options import read_config

    config = tmp_path / "run.yaml"
    config.write_text("lr: 2e-4\nlora_targets: [q_proj, v_proj]\nsteps: null\nsync: true\n")
    assert read_config(config) == {"lr": 2e-4, "lora_targets": "q_proj,v_proj", "sync": True}


def test_only_the_newest_checkpoints_are_kept(runs):
    # saves at 3, 6, 9 and 10 (the end); two are kept
    assert checkpoint_steps(runs["text"]) == [9, 10]


def reference_schedule(step: int, warmup: int, total: int, peak: float) -> float:
    """Linear warm-up from peak/(warmup+1), then a cosine decay that reaches 0 at total."""
    if step < warmup:
        return peak * (step + 1) / (warmup + 1)
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


def test_lora_training_equals_a_plain_peft_adamw_loop(runs, tmp_path):
    """The adapter written by the command equals peft + AdamW trained on the same
    batches from the same initial adapter, with the same schedule and clipping."""
    from roundpipe.train.loop import build_pipe
    from roundpipe.train.options import read_config, resolve
    from roundpipe.train.preflight import prepare

    output = runs["prompt_completion"]
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
    losses = []
    for step in range(10):
        for group in optimizer.param_groups:
            group["lr"] = reference_schedule(step, warmup=2, total=10, peak=1e-2)
        loss = reference(**prepared.train_batches.batch(step)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    records = metrics(output)
    assert [r["loss"] for r in records] == pytest.approx(losses, rel=1e-4)
    assert [r["lr"] for r in records] == pytest.approx(
        [reference_schedule(s, 2, 10, 1e-2) for s in range(10)], rel=1e-12
    )
    base = transformers.AutoModelForCausalLM.from_pretrained(options.model, dtype=torch.float32)
    trained = peft.PeftModel.from_pretrained(base, output)
    want = dict(reference.named_parameters())
    for name, got in trained.named_parameters():
        if "lora_" in name:
            torch.testing.assert_close(got, want[name], rtol=1e-3, atol=1e-5)


def test_the_logged_eval_loss_is_the_trained_models_mean_token_loss(runs, files, tmp_path):
    from roundpipe.train.options import read_config, resolve
    from roundpipe.train.preflight import prepare

    output = runs["prompt_completion"]
    prepared = prepare(resolve({"output": tmp_path}, read_config(output / "run.yaml")))
    base = transformers.AutoModelForCausalLM.from_pretrained(files["model"], dtype=torch.float32)
    trained = peft.PeftModel.from_pretrained(base, output).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for index in range(prepared.eval_batches.steps_per_epoch):
            batch = prepared.eval_batches.batch(index)
            tokens = int((batch["labels"][:, 1:] != -100).sum())
            total += trained(**batch).loss.item() * tokens  # the model's mean, re-weighted
            count += tokens
    assert metrics(output)[-1]["eval_loss"] == pytest.approx(total / count, rel=1e-4)


def test_a_full_fine_tune_writes_a_model_that_transformers_loads_as_trained(runs, files):
    """The output directory loads on its own (model and tokenizer) and computes what
    the final checkpoint, restored into a pipe, computes."""

    output = runs["text"]
    model = transformers.AutoModelForCausalLM.from_pretrained(output, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(output)
    batch = tokenizer(["count from 2 to 6 2 3 4 5 6", "count from 1 to 4"], padding=True,
                      return_tensors="pt")  # fmt: skip
    with roundpipe.from_pretrained(
        files["model"], torch_dtype=torch.float32, devices="emulated:1"
    ) as pipe:
        pipe.load_checkpoint(output / "checkpoints" / "step-10")
        with torch.no_grad():
            want = pipe(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    with torch.no_grad():
        got = model(**batch).logits
    mask = batch["attention_mask"].bool()
    torch.testing.assert_close(got[mask], want[mask], rtol=1e-5, atol=1e-5)


# -- resume and Ctrl-C -----------------------------------------------------------------


def crashed_copy(output: Path, into: Path) -> Path:
    """``output`` as a crash right after step 5's checkpoint would have left it: step 10's
    checkpoint and the adapter lost, the metrics lines of steps 6-10 written."""
    shutil.copytree(output, into)
    shutil.rmtree(into / "checkpoints" / "step-10")
    (into / "adapter_model.safetensors").unlink()
    return into


def test_a_resumed_run_equals_the_uninterrupted_one_bit_for_bit(runs, tmp_path):
    uninterrupted = runs["prompt_completion"]  # --sync, 10 steps, a checkpoint at 5
    output = crashed_copy(uninterrupted, tmp_path / "out")
    resumed = run_train("--config", output / "run.yaml", "--output", output, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "step-5 (step 5)" in resumed.stdout
    adapter = "adapter_model.safetensors"
    assert (output / adapter).read_bytes() == (uninterrupted / adapter).read_bytes()
    assert metrics(output) == [
        {**record, "tokens_per_s": got["tokens_per_s"], "elapsed_s": got["elapsed_s"]}
        for record, got in zip(metrics(uninterrupted), metrics(output), strict=True)
    ]  # the same losses, learning rates, token counts and eval losses
    elapsed = [r["elapsed_s"] for r in metrics(output)]
    assert elapsed[5] > elapsed[4]  # counted on from the checkpoint's


def test_ctrl_c_writes_a_checkpoint_exits_130_and_resume_continues_there(files, tmp_path):
    args = ("--model", files["model"], "--data", files["text"], "--output", tmp_path, *COMMON,
            "--save-every", "2", "--keep-checkpoints", "1")  # fmt: skip
    # a background shell starts children with SIGINT ignored; this child must take it
    process = train_process(
        *args, "--steps", "5000", preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)
    )
    deadline = time.monotonic() + RUN_LIMIT_S
    while not ((tmp_path / "metrics.jsonl").exists() and len(metrics(tmp_path)) >= 3):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=RUN_LIMIT_S)
    assert process.returncode == 130, err
    done = metrics(tmp_path)[-1]["step"]
    assert checkpoint_steps(tmp_path) == [done] and done >= 3
    assert [r["step"] for r in metrics(tmp_path)] == list(range(1, done + 1))
    resumed = run_train(*args, "--steps", done + 2, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert f"step-{done} (step {done})" in resumed.stdout
    assert [r["step"] for r in metrics(tmp_path)] == list(range(1, done + 3))


def test_a_second_ctrl_c_abandons_the_step_and_the_run_still_resumes_exactly(
    runs, tmp_path, monkeypatch
):
    """A Ctrl-C that lands after step 8's forward-backward, before its optimizer step
    (in-process, for a deterministic place): its gradients are dropped, step 7's
    checkpoint is written, and resuming ends with the uninterrupted run's adapter."""
    from roundpipe.hf.pipe import HFRoundPipe

    uninterrupted = runs["prompt_completion"]
    real_forward_backward = HFRoundPipe.forward_backward
    calls = []

    def interrupted_in_step_8(self, *args, **kwargs):
        loss = real_forward_backward(self, *args, **kwargs)
        calls.append(loss)
        if len(calls) == 8:
            raise KeyboardInterrupt
        return loss

    monkeypatch.setattr(HFRoundPipe, "forward_backward", interrupted_in_step_8)
    run = ["train", "--config", str(uninterrupted / "run.yaml"), "--output", str(tmp_path)]
    assert main(run) == 130
    assert checkpoint_steps(tmp_path) == [5, 7]
    assert [r["step"] for r in metrics(tmp_path)] == list(range(1, 8))
    monkeypatch.undo()
    assert main([*run, "--resume"]) == 0
    adapter = "adapter_model.safetensors"
    assert (tmp_path / adapter).read_bytes() == (uninterrupted / adapter).read_bytes()


def test_resume_may_raise_the_steps_and_the_schedule_spans_the_new_total(runs, tmp_path):
    output = crashed_copy(runs["prompt_completion"], tmp_path / "out")
    done = run_train("--config", output / "run.yaml", "--output", output, "--steps", "12",
                     "--resume")  # fmt: skip
    assert done.returncode == 0, done.stderr
    records = metrics(output)
    assert [r["step"] for r in records] == list(range(1, 13))
    assert [r["lr"] for r in records[5:]] == pytest.approx(
        [reference_schedule(s, 2, 12, 1e-2) for s in range(5, 12)], rel=1e-12
    )


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


# -- errors: exit code 2 and a message naming the problem, before any training ---------


def usage_error(capsys, *args) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *map(str, args)])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.fixture(scope="module")
def broken(files) -> dict[str, Path]:
    root = files["root"]
    no_tokenizer = build_model_dir(root / "no-tokenizer", with_tokenizer=False)
    no_weights = root / "no-weights"
    no_weights.mkdir()
    shutil.copy(files["model"] / "config.json", no_weights)
    bin_only = root / "bin-only"  # weights roundpipe.from_pretrained does not load
    bin_only.mkdir()
    shutil.copy(files["model"] / "config.json", bin_only)
    (bin_only / "pytorch_model.bin").write_bytes(b"")
    bad_data = root / "bad.jsonl"
    bad_data.write_text('{"text": "count from 1 to 4 1 2 3 4"}\n\n{"text": oops}\n')
    unknown_key = root / "unknown.yaml"
    unknown_key.write_text("lora-rank: 8\n")
    return {"no_tokenizer": no_tokenizer, "no_weights": no_weights, "bin_only": bin_only,
            "bad_data": bad_data, "unknown_key": unknown_key}  # fmt: skip


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
    "too many microbatches": ({"--microbatches": "9"}, "--microbatches 9 exceeds"),
    "bad devices": ({"--devices": "tpu:3"}, "--devices 'tpu:3'"),
    "unknown yaml key": ({"--config": "{unknown_key}"}, "unknown option 'lora-rank'"),
}


@pytest.mark.parametrize("case", ERRORS, ids=list(ERRORS))
def test_bad_input_exits_2_naming_the_problem(files, broken, tmp_path, capsys, case):
    changes, message = ERRORS[case]
    names = {**files, **broken}
    changed = {flag: value and value.format(**names) for flag, value in changes.items()}
    args = {"--model": files["model"], "--data": files["text"], "--output": tmp_path / "out"}
    args.update(changed)
    argv = [str(x) for flag, value in args.items() for x in (flag, value) if x is not None]
    assert message in usage_error(capsys, *argv)
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_resume_refuses_a_checkpoint_of_another_adapter_shape_or_model(runs, files, capsys):
    output = runs["prompt_completion"]
    common = ("--data", files["prompt_completion"], "--output", output, "--resume",
              "--steps", "20", *COMMON)  # fmt: skip
    other_rank = usage_error(capsys, "--model", files["model"], *common, "--lora-r", "8",
                             "--lora-targets", "q_proj,v_proj,down_proj")  # fmt: skip
    assert "--lora-r 4 there, 8 here" in other_rank
    other_model = build_model_dir(files["root"] / "other-model", seed=1)
    err = usage_error(capsys, "--model", other_model, *common, "--lora-r", "4",
                      "--lora-targets", "q_proj,v_proj,down_proj")  # fmt: skip
    assert "another model" in err and "other-model" in err


def test_a_new_run_refuses_an_output_holding_checkpoints(runs, files, capsys):
    err = usage_error(capsys, "--model", files["model"], "--data", files["text"], "--output",
                      runs["text"])  # fmt: skip
    assert "holds checkpoints of an earlier run (step 10)" in err and "--resume" in err


def test_a_missing_dependency_is_named_with_the_install_command(files, capsys, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "peft" else find_spec(name, *a),
    )
    err = usage_error(capsys, "--model", files["model"], "--data", files["text"], "--output",
                      files["root"] / "unused")  # fmt: skip
    assert "needs peft" in err and "pip install 'roundpipe[train]'" in err


def test_epochs_count_whole_passes_over_the_data(files, tmp_path):
    from roundpipe.train.options import resolve
    from roundpipe.train.preflight import prepare

    given = {"model": files["model"], "data": files["text"], "output": tmp_path, "epochs": 3,
             "batch_size": 5, "seq_len": 32}  # fmt: skip
    prepared = prepare(resolve(given))
    assert prepared.train_batches.steps_per_epoch == math.ceil(48 / 5)
    assert prepared.total_steps == 3 * math.ceil(48 / 5)


def test_several_processes_without_torchruns_variables_exit_2(files, tmp_path, capsys, monkeypatch):
    """(Training under torchrun: tests/test_train_multinode.py.)"""
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    err = usage_error(capsys, "--model", files["model"], "--data", files["text"], "--output",
                      tmp_path)  # fmt: skip
    assert "WORLD_SIZE=2 but RANK, MASTER_ADDR, MASTER_PORT not set" in err and "torchrun" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "2", "--epochs", "2"], "not both"),
        (["--data", "{bad_data}"], "bad.jsonl:3"),
    ],
)
def test_the_real_process_exits_2_on_bad_input(files, broken, tmp_path, args, message):
    args = [a.format(**broken) for a in args]
    data = [] if "--data" in args else ["--data", files["text"]]
    done = run_train("--model", files["model"], *data, "--output", tmp_path, *args)
    assert done.returncode == 2 and message in done.stderr
    assert "Traceback" not in done.stderr
