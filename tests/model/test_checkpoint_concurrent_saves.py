"""Processes saving to one path at once all succeed; the last swap wins, whole."""

from __future__ import annotations

import errno
import fcntl
import os

import pytest
import torch
from support.checkpoints import new_pipe
from support.children.harness import CHILDREN, start_child
from torch import nn

from roundpipe import RoundPipe

SAVES = 150  # each; before saves took turns, about one run in two failed at 100


def test_two_processes_saving_to_one_path_in_a_loop_never_fail(tmp_path):
    path = tmp_path / "ckpt"
    script = os.path.join(CHILDREN, "save_in_a_loop.py")
    children = [start_child([script, str(path), str(SAVES), tag]) for tag in "ab"]
    for child in children:
        out, err = child.communicate(timeout=240)
        assert child.returncode == 0 and out.strip() == "DONE", err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary left
    with RoundPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), devices="emulated:1") as pipe:
        optimizer = torch.optim.SGD(pipe.optim_parameters(), lr=0.1)
        extra = pipe.load_checkpoint(path, optimizer)
    assert extra["save"] == SAVES - 1 and extra["by"] in "ab"


def test_saving_where_the_filesystem_has_no_locks_warns_and_saves(tmp_path, monkeypatch):
    def flock(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", flock)
    with new_pipe(0) as pipe:
        with pytest.warns(RuntimeWarning, match="lock"):
            pipe.save_checkpoint(tmp_path / "ckpt", extra=1)
        assert pipe.load_checkpoint(tmp_path / "ckpt") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
