"""A save that runs out of disk raises ``OSError`` (ENOSPC) and keeps the previous
checkpoint; nothing of the failed save is left behind."""

from __future__ import annotations

import errno

import pytest
import safetensors.torch
from safetensors import SafetensorError
from support.checkpoints import new_pipe

# What safetensors 0.8 raises when a write fails with ENOSPC (seen on a full 64 KiB tmpfs).
ENOSPC = "Error while serializing: I/O error: No space left on device (os error 28)"


def fill_the_disk_after(monkeypatch, files: int) -> None:
    """Let ``files`` tensor files be written, then fail as a full disk does: half a file
    on disk and safetensors' own error."""
    written = []
    real = safetensors.torch.save_file

    def save_file(tensors, filename, metadata=None):
        if len(written) >= files:
            real(tensors, filename, metadata=metadata)
            with open(filename, "r+b") as file:
                file.truncate(file.seek(0, 2) // 2)
            raise SafetensorError(ENOSPC)
        written.append(filename)
        real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)


@pytest.mark.parametrize("files", [0, 2])
def test_a_full_disk_raises_oserror_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, files):
    path = tmp_path / "ckpt"
    with new_pipe(0) as pipe:
        pipe.save_checkpoint(path, extra="before")
        fill_the_disk_after(monkeypatch, files)
        with pytest.raises(OSError) as caught:
            pipe.save_checkpoint(path, extra="after")
        assert caught.value.errno == errno.ENOSPC
        assert isinstance(caught.value.__cause__, SafetensorError)
        assert ".safetensors" in str(caught.value)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
        assert pipe.load_checkpoint(path) == "before"
