"""Run RoundPipe on several local processes (gloo), one per simulated node.

``launch(scenario, world, tmp_path, **params)`` starts ``world`` processes of this
module; each joins a gloo process group on localhost, runs the scenario of that name
(``SCENARIOS`` of ``multinode_scenarios`` or ``multinode_agreement``) and saves what
it returns to ``tmp_path/rank{r}.pt``. Nothing is imported from the parent: every
rank builds its model and data from seeds, like separate machines.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
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
    (``results[r]`` is None where rank ``r`` saved nothing)."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.update(RANK=str(rank), WORLD_SIZE=str(world))
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), str(ROOT)])
        env.update(OMP_NUM_THREADS="1")
        args = json.dumps({"scenario": scenario, "out": str(tmp_path), "params": params})
        procs.append(
            subprocess.Popen(
                [sys.executable, str(ROOT / "tests" / "support" / "multinode.py"), args],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outputs = [done.stdout + done.stderr for done in finish(procs, timeout)]
    results = []
    for rank in range(world):
        path = tmp_path / f"rank{rank}.pt"
        results.append(torch.load(path, weights_only=False) if path.exists() else None)
    return [p.returncode for p in procs], results, outputs


def _main() -> None:
    spec = json.loads(sys.argv[1])
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
    _main()
