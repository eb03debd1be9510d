"""Where ``scripts/_venv.sh`` (the set-up of ``demo.sh`` and ``test.sh``) takes torch from.

Each test runs the real script in bash on a copy of it whose ``.venv/bin/python`` is a fake:
``python -m pip ...`` only records its arguments, and anything else runs the real Python
without site-packages, seeing one fake ``torch`` distribution where a test installs it. A
fake ``nvidia-smi`` on PATH says whether there is a GPU; the CPU index is a local server
that answers, a closed port, or a socket that never answers. Nothing is installed.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

VENV_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "_venv.sh"
INSTALL_OPTIONS = ["install", "--quiet", "--disable-pip-version-check"]
PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")


@dataclass
class SetUp:
    """What one run of the script did: its pip commands (each a list of arguments after
    ``pip``) and the lines it wrote about torch."""

    pip_commands: list[list[str]]
    torch_lines: list[str]
    seconds: float


class Checkout:
    """A directory with ``scripts/_venv.sh`` and a fake ``.venv``, run as a user would."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "scripts").mkdir(parents=True)
        shutil.copy(VENV_SCRIPT, root / "scripts" / "_venv.sh")
        self.pip_log = root / "pip.log"
        self.site = root / "fake-site"
        self.site.mkdir()
        self.bin = root / "fake-bin"
        self.bin.mkdir()
        _write_executable(
            root / ".venv" / "bin" / "python",
            f'if [ "$1 $2" = "-m pip" ]; then shift 2; echo "$*" >> "{self.pip_log}"; exit 0; fi\n'
            f'PYTHONPATH="{self.site}" exec "{sys.executable}" -S "$@"\n',
        )

    def install_torch(self, version: str) -> None:
        """Make ``importlib.metadata`` in the fake ``.venv`` see torch ``version``."""
        dist_info = self.site / f"torch-{version}.dist-info"
        dist_info.mkdir()
        (dist_info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n"
        )

    def set_up(self, *, gpu: bool, cpu_index: str, index_timeout: float = 5.0) -> SetUp:
        """Source the script for the ``dev`` extras, as ``scripts/test.sh`` does."""
        _write_executable(self.bin / "nvidia-smi", "exit 0\n" if gpu else "exit 9\n")
        env = {k: v for k, v in os.environ.items() if k.lower() not in PROXY_VARIABLES}
        env["PATH"] = f"{self.bin}{os.pathsep}{env['PATH']}"
        env["ROUNDPIPE_TORCH_CPU_INDEX"] = cpu_index
        env["ROUNDPIPE_TORCH_INDEX_TIMEOUT"] = str(index_timeout)
        start = time.monotonic()
        result = subprocess.run(
            ["bash", "-c", "source scripts/_venv.sh dev"],
            cwd=self.root,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        seconds = time.monotonic() - start
        assert result.returncode == 0, result.stderr
        log = self.pip_log.read_text().splitlines() if self.pip_log.exists() else []
        return SetUp(
            pip_commands=[line.split() for line in log],
            torch_lines=[line for line in result.stderr.splitlines() if "torch" in line],
            seconds=seconds,
        )


def _write_executable(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)


@pytest.fixture
def checkout(tmp_path: Path) -> Checkout:
    return Checkout(tmp_path / "checkout")


@pytest.fixture
def answering_index(tmp_path: Path) -> Iterator[str]:
    """A local package index with a ``torch/`` page."""
    (tmp_path / "index" / "torch").mkdir(parents=True)
    (tmp_path / "index" / "torch" / "index.html").write_text("<html></html>")

    class QuietHandler(SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(
        ("127.0.0.1", 0), partial(QuietHandler, directory=str(tmp_path / "index"))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def closed_index() -> str:
    """An index URL on a port nobody listens on: the connection is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/whl/cpu"


@pytest.fixture
def silent_index() -> Iterator[str]:
    """An index URL whose server takes the connection and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(4)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/whl/cpu"


def _editable_install() -> list[str]:
    return [*INSTALL_OPTIONS, "-e", ".[dev]"]


def test_without_a_gpu_torch_is_the_cpu_build_from_the_cpu_index(checkout, answering_index):
    run = checkout.set_up(gpu=False, cpu_index=answering_index)

    assert run.pip_commands == [
        [*INSTALL_OPTIONS, "--index-url", answering_index, "torch==2.13.0"],
        _editable_install(),
    ]
    assert len(run.torch_lines) == 1
    assert "no NVIDIA GPU" in run.torch_lines[0] and answering_index in run.torch_lines[0]


def test_without_a_gpu_an_unreachable_cpu_index_falls_back_to_the_default_index(
    checkout, closed_index
):
    run = checkout.set_up(gpu=False, cpu_index=closed_index)

    assert run.pip_commands == [[*INSTALL_OPTIONS, "torch==2.13.0"], _editable_install()]
    assert len(run.torch_lines) == 1
    assert "cannot be reached" in run.torch_lines[0]
    assert "refused" in run.torch_lines[0].lower()
    assert "default index" in run.torch_lines[0]


def test_a_cpu_index_that_never_answers_is_given_up_on_after_the_timeout(checkout, silent_index):
    run = checkout.set_up(gpu=False, cpu_index=silent_index, index_timeout=0.5)

    assert run.pip_commands == [[*INSTALL_OPTIONS, "torch==2.13.0"], _editable_install()]
    assert "no answer in 0.5 s" in run.torch_lines[0]
    assert run.seconds < 10


def test_with_a_gpu_torch_is_any_recent_version_from_the_default_index(checkout, answering_index):
    run = checkout.set_up(gpu=True, cpu_index=answering_index)

    assert run.pip_commands == [[*INSTALL_OPTIONS, "torch>=2.11"], _editable_install()]
    assert len(run.torch_lines) == 1 and "NVIDIA GPU" in run.torch_lines[0]


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
@pytest.mark.parametrize("version", ["2.13.0+cpu", "2.13.0"])
def test_torch_2_13_already_in_the_venv_is_not_installed_again(
    checkout, closed_index, gpu, version
):
    checkout.install_torch(version)

    run = checkout.set_up(gpu=gpu, cpu_index=closed_index)

    assert run.pip_commands == [_editable_install()]
    assert len(run.torch_lines) == 1 and f"{version} is already in .venv" in run.torch_lines[0]


def test_another_torch_in_the_venv_is_replaced_by_2_13(checkout, closed_index):
    checkout.install_torch("2.12.1")

    run = checkout.set_up(gpu=False, cpu_index=closed_index)

    assert run.pip_commands == [[*INSTALL_OPTIONS, "torch==2.13.0"], _editable_install()]
