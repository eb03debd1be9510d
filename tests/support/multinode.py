"""Run RoundPipe on several local processes (gloo), one per simulated node.

``launch(scenario, world, tmp_path, **params)`` starts ``world`` processes of this
module (forked from one that imported torch and roundpipe once); each joins a gloo
process group on localhost, runs the scenario of that name (``SCENARIOS`` of
``multinode_scenarios`` or ``multinode_agreement``) and saves what it returns to
``tmp_path/rank{r}.pt``. Nothing is taken from the test process or shared between the
ranks but code: every rank builds its model and data from seeds, like separate
machines.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]  # tests/support/multinode.py


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Done:
    returncode: int | None
    stdout: str
    stderr: str


def finish(processes: list[subprocess.Popen], timeout: float) -> list[Done]:
    """Wait for every process (killing all of them past ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    done = []
    for process in processes:
        try:
            out, err = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            out, err = process.communicate()
            err += "\n<<killed: timeout>>"
        done.append(Done(process.returncode, out, err))
    return done


def launch(scenario: str, world: int, tmp_path: Path, timeout: float = 120, **params):
    """Run ``scenario`` on ``world`` ranks; returns ``(returncodes, results, outputs)``
    (``results[r]`` is None where rank ``r`` saved nothing; a rank still running after
    ``timeout`` seconds is killed, its output ending in ``<<killed: timeout>>``).

    The ranks are processes forked from one that imported torch, torch.distributed and
    roundpipe once (:func:`_fork_ranks`): each joins the process group, builds its model
    and data and ends (normally, or by an error, ``os._exit`` or a kill) on its own."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env.update(WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), str(ROOT)])
    env.pop("RANK", None)
    with tempfile.TemporaryDirectory(prefix="ranks-") as logs:
        spec = {"scenario": scenario, "out": str(tmp_path), "params": params, "world": world,
                "logs": logs, "timeout": timeout}  # fmt: skip
        server = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "support" / "multinode.py"), json.dumps(spec)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        [done] = finish([server], timeout + 60)  # it kills its ranks at ``timeout``
        assert done.returncode == 0, f"multinode.py:\n{done.stdout}\n{done.stderr}"
        ranks = json.loads((Path(logs) / "ranks.json").read_text())
        outputs = []
        for rank in range(world):
            output = "".join((Path(logs) / f"rank{rank}.{s}").read_text() for s in ("out", "err"))
            outputs.append(output + ("\n<<killed: timeout>>" if ranks["killed"][rank] else ""))
    results = []
    for rank in range(world):
        path = tmp_path / f"rank{rank}.pt"
        results.append(torch.load(path, weights_only=False) if path.exists() else None)
    return ranks["codes"], results, outputs


def _fork_ranks(spec: dict) -> None:
    """Fork one process per rank; returns in each of them, with ``RANK`` set and its
    stdout and stderr in ``spec["logs"]``. This process waits for them (killing those
    left at ``spec["timeout"]``), writes their exit codes to ``logs/ranks.json`` and exits."""
    import torch._dynamo  # noqa: F401 - what a first optimizer imports (1-2 s)
    import torch.distributed  # noqa: F401

    from support import multinode_agreement, multinode_scenarios  # noqa: F401 - roundpipe

    logs, world = Path(spec["logs"]), spec["world"]
    sys.stdout.flush()
    sys.stderr.flush()
    running = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            for fd, suffix in ((1, "out"), (2, "err")):
                target = os.open(logs / f"rank{rank}.{suffix}", os.O_WRONLY | os.O_CREAT, 0o644)
                os.dup2(target, fd)
                os.close(target)
            os.environ["RANK"] = str(rank)
            return
        running[pid] = rank
    codes, killed = [None] * world, [False] * world
    deadline = time.monotonic() + spec["timeout"]
    while running:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
            continue
        if time.monotonic() > deadline and not any(killed):
            for pid, rank in running.items():
                killed[rank] = True
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    (logs / "ranks.json").write_text(json.dumps({"codes": codes, "killed": killed}))
    sys.exit(0)


def _main(spec: dict) -> None:
    import torch.distributed as dist

    from support import multinode_agreement, multinode_scenarios

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=spec["params"].get("pg_timeout_s", 60))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    try:
        scenarios = {**multinode_scenarios.SCENARIOS, **multinode_agreement.SCENARIOS}
        result = scenarios[spec["scenario"]](rank, **spec["params"])
        torch.save(result, Path(spec["out"]) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    SPEC = json.loads(sys.argv[1])
    _fork_ranks(SPEC)  # returns in each rank's process only
    _main(SPEC)  # then the rank's interpreter ends as a script's does
