"""``roundpipe train`` stopped by SIGTERM (a scheduler's pre-emption) or SIGHUP (the
terminal closed): like a first Ctrl-C, the step finishes, its checkpoint is written and
the process exits with 128 + the signal's number; under ``torchrun`` every rank does,
whether the signal reaches one rank or all of them. (Ctrl-C: ``test_train_resume.py``
and ``test_train_multinode.py``.)

The oracle is the run's own record: the checkpoint is that of the last step in
``metrics.jsonl``, and ``--resume`` continues from it.
"""

from __future__ import annotations

import fcntl
import os
import pty
import select
import signal
import termios
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
    run_train,
    train_process,
)
from support.train_ranks import (  # noqa: E402
    LIMIT_S,
    assert_stopped_with_their_shards,
    finish,
    start_a_long_run,
    torchrun,
    wait_for_steps,
)


def long_run(train_files, output: Path) -> list:
    return ["--model", train_files["model"], "--data", train_files["text"], "--output", output,
            *COMMON, "--save-every", "1000", "--steps", "5000"]  # fmt: skip


def wait_for_3_steps(output: Path, process) -> None:
    deadline = time.monotonic() + RUN_LIMIT_S
    while not ((output / "metrics.jsonl").exists() and len(metrics(output)) >= 3):
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)


def assert_stopped_with_a_checkpoint(output: Path) -> int:
    """The checkpoint is that of the last step logged, and the only one; -> that step."""
    done = metrics(output)[-1]["step"]
    assert checkpoint_steps(output) == [done] and done >= 3
    assert [r["step"] for r in metrics(output)] == list(range(1, done + 1))
    return done


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_stop_signal_writes_a_checkpoint_and_exits_128_plus_its_number(
    train_files, tmp_path, stop
):
    process = train_process(*long_run(train_files, tmp_path))
    wait_for_3_steps(tmp_path, process)
    process.send_signal(stop)
    out, err = process.communicate(timeout=RUN_LIMIT_S)
    assert process.returncode == 128 + stop, err
    done = assert_stopped_with_a_checkpoint(tmp_path)
    assert f"{stop.name}: stopped after step {done}" in out
    assert "Traceback" not in err
    resumed = run_train(*long_run(train_files, tmp_path)[:-1], done + 1, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert f"step-{done} (step {done})" in resumed.stdout


def test_under_nohup_sighup_is_ignored_and_the_run_goes_on(train_files, tmp_path):
    nohup = lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)  # noqa: E731
    process = train_process(*long_run(train_files, tmp_path), preexec_fn=nohup)
    wait_for_3_steps(tmp_path, process)
    process.send_signal(signal.SIGHUP)
    logged = len(metrics(tmp_path))
    deadline = time.monotonic() + RUN_LIMIT_S
    while len(metrics(tmp_path)) < logged + 3:  # still training
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=RUN_LIMIT_S)
    assert process.returncode == 128 + signal.SIGTERM, err
    assert_stopped_with_a_checkpoint(tmp_path)


def test_a_closed_terminal_still_leaves_a_checkpoint(train_files, tmp_path):
    """The run's terminal goes away (its pseudo-terminal closed): the kernel sends SIGHUP
    and from then on every write to the terminal fails; the run still checkpoints the
    step it was in and exits 129."""
    master, slave = pty.openpty()

    def controlled_by_the_terminal():  # the new session's controlling terminal is stdin
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    process = train_process(
        *long_run(train_files, tmp_path),
        stdin=slave, stdout=slave, stderr=slave,
        start_new_session=True, preexec_fn=controlled_by_the_terminal,
    )  # fmt: skip
    os.close(slave)
    shown = b""
    deadline = time.monotonic() + RUN_LIMIT_S
    while not ((tmp_path / "metrics.jsonl").exists() and len(metrics(tmp_path)) >= 3):
        assert process.poll() is None and time.monotonic() < deadline, shown
        if select.select([master], [], [], 0.05)[0]:  # keep the terminal's buffer drained
            shown += os.read(master, 65536)
    os.close(master)  # the hang-up
    assert process.wait(timeout=RUN_LIMIT_S) == 128 + signal.SIGHUP, shown
    assert_stopped_with_a_checkpoint(tmp_path)


def test_sigterm_on_one_rank_stops_every_rank_after_the_same_step(train_files, tmp_path):
    args = ["--model", train_files["model"], "--data", train_files["text"], *COMMON,
            "--full", "--steps", "5000"]  # fmt: skip
    processes = start_a_long_run(args, tmp_path)
    processes[1].send_signal(signal.SIGTERM)
    done = finish(processes, LIMIT_S)
    step = assert_stopped_with_their_shards(done, tmp_path, 128 + signal.SIGTERM)
    assert f"SIGTERM: stopped after step {step}" in done[0].stdout


def test_sigterm_to_torchrun_stops_every_rank_with_its_shard(train_files, tmp_path):
    """A scheduler signals the launcher, which passes SIGTERM on to every rank (and
    kills them ``--shutdown-timeout`` seconds later, 30 by default)."""
    launcher = torchrun(2, *long_run(train_files, tmp_path))
    wait_for_steps(tmp_path, 3, [launcher])
    launcher.send_signal(signal.SIGTERM)
    [done] = finish([launcher], LIMIT_S)
    assert done.returncode != 0
    step = metrics(tmp_path)[-1]["step"]
    shards = sorted(p.relative_to(tmp_path) for p in tmp_path.glob("checkpoints/*/rank*"))
    assert shards == [Path(f"checkpoints/step-{step}/rank{r}-of-2") for r in (0, 1)], done
    assert f"SIGTERM: stopped after step {step}" in done.stdout
