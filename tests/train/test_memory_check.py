"""Host memory in ``roundpipe train``: a run that cannot fit the RAM this process may
still allocate exits with code 2 before loading the model, naming what it needs, what
the machine has and what fits (``--no-memory-check`` goes past); a run that fits starts
as before; a run that runs out of host memory anyway ends in one line naming the newest
checkpoint, exit code 1. The room is read from ``/proc`` and the cgroup files (checked
here on fake ones) and ``RLIMIT_AS``, which the real processes below run under.
``roundpipe simulate --host-ram`` is in GiB, as the check's figures are.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("yaml")

from support.big_models import big_model_dir  # noqa: E402
from support.train_cli import COMMON, run_train  # noqa: E402

import roundpipe.train.loop  # noqa: E402
import roundpipe.train.memory_check  # noqa: E402
from roundpipe.cli import main  # noqa: E402
from roundpipe.predict.gpus import GIB  # noqa: E402
from roundpipe.predict.host_memory import (  # noqa: E402
    ADDRESS_SPACE,
    AVAILABLE,
    CGROUP,
    Room,
    usable_ram,
)


def _imported_address_space_kib() -> int:
    """The address space of a Python process that imported torch and transformers, as
    ``roundpipe train`` has before its check: a CUDA build of torch maps GiBs more than
    a CPU build, so the limit below is counted from it."""
    probe = (
        "import torch, transformers\n"
        "print([l for l in open('/proc/self/status') if l.startswith('VmSize')][0].split()[1])"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    return int(done.stdout.strip())


ADDRESS_LIMIT_KIB = _imported_address_space_kib() + 4 * 1024 * 1024
"""4 GiB of address space beyond what the imports take: room for the tiny model's run
and the big model in NF4, not for the big model itself."""
UNDER_THE_LIMIT = ["sh", "-c", f'ulimit -v {ADDRESS_LIMIT_KIB} && exec "$@"', "sh"]
NO_LIMIT = resource.RLIM_INFINITY


@pytest.fixture(scope="module")
def big_model(tmp_path_factory) -> Path:
    return big_model_dir(tmp_path_factory.mktemp("big") / "model")


def test_a_run_that_cannot_fit_exits_2_before_loading_naming_needs_has_and_what_fits(
    big_model, train_files, tmp_path
):
    output = tmp_path / "out"
    done = run_train("--model", big_model, "--data", train_files["text"], "--output", output,
                     *COMMON, "--steps", "1", wrap=UNDER_THE_LIMIT)  # fmt: skip
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith("roundpipe train: error: host memory: this run needs "), line
    assert "GiB of host RAM (weights " in line and "GiB usable here" in line, line
    assert f"may still allocate: {ADDRESS_SPACE})" in line, line
    assert "fits with --quantize nf4 (" in line and "--no-memory-check" in line, line
    assert not output.exists()  # refused before anything was written


def test_no_memory_check_goes_past_the_check(train_files, tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(roundpipe.train.memory_check, "usable_ram", lambda: Room(GIB // 2, CGROUP))
    run = ["train", "--model", str(train_files["model"]), "--data", str(train_files["text"]),
           *COMMON, "--steps", "1"]  # fmt: skip
    with pytest.raises(SystemExit) as refused:
        main([*run, "--output", str(tmp_path / "checked")])
    assert refused.value.code == 2
    assert "error: host memory: this run needs " in capfd.readouterr().err
    assert main([*run, "--output", str(tmp_path / "unchecked"), "--no-memory-check"]) == 0


def test_a_run_that_fits_starts_as_before_under_the_limit(train_files, tmp_path):
    output = tmp_path / "out"
    done = run_train("--model", train_files["model"], "--data", train_files["text"],
                     "--output", output, *COMMON, "--steps", "1", wrap=UNDER_THE_LIMIT)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (output / "adapter_model.safetensors").is_file()


def allocation_failure_at(step: int, error: BaseException):
    """A ``Run._step`` that fails with ``error`` at ``step``, as an allocation would."""
    real_step = roundpipe.train.loop.Run._step

    def step_or_fail(run, before):
        if before.step + 1 == step:
            raise error
        return real_step(run, before)

    return step_or_fail


@pytest.mark.parametrize(
    "step, error, then",
    [
        (1, MemoryError(), "no checkpoint was written"),
        (
            2,
            RuntimeError(
                "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
                "allocate memory: you tried to allocate 8589934592 bytes. Error code 12"
            ),
            "the newest checkpoint is {output}/checkpoints/step-1 (step 1)",
        ),
    ],
)
def test_running_out_of_host_memory_is_one_line_naming_the_newest_checkpoint(
    step, error, then, train_files, tmp_path, monkeypatch, capfd
):
    output = tmp_path / "out"
    monkeypatch.setattr(roundpipe.train.loop.Run, "_step", allocation_failure_at(step, error))
    code = main(["train", "--model", str(train_files["model"]), "--data",
                 str(train_files["text"]), "--output", str(output), *COMMON, "--steps", "3",
                 "--save-every", "1"])  # fmt: skip
    assert code == 1
    [line] = capfd.readouterr().err.strip().splitlines()
    size = " (allocating 8.0 GiB)" if isinstance(error, RuntimeError) else ""
    assert line.startswith(f"roundpipe train: error: out of host memory{size}: "), line
    assert then.format(output=output) in line, line


def fake_machine(root: Path, meminfo_kib: int, vm_size_kib: int, cgroup: str, files: dict):
    """``root/proc`` and ``root/cgroup`` as the process would see them: ``cgroup`` is its
    ``/proc/self/cgroup``, ``files`` the cgroup files (path under ``root/cgroup``: text)."""
    proc = root / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(
        f"MemTotal:       99999999 kB\nMemAvailable:   {meminfo_kib} kB\n"
    )
    (proc / "self" / "status").write_text(f"Name:\tpython\nVmSize:\t  {vm_size_kib} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup)
    for name, text in files.items():
        path = root / "cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return proc, root / "cgroup"


def test_the_room_is_the_available_memory_without_limits(tmp_path):
    proc, cgroups = fake_machine(tmp_path, 4 * 1024**2, 10**6, "0::/\n", {})
    assert usable_ram(proc, cgroups, NO_LIMIT) == Room(4 * GIB, AVAILABLE)


def test_the_room_under_a_cgroup_v2_limit_is_the_tightest_group_less_its_usage(tmp_path):
    files = {
        "user.slice/memory.max": f"{6 * GIB}\n",
        "user.slice/memory.current": f"{5 * GIB}\n",  # 1 GiB room: the tightest
        "user.slice/job/memory.max": "max\n",
        "user.slice/job/memory.current": f"{2 * GIB}\n",
        "user.slice/memory.stat": f"anon 1\ninactive_file {GIB // 2}\n",  # page cache
    }
    proc, cgroups = fake_machine(tmp_path, 64 * 1024**2, 10**6, "0::/user.slice/job\n", files)
    assert usable_ram(proc, cgroups, NO_LIMIT) == Room(GIB + GIB // 2, CGROUP)


def test_the_room_under_a_cgroup_v1_limit(tmp_path):
    files = {
        "memory/docker/abc/memory.limit_in_bytes": f"{3 * GIB}\n",
        "memory/docker/abc/memory.usage_in_bytes": f"{GIB}\n",
        "memory/memory.limit_in_bytes": "9223372036854771712\n",  # v1's "no limit"
        "memory/memory.usage_in_bytes": f"{50 * GIB}\n",
    }
    membership = "12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n"
    proc, cgroups = fake_machine(tmp_path, 64 * 1024**2, 10**6, membership, files)
    assert usable_ram(proc, cgroups, NO_LIMIT) == Room(2 * GIB, CGROUP)


def test_the_room_under_rlimit_as_is_the_limit_less_the_virtual_size(tmp_path):
    proc, cgroups = fake_machine(tmp_path, 64 * 1024**2, 1024**2, "0::/\n", {})
    assert usable_ram(proc, cgroups, 3 * GIB) == Room(2 * GIB, ADDRESS_SPACE)


def test_simulate_host_ram_is_in_gib(capsys):
    main(["simulate", "--model", "Qwen3-8B", "--host-ram", "256", "--max-seq-len", "--json"])
    judged = json.loads(capsys.readouterr().out)
    assert judged["host_ram_budget"] == int(256 * GIB * 0.9)  # the usable 90% of 256 GiB
