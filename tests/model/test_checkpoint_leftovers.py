"""What a killed save left beside its checkpoint is cleaned up by the next save, and
only that: never a directory of other files, never a live process's."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from support.checkpoints import new_pipe


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_the_next_save_removes_what_killed_saves_left_and_nothing_else(tmp_path):
    host = socket.gethostname()
    killed = tmp_path / f"step-1.tmp-{host}-{dead_pid()}-x1"  # another checkpoint's
    killed.mkdir()
    (killed / "weights.safetensors").write_bytes(b"half a file")
    running = tmp_path / f"step-2.tmp-{host}-{os.getpid()}-x2"  # a save still writing
    running.mkdir()
    other_host = tmp_path / f"step-2.tmp-elsewhere-{dead_pid()}-x3"
    other_host.mkdir()
    yours = tmp_path / f"notes.tmp-{host}-{dead_pid()}-x4"
    yours.mkdir()
    (yours / "draft.txt").write_text("mine")
    (tmp_path / "step-2.lock").write_text("")  # a save killed while it held the lock
    with new_pipe(0) as pipe:
        pipe.save_checkpoint(tmp_path / "step-2", extra=2)
        assert pipe.load_checkpoint(tmp_path / "step-2") == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["step-2", running.name, other_host.name, yours.name]
    )
