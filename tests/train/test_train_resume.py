"""``roundpipe train --resume`` and Ctrl-C: a resumed run equals the uninterrupted one.

The oracle is an uninterrupted run (``train_runs`` in ``conftest.py``, shared with the
other train tests): a run resumed from a checkpoint ends with its adapter bit for bit
and its metrics; Ctrl-C (once: a checkpoint, exit code 130; twice: the step abandoned)
leaves a run that resumes exactly; resume may raise the step count.
"""

from __future__ import annotations

import shutil
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("yaml")

from support.train_cli import (  # noqa: E402
    COMMON,
    RUN_LIMIT_S,
    checkpoint_steps,
    metrics,
    reference_schedule,
    run_train,
    train_process,
)

from roundpipe.cli import main  # noqa: E402


def crashed_copy(output: Path, into: Path) -> Path:
    """``output`` as a crash right after step 5's checkpoint would have left it: step 10's
    checkpoint and the adapter lost, the metrics lines of steps 6-10 written."""
    shutil.copytree(output, into)
    shutil.rmtree(into / "checkpoints" / "step-10")
    (into / "adapter_model.safetensors").unlink()
    return into


def test_a_resumed_run_equals_the_uninterrupted_one_bit_for_bit(train_runs, tmp_path):
    uninterrupted = train_runs["prompt_completion"]  # --sync, 10 steps, a checkpoint at 5
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


def test_ctrl_c_writes_a_checkpoint_exits_130_and_resume_continues_there(train_files, tmp_path):
    args = ("--model", train_files["model"], "--data", train_files["text"], "--output", tmp_path,
            *COMMON, "--save-every", "2", "--keep-checkpoints", "1")  # fmt: skip
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
    train_runs, tmp_path, monkeypatch
):
    """A Ctrl-C that lands after step 8's forward-backward, before its optimizer step
    (in-process, for a deterministic place): its gradients are dropped, step 7's
    checkpoint is written, and resuming ends with the uninterrupted run's adapter."""
    from roundpipe.hf.pipe import HFRoundPipe

    uninterrupted = train_runs["prompt_completion"]
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


def test_resume_may_raise_the_steps_and_the_schedule_spans_the_new_total(train_runs, tmp_path):
    output = crashed_copy(train_runs["prompt_completion"], tmp_path / "out")
    done = run_train("--config", output / "run.yaml", "--output", output, "--steps", "12",
                     "--resume")  # fmt: skip
    assert done.returncode == 0, done.stderr
    records = metrics(output)
    assert [r["step"] for r in records] == list(range(1, 13))
    assert [r["lr"] for r in records[5:]] == pytest.approx(
        [reference_schedule(s, 2, 12, 1e-2) for s in range(5, 12)], rel=1e-12
    )


def cut_in_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def without_a_tensor(path: Path) -> None:
    """A whole safetensors file, one tensor short: only loading it finds the damage."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as file:
        metadata = file.metadata()
        tensors = {key: file.get_tensor(key) for key in list(file.keys())[1:]}
    save_file(tensors, str(path), metadata=metadata)


@pytest.mark.parametrize(
    ("damage", "file"), [(cut_in_half, "optimizer"), (without_a_tensor, "weights")]
)
def test_resume_falls_back_to_the_previous_checkpoint_when_the_newest_is_damaged(
    train_runs, tmp_path, damage, file
):
    """Step 10's checkpoint damaged: resumed from step 5 with a warning naming the
    damaged file, the run ends as the uninterrupted one, bit for bit."""
    uninterrupted = train_runs["prompt_completion"]
    output = tmp_path / "out"
    shutil.copytree(uninterrupted, output)
    (output / "adapter_model.safetensors").unlink()
    damaged = output / "checkpoints" / "step-10" / f"{file}.safetensors"
    damage(damaged)
    resumed = run_train("--config", output / "run.yaml", "--output", output, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    [warning] = [line for line in resumed.stdout.splitlines() if line.startswith("warning:")]
    assert str(damaged) in warning
    assert "step-5 (step 5)" in resumed.stdout
    adapter = "adapter_model.safetensors"
    assert (output / adapter).read_bytes() == (uninterrupted / adapter).read_bytes()


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``root`` but the lock: its bytes and modification time."""
    return {
        str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file() and p.name != "run.lock"
    }


def test_resuming_a_finished_run_says_so_and_rewrites_nothing(train_runs, tmp_path, capsys):
    output = tmp_path / "out"
    shutil.copytree(train_runs["prompt_completion"], output)
    before = snapshot(output)
    assert main(["train", "--config", str(output / "run.yaml"), "--output", str(output),
                 "--resume"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "finished: all 10 steps" in out and "steps 11-10" not in out
    assert snapshot(output) == before


def test_resuming_a_finished_run_whose_result_is_missing_writes_the_result(
    train_runs, tmp_path, capsys
):
    """Killed while it wrote the adapter, after its last checkpoint: --resume writes
    the adapter the run trained, without training."""
    uninterrupted = train_runs["prompt_completion"]
    output = tmp_path / "out"
    shutil.copytree(uninterrupted, output)
    adapter = output / "adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[:100])
    assert main(["train", "--config", str(output / "run.yaml"), "--output", str(output),
                 "--resume"]) == 0  # fmt: skip
    assert "writing the LoRA adapter" in capsys.readouterr().out
    assert adapter.read_bytes() == (uninterrupted / adapter.name).read_bytes()
    assert metrics(output) == metrics(uninterrupted)
