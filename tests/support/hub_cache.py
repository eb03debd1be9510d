"""A Hugging Face hub cache built in code, laid out as ``huggingface_hub`` lays out what
it downloads (no network): ``models--<org>--<name>/blobs/<hash>`` (the sha256 of a
large-file-storage file such as a safetensors one, the git blob sha1 of others),
``snapshots/<commit>/<path>`` relative symbolic links to those blobs, and
``refs/<branch>`` holding the commit."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

LFS_SUFFIXES = (".safetensors", ".bin", ".model")


def repo_folder(cache: Path, repo_id: str) -> Path:
    return Path(cache) / ("models--" + repo_id.replace("/", "--"))


def blob_hash(path: Path, data: bytes) -> str:
    if path.name.endswith(LFS_SUFFIXES):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def add_snapshot(
    cache: Path, repo_id: str, files_from: Path, commit: str, branch: str | None = "main",
    skip: tuple[str, ...] = (),
) -> Path:  # fmt: skip
    """Put the files of directory ``files_from`` (but ``skip``) into ``cache`` as the
    snapshot ``commit`` of ``repo_id`` (``branch`` pointing at it); -> the snapshot."""
    folder = repo_folder(cache, repo_id)
    snapshot = folder / "snapshots" / commit
    for source in sorted(Path(files_from).rglob("*")):
        relative = source.relative_to(files_from)
        if not source.is_file() or str(relative) in skip:
            continue
        data = source.read_bytes()
        blob = folder / "blobs" / blob_hash(source, data)
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / relative
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if branch is not None:
        ref = folder / "refs" / branch
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(commit)  # no newline, as huggingface_hub writes it
    return snapshot


def commit_id(seed: int) -> str:
    """A 40-hex-digit commit hash."""
    return hashlib.sha1(f"commit {seed}".encode()).hexdigest()
