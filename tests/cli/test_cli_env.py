"""``roundpipe --version`` and ``roundpipe env``, the two things a bug report starts with."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from roundpipe.cli import main

REPORT_KEYS = {
    "roundpipe", "python", "platform", "torch", "cuda", "transformers", "peft", "safetensors",
    "accelerate", "bitsandbytes", "torchao", "gpus", "host_ram_gib",
}  # fmt: skip


def _roundpipe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "roundpipe", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _rows(text: str) -> dict[str, str]:
    """The aligned text as label -> value (labels may hold one space, as "host RAM")."""
    return dict(re.match(r"(\S+(?: \S+)?)\s{2,}(.*)", line).groups() for line in text.splitlines())


def _installed_gib() -> float:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30


@pytest.fixture(scope="module")
def env_text() -> str:
    result = _roundpipe("env")
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_version_prints_the_installed_distributions_version():
    result = _roundpipe("--version")

    assert result.returncode == 0, result.stderr
    assert result.stdout == f"roundpipe {importlib.metadata.version('roundpipe-ft')}\n"


def test_env_names_python_torch_and_its_cuda(env_text):
    rows = _rows(env_text)

    assert rows["torch"] == torch.__version__
    assert rows["cuda"] == (torch.version.cuda or "none")
    assert rows["python"].startswith(".".join(map(str, sys.version_info[:3])))
    assert rows["transformers"] == importlib.metadata.version("transformers")


def test_env_names_the_gpus_and_the_host_ram(env_text):
    rows = _rows(env_text)

    count = torch.cuda.device_count()
    assert rows["gpus"] == (str(count) if count else "no CUDA GPU")
    assert [label for label in rows if label.startswith("gpu ")] == [
        f"gpu {index}" for index in range(count)
    ]
    pattern = r"([\d.]+) GiB installed, ([\d.]+) GiB usable \(bounded by "
    installed = re.match(pattern, rows["host RAM"])
    assert installed is not None, rows["host RAM"]
    assert float(installed[1]) == pytest.approx(_installed_gib(), abs=0.06)
    assert 0 < float(installed[2]) <= float(installed[1])


def test_env_json_is_one_object_with_every_key():
    result = _roundpipe("env", "--json")

    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report) == REPORT_KEYS
    assert report["torch"] == torch.__version__
    assert report["cuda"] == torch.version.cuda
    assert len(report["gpus"]) == torch.cuda.device_count()
    assert report["host_ram_gib"]["installed"] == pytest.approx(_installed_gib(), abs=0.01)
    assert 0 < report["host_ram_gib"]["usable"] <= report["host_ram_gib"]["installed"]


@pytest.mark.parametrize("missing", ["peft", "torchao"])
def test_env_says_not_installed_for_a_package_that_cannot_be_imported(missing, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, missing, None)  # `import missing` now fails

    assert main(["env"]) == 0
    assert _rows(capsys.readouterr().out)[missing] == "not installed"
    assert main(["env", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[missing] is None
