"""Saving replaces only RoundPipe checkpoints: never a directory or file of yours."""

from __future__ import annotations

import json

import pytest
from support.checkpoints import new_pipe


def test_saving_over_a_directory_that_is_not_a_checkpoint_is_refused_and_keeps_its_files(
    tmp_path,
):
    mine = tmp_path / "results"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with new_pipe(0) as pipe, pytest.raises(FileExistsError, match="notes.txt"):
        pipe.save_checkpoint(mine)
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]  # nothing left over


def test_a_checkpoint_you_added_a_file_to_is_not_replaced(tmp_path):
    path = tmp_path / "ckpt"
    with new_pipe(0) as pipe:
        pipe.save_checkpoint(path, extra=1)
        (path / "README.md").write_text("my notes")
        with pytest.raises(FileExistsError, match="README.md"):
            pipe.save_checkpoint(path, extra=2)
    assert (path / "README.md").read_text() == "my notes"
    assert json.loads((path / "state.json").read_text())["extra"] == 1


def test_saving_over_a_file_is_refused_and_keeps_it(tmp_path):
    mine = tmp_path / "model.pt"
    mine.write_bytes(b"weights")
    with new_pipe(0) as pipe, pytest.raises(FileExistsError, match="not a directory"):
        pipe.save_checkpoint(mine)
    assert mine.read_bytes() == b"weights"


def test_a_directory_of_yours_where_the_previous_copy_would_go_is_refused(tmp_path):
    (tmp_path / "ckpt.old").mkdir()
    (tmp_path / "ckpt.old" / "data.csv").write_text("1,2")
    with new_pipe(0) as pipe, pytest.raises(FileExistsError, match="ckpt.old"):
        pipe.save_checkpoint(tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.old"]
    assert (tmp_path / "ckpt.old" / "data.csv").read_text() == "1,2"


def test_saving_into_an_empty_directory_fills_it(tmp_path):
    path = tmp_path / "ckpt"
    path.mkdir()
    with new_pipe(0) as pipe:
        pipe.save_checkpoint(path, extra="here")
        assert pipe.load_checkpoint(path) == "here"
