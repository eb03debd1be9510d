"""``roundpipe train --model ORG/NAME``: a hub id resolved with ``huggingface_hub``.

No network: the hub cache is built in code as the hub client lays it out
(``support/hub_cache.py``), checked against ``huggingface_hub``'s own reading of it,
and runs go offline (``HF_HUB_OFFLINE=1``). The oracle for a run is the same run on the
local directory the snapshot was made from; for the files fetched, the hub client's
own pattern filter over a repository's listing.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
huggingface_hub = pytest.importorskip("huggingface_hub")

from support.hub_cache import add_snapshot, commit_id, repo_folder  # noqa: E402
from support.train_cli import COMMON, run_train  # noqa: E402

from roundpipe.cli import main  # noqa: E402
from roundpipe.train import hub  # noqa: E402
from roundpipe.train.options import UsageError  # noqa: E402

REPO_ID = "tiny-org/tiny-qwen3"


@pytest.fixture(scope="module")
def cache(train_files, tmp_path_factory) -> Path:
    """A hub cache holding ``REPO_ID`` at two commits: the first on ``main`` and
    ``release``, the second (the same files) on ``next``."""
    root = tmp_path_factory.mktemp("hub-cache")
    add_snapshot(root, REPO_ID, train_files["model"], commit_id(1), branch="main")
    (repo_folder(root, REPO_ID) / "refs" / "release").write_text(commit_id(1))
    add_snapshot(root, REPO_ID, train_files["model"], commit_id(2), branch="next")
    return root


@pytest.fixture
def offline(cache, monkeypatch) -> Path:
    """``huggingface_hub`` in this process reading ``cache``, offline."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def offline_env(cache: Path) -> dict[str, str]:
    return {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_HOME": str(cache.parent)}


def test_the_cache_is_laid_out_as_huggingface_hub_reads_it(cache):
    info = huggingface_hub.scan_cache_dir(cache)
    assert not info.warnings
    (repo,) = info.repos
    assert repo.repo_id == REPO_ID and repo.repo_type == "model"
    assert {r.commit_hash: set(r.refs) for r in repo.revisions} == {
        commit_id(1): {"main", "release"},
        commit_id(2): {"next"},
    }
    found = huggingface_hub.try_to_load_from_cache(REPO_ID, "model.safetensors", cache_dir=cache)
    assert Path(found).resolve().parent.name == "blobs"


@pytest.mark.parametrize(
    ("revision", "commit"),
    [(None, 1), ("release", 1), ("next", 2), (commit_id(2), 2)],
)
def test_a_hub_id_resolves_offline_to_its_snapshot_in_the_cache(offline, revision, commit):
    source = hub.resolve_model(REPO_ID, revision)
    assert source.directory == repo_folder(offline, REPO_ID) / "snapshots" / commit_id(commit)
    assert (source.hub_id, source.commit, source.name) == (REPO_ID, commit_id(commit), REPO_ID)


def test_a_local_directory_wins_and_takes_no_revision(train_files, monkeypatch):
    model = train_files["model"]
    monkeypatch.chdir(model.parent)
    assert hub.resolve_model(model.name).directory == model  # relative, existing: local
    assert not hub.is_local(REPO_ID) and hub.is_local("/no/such/dir") and hub.is_local("./x")
    with pytest.raises(UsageError, match="--revision main applies to a hub id"):
        hub.resolve_model(str(model), "main")


def test_only_the_config_tokenizer_and_safetensors_weights_are_fetched(tmp_path, monkeypatch):
    """Each call's patterns, applied by the hub client's own filter to a repository that
    also holds .bin weights, another safetensors export and extra files."""
    from huggingface_hub.utils import filter_repo_objects

    listing = [
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "chat_template.jinja", "model.safetensors.index.json",
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "consolidated.safetensors", "pytorch_model.bin", "original/params.json", "README.md",
    ]  # fmt: skip
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors",
                            "b": "model-00002-of-00002.safetensors"}}  # fmt: skip
    snapshot = tmp_path / "snapshot"
    fetched: list[set[str]] = []

    def fake_download(repo_id, revision=None, allow_patterns=None):
        files = set(filter_repo_objects(listing, allow_patterns=allow_patterns))
        fetched.append(files)
        snapshot.mkdir(exist_ok=True)
        for name in files:
            text = json.dumps(index) if name.endswith("index.json") else ""
            (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
            (snapshot / name).write_text(text)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    hub.resolve_model(REPO_ID)
    metadata = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "chat_template.jinja", "model.safetensors.index.json"}  # fmt: skip
    shards = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    assert fetched == [metadata, metadata | shards]


def usage_error(capsys, *args) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *map(str, args)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_a_hub_id_missing_offline_is_refused_naming_it(offline, train_files, tmp_path, capsys):
    err = usage_error(capsys, "--model", "tiny-org/absent", "--data", train_files["text"],
                      "--output", tmp_path / "out", *COMMON)  # fmt: skip
    assert "--model tiny-org/absent" in err and "not in the Hugging Face cache" in err
    assert "HF_HUB_OFFLINE" in err and not (tmp_path / "out").exists()


def test_an_unknown_revision_offline_is_refused(offline, train_files, tmp_path, capsys):
    err = usage_error(capsys, "--model", REPO_ID, "--revision", "nope", "--data",
                      train_files["text"], "--output", tmp_path / "out", *COMMON)  # fmt: skip
    assert f"--model {REPO_ID} --revision nope" in err and "not in the Hugging Face cache" in err


def test_a_repository_without_safetensors_weights_is_refused(
    offline, train_files, tmp_path, capsys
):
    bin_only = tmp_path / "bin-only"
    shutil.copytree(train_files["model"], bin_only)
    (bin_only / "model.safetensors").rename(bin_only / "pytorch_model.bin")
    add_snapshot(offline, "tiny-org/bin-only", bin_only, commit_id(3))
    err = usage_error(capsys, "--model", "tiny-org/bin-only", "--data", train_files["text"],
                      "--output", tmp_path / "out", *COMMON)  # fmt: skip
    assert "--model tiny-org/bin-only" in err and "no safetensors weights" in err


def test_a_run_from_the_hub_equals_the_run_from_the_directory(
    cache, train_files, tmp_path, monkeypatch
):
    """Offline, by a real process: the same adapter bit for bit, ``run.yaml`` keeping the
    hub id; resumed after ``main`` moved to another snapshot, the run goes on; its
    checkpoint exports (the base found in the cache) as the adapter it saved."""
    args = ("--data", train_files["prompt_completion"], *COMMON, "--sync", "--steps", "2")
    local = run_train("--model", train_files["model"], "--output", tmp_path / "local", *args)
    assert local.returncode == 0, local.stderr
    env = offline_env(cache)
    hubbed = tmp_path / "hub"
    done = run_train("--model", REPO_ID, "--output", hubbed, *args, env=env)
    assert done.returncode == 0, done.stderr
    assert f"a LoRA adapter of {REPO_ID}" in done.stdout
    adapter = "adapter_model.safetensors"
    assert (hubbed / adapter).read_bytes() == (tmp_path / "local" / adapter).read_bytes()
    assert "model: tiny-org/tiny-qwen3\n" in (hubbed / "run.yaml").read_text()
    moved = tmp_path / "moved-cache"
    shutil.copytree(cache, moved, symlinks=True)
    (repo_folder(moved, REPO_ID) / "refs" / "main").write_text(commit_id(2))
    resumed = run_train("--config", hubbed / "run.yaml", "--output", hubbed, "--resume",
                        "--steps", "3", env=offline_env(moved))  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stdout
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(moved))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    step_3 = hubbed / "checkpoints" / "step-3"
    assert main(["export", "--checkpoint", str(step_3), "--output", str(tmp_path / "a")]) == 0
    assert (tmp_path / "a" / adapter).read_bytes() == (hubbed / adapter).read_bytes()
