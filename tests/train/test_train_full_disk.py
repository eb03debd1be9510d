"""``roundpipe train`` on a disk that fills up: one line naming what could not be
written, how much it needed and how much was free, exit code 1, no traceback.

The disk is a real one: a 128 KiB tmpfs as ``--output``, mounted in a mount namespace
of the run's own (``unshare``; skipped where the system allows none). A checkpoint of
the tiny model takes about 300 KB, so the first one does not fit.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("yaml")

from support.train_cli import COMMON, run_train  # noqa: E402

MOUNT_THEN_RUN = 'mount -t tmpfs -o size=128k tmpfs "$0" && exec "$@"'


def namespaces_allowed() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = ["unshare", "-rm", "sh", "-c", 'mount -t tmpfs tmpfs "$0"', "/tmp"]
    return subprocess.run(probe, capture_output=True).returncode == 0


@pytest.mark.skipif(not namespaces_allowed(), reason="no mount namespace for a small tmpfs")
def test_a_full_disk_is_one_line_naming_the_path_and_the_space_needed(train_files, tmp_path):
    output = tmp_path / "small"
    output.mkdir()
    done = run_train(
        "--model", train_files["model"], "--data", train_files["text"], "--output", output,
        *COMMON, "--steps", "4", "--save-every", "2",
        wrap=["unshare", "-rm", "sh", "-c", MOUNT_THEN_RUN, output],
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith(f"roundpipe train: error: no space left for {output}/checkpoints/step-2")
    assert "it needs about " in line and " are free there" in line, line
