"""``roundpipe train`` under ``torchrun``: 2 local processes on gloo, emulated devices.

Oracles: one process training on the same global batches (losses, eval loss, the saved
model), the uninterrupted 2-process run for ``--resume``, and the files each rank's own
``--output`` holds (the ranks get separate directories, as machines without a shared
filesystem would). Tolerance of the 2-process run against the one-process run, fp32:
with one microbatch per rank against two in the single process, the microbatches are
the same rows and only the order of float sums differs (the gradients summed across
ranks, the clipping norm taken in float64): losses within 1e-5 relative, weights within
1e-5 absolute after 6 AdamW steps (measured: 8e-8 and 1.2e-7).
"""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("yaml")

from support.train_fixtures import build_model_dir, write_data  # noqa: E402
from support.train_ranks import (  # noqa: E402
    LIMIT_S,
    assert_stopped_with_their_shards,
    finish,
    metrics,
    run_ranks,
    single,
    start_a_long_run,
    start_ranks,
    torchrun,
    wait_for_steps,
)

from roundpipe.cli import main  # noqa: E402
from roundpipe.train.options import UsageError  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("train-ranks")
    return {
        "root": root,
        "model": build_model_dir(root / "model"),
        "data": write_data(root / "text.jsonl", "text"),
        "eval": write_data(root / "eval.jsonl", "prompt_completion", lines=12, seed=1),
    }


def common(files, steps: int = 6) -> list:
    return ["--model", files["model"], "--data", files["data"], "--seq-len", "32",
            "--batch-size", "8", "--devices", "emulated:2", "--lr", "1e-2", "--full",
            "--steps", steps]  # fmt: skip


def model_tensors(output: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(output / "model.safetensors"))


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_two_processes_train_like_one_process_on_the_global_batches(files, tmp_path):
    """Under the real launcher; its stdout merges both ranks': the progress is rank 0's.
    The ranks share --output (a shared filesystem): both save and prune there."""
    args = [*common(files), "--sync", "--grad-clip", "0.5", "--eval-data", files["eval"],
            "--eval-every", "3", "--save-every", "2", "--keep-checkpoints", "1"]  # fmt: skip
    one = single(*args, "--microbatches", "2", "--output", tmp_path / "one")
    two = torchrun(2, *args, "--microbatches", "1", "--output", tmp_path / "two")
    done_one, done_two = finish([one, two], LIMIT_S)
    assert done_one.returncode == 0, done_one.stderr
    assert done_two.returncode == 0, done_two.stderr
    want, got = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [r["step"] for r in got] == list(range(1, 7))
    for key in ("loss", "eval_loss", "lr"):
        values = [r[key] for r in want if key in r]
        assert [r[key] for r in got if key in r] == pytest.approx(values, rel=1e-5), key
    assert [r["step"] for r in got if "eval_loss" in r] == [3, 6]
    assert [r["tokens"] for r in got] == [r["tokens"] for r in want]  # the global batch's
    trained, reference = model_tensors(tmp_path / "two"), model_tensors(tmp_path / "one")
    assert trained.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(trained[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    lines = done_two.stdout.splitlines()
    assert sum(line.startswith("step 1/6") for line in lines) == 1, done_two.stdout
    assert sum(line.startswith("saved the model") for line in lines) == 1
    assert "on 2 processes (emulated:2 each)" in done_two.stdout
    checkpoints = tmp_path / "two" / "checkpoints"
    assert sorted(str(p.relative_to(checkpoints)) for p in checkpoints.glob("*/*")) == [
        "step-6/rank0-of-2", "step-6/rank1-of-2"
    ]  # fmt: skip


def sharded_args(files, output: Path, rank: int) -> list:
    return [*common(files), "--sync", "--save-every", "2", "--keep-checkpoints", "2",
            "--output", output / f"rank{rank}"]  # fmt: skip


@pytest.fixture(scope="module")
def sharded(files) -> dict:
    """6 steps on 2 ranks, each with its own --output, checkpoints at 2, 4 and 6."""
    output = files["root"] / "sharded"
    done = run_ranks(2, lambda rank: sharded_args(files, output, rank), LIMIT_S)
    assert [d.returncode for d in done] == [0, 0], [d.stderr for d in done]
    return {"output": output, "done": done}


def test_only_rank_0_prints_and_writes_and_each_rank_keeps_its_own_shards(sharded):
    output, done = sharded["output"], sharded["done"]
    assert "step 6/6" in done[0].stdout and "saved the model" in done[0].stdout
    assert done[1].stdout == "" and "Traceback" not in done[1].stderr
    rank0, rank1 = tree(output / "rank0"), tree(output / "rank1")
    for name in ("metrics.jsonl", "loss.png", "run.yaml", "model.safetensors",
                 "tokenizer.json", "config.json", "run.lock"):  # fmt: skip
        assert name in rank0
    assert [r["step"] for r in metrics(output / "rank0")] == list(range(1, 7))
    assert "run.rank1.lock" in rank1  # its lock on --output
    assert {Path(p).parts[:3] for p in rank1 if p != "run.rank1.lock"} == {
        ("checkpoints", f"step-{step}", "rank1-of-2") for step in (4, 6)
    }  # the checkpoints of step 2 pruned, nothing else written
    assert {Path(p).parts[:3] for p in rank0 if p.startswith("checkpoints")} == {
        ("checkpoints", f"step-{step}", "rank0-of-2") for step in (4, 6)
    }


def test_resume_on_two_processes_continues_bit_for_bit(sharded, files, tmp_path):
    """Both machines crashed right after step 4's checkpoint."""
    uninterrupted = sharded["output"]
    output = tmp_path / "resumed"
    shutil.copytree(uninterrupted, output)
    for rank in (0, 1):
        shutil.rmtree(output / f"rank{rank}" / "checkpoints" / "step-6")
    (output / "rank0" / "model.safetensors").unlink()
    done = run_ranks(2, lambda rank: [*sharded_args(files, output, rank), "--resume"], LIMIT_S)
    assert [d.returncode for d in done] == [0, 0], [d.stderr for d in done]
    assert "step-4 (step 4)" in done[0].stdout and done[1].stdout == ""
    model = "model.safetensors"
    assert (output / "rank0" / model).read_bytes() == (uninterrupted / "rank0" / model).read_bytes()
    timing = ("tokens_per_s", "elapsed_s")
    strip = [{k: v for k, v in r.items() if k not in timing} for r in metrics(output / "rank0")]
    assert strip == [
        {k: v for k, v in r.items() if k not in timing} for r in metrics(uninterrupted / "rank0")
    ]


def test_resume_with_another_number_of_processes_exits_2(sharded, files, capsys):
    output = sharded["output"] / "rank0"
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *map(str, common(files)), "--output", str(output), "--resume"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "written by 2 processes (torchrun), this run has one process" in err

    from roundpipe.train.checkpoints import resumable_checkpoints
    from roundpipe.train.options import resolve

    options = resolve({"model": files["model"], "data": files["data"], "output": output})
    with pytest.raises(UsageError, match="this run has 3 processes"):
        resumable_checkpoints(output, options, {"rank": 0, "world": 3})


def test_fp16_across_processes_exits_2_on_every_rank(files, tmp_path):
    done = run_ranks(
        2, lambda rank: [*common(files), "--precision", "fp16", "--output", tmp_path], 120
    )
    for rank in done:
        assert rank.returncode == 2, rank.stderr
        assert "--precision fp16 is not supported across 2 processes" in rank.stderr
        assert "Traceback" not in rank.stderr


def test_bad_input_on_one_rank_stops_every_rank_with_exit_2(files, tmp_path):
    def args(rank: int) -> list:
        data = files["data"] if rank == 0 else tmp_path / "missing.jsonl"
        return [*common(files), "--data", data, "--output", tmp_path / f"rank{rank}"]

    done = run_ranks(2, args, 120)
    assert [d.returncode for d in done] == [2, 2], [d.stderr for d in done]
    assert "on rank 1:" in done[0].stderr and "missing.jsonl" in done[0].stderr
    assert "missing.jsonl" in done[1].stderr
    assert not (tmp_path / "rank0" / "metrics.jsonl").exists()


@pytest.mark.parametrize("lost", ["SIGKILL", pytest.param("SIGSTOP", marks=pytest.mark.slow)])
def test_a_lost_rank_makes_the_other_exit_nonzero_within_the_timeout(files, tmp_path, lost):
    """Rank 1 killed (its connections close) or hung (they stay open: the timeout)."""
    timeout_s = 15

    def args(rank: int) -> list:
        return [*common(files, steps=5000), "--dist-timeout", timeout_s,
                "--output", tmp_path / f"rank{rank}"]  # fmt: skip

    processes = start_ranks(2, args)
    wait_for_steps(tmp_path / "rank0", 2, processes)
    processes[1].send_signal(getattr(signal, lost))
    start = time.monotonic()
    try:
        [done] = finish(processes[:1], timeout_s + 60)
        elapsed = time.monotonic() - start
    finally:
        processes[1].kill()
        processes[1].communicate()
    assert done.returncode == 1, done.stderr
    assert elapsed < timeout_s + 15, elapsed
    assert "rank 0 of 2" in done.stderr and "rank(s) [1] did not answer" in done.stderr
    assert "Traceback" not in done.stderr


def test_ctrl_c_on_one_rank_stops_every_rank_after_the_same_step(files, tmp_path):
    """Ctrl-C twice on rank 1 (as ``torchrun`` passes on the terminal's): both ranks
    stop after the same step, write their shard of its checkpoint and exit 130."""
    processes = start_a_long_run(common(files, steps=5000), tmp_path)
    processes[1].send_signal(signal.SIGINT)
    time.sleep(0.05)
    processes[1].send_signal(signal.SIGINT)
    done = finish(processes, LIMIT_S)
    step = assert_stopped_with_their_shards(done, tmp_path, 130)
    assert f"Ctrl-C: stopped after step {step}" in done[0].stdout


def test_ctrl_c_repeated_until_the_ranks_exit_never_kills_one_half_way(files, tmp_path):
    """Ctrl-C keeps arriving at rank 1 (a terminal's key held down, a slow launcher)
    while the ranks stop, write their checkpoint and exit: both still exit 130 after
    writing their shards; none dies of the signal."""
    processes = start_a_long_run(common(files, steps=5000), tmp_path)
    deadline = time.monotonic() + LIMIT_S
    while processes[1].poll() is None and time.monotonic() < deadline:
        processes[1].send_signal(signal.SIGINT)
        time.sleep(0.02)
    assert_stopped_with_their_shards(finish(processes, LIMIT_S), tmp_path, 130)


# -- the pieces, in-process --------------------------------------------------------------


def fake_checkpoint(directory: Path, step: int, save_id: int = 7) -> None:
    directory.mkdir(parents=True)
    extra = {"position": {"step": step, "tokens": 1, "elapsed_s": 1.0}, "options": {}}
    state = {"extra": extra, "shard": {"rank": 0, "world": 2, "save_id": save_id}}
    (directory / "state.json").write_text(json.dumps(state))


def test_each_rank_finds_and_prunes_only_its_own_shards(tmp_path):
    from roundpipe.train.checkpoints import complete_checkpoints, prune_checkpoints, saved_worlds

    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        for rank in (0, 1):
            fake_checkpoint(root / f"step-{step}" / f"rank{rank}-of-2", step)
    fake_checkpoint(root / "step-8" / "rank0-of-2.old", 8)  # a save killed mid-swap
    (root / "step-8" / "rank1-of-2.tmp-1").mkdir()  # rank 1 was killed while writing
    rank0, rank1 = {"rank": 0, "world": 2}, {"rank": 1, "world": 2}
    assert [s for s, _ in complete_checkpoints(tmp_path, rank0)] == [8, 6, 4, 2]
    assert [s for s, _ in complete_checkpoints(tmp_path, rank1)] == [6, 4, 2]
    assert complete_checkpoints(tmp_path) == []  # one process sees no checkpoint of its own
    assert saved_worlds(tmp_path) == {2: {2}, 4: {2}, 6: {2}, 8: {2}}
    prune_checkpoints(tmp_path, 2, rank0)
    assert sorted(p.name for p in (root / "step-4").iterdir()) == ["rank1-of-2"]
    assert sorted(p.name for p in (root / "step-6").iterdir()) == ["rank0-of-2", "rank1-of-2"]
    prune_checkpoints(tmp_path, 2, rank1)
    assert sorted(p.name for p in root.iterdir()) == ["step-4", "step-6", "step-8"]  # 2: empty


def test_the_ranks_resume_from_the_newest_save_they_all_hold(tmp_path):
    from roundpipe.train.checkpoints import Found, Position, common_checkpoints

    mine = [Found(tmp_path / f"step-{s}", Position(s, 0, 0.0), {}, s * 10) for s in (6, 4, 2)]
    every = [[(6, 60), (4, 40), (2, 20)], [(6, 61), (4, 40), (2, 20)]]  # step 6: two saves
    assert [f.position.step for f in common_checkpoints(mine, every)] == [4, 2]
    assert common_checkpoints(mine, [[(6, 60)], [(4, 40)]]) == []


@pytest.mark.parametrize(
    ("rows", "batch_size", "total", "message"),
    [(48, 1, 10, "needs at least 2"), (49, 8, 7, "has 1 of the 49 rows"), (49, 8, 6, None)],
)
def test_every_batch_must_give_each_process_a_row(rows, batch_size, total, message):
    from roundpipe.train.preflight import _check_rows

    steps = -(-rows // batch_size)
    batches = SimpleNamespace(rows=[0] * rows, batch_size=batch_size, steps_per_epoch=steps)
    if message is None:
        _check_rows(batches, total, 2)  # the small last batch is never reached
    else:
        with pytest.raises(UsageError, match=message):
            _check_rows(batches, total, 2)


def test_torchrun_variables_are_read_and_checked():
    from roundpipe.train.ranks import Ranks, from_environment

    assert from_environment({}) == Ranks(0, 1)
    assert from_environment({"WORLD_SIZE": "1", "RANK": "0"}) == Ranks(0, 1)
    full = {"WORLD_SIZE": "3", "RANK": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert from_environment(full) == Ranks(2, 3)
    with pytest.raises(UsageError, match="MASTER_ADDR, MASTER_PORT not set"):
        from_environment({"WORLD_SIZE": "2", "RANK": "0"})
    with pytest.raises(UsageError, match="RANK=3 is outside"):
        from_environment({**full, "RANK": "3"})
    batch = {"input_ids": torch.arange(10).reshape(5, 2)}
    shares = [Ranks(r, 2).share(batch)["input_ids"] for r in (0, 1)]
    assert [s.shape[0] for s in shares] == [3, 2] and torch.equal(
        torch.cat(shares), batch["input_ids"]
    )
