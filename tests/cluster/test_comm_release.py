"""A collective returns only once gloo has let go of its tensors.

Gloo's worker thread drops its references to a collective's tensors just after the
collective returns and needs the GIL to do so; a process that exits in that window
aborts ("terminate called without an active exception"), which a two-rank test hit
about once in five runs. Each case runs in a fresh process on a one-rank gloo group and
checks, after every call, that no tensor handed to gloo is still alive.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import weakref, torch, torch.distributed as dist
    from roundpipe.cluster import comm as comm_module
    from roundpipe.cluster.comm import Comm

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    handed = []
    gather, reduce = comm_module._all_gather, dist.all_reduce

    def recording_gather(out, tensor, **kwargs):
        handed.extend([weakref.ref(out), weakref.ref(tensor)])
        return gather(out, tensor, **kwargs)

    def recording_reduce(tensor, *args, **kwargs):
        handed.append(weakref.ref(tensor))
        return reduce(tensor, *args, **kwargs)

    comm_module._all_gather, dist.all_reduce = recording_gather, recording_reduce
    comm = Comm(dist.group.WORLD, timeout=None)
    alive = 0
    for i in range({calls}):
        comm.gather_ints([i, 1], "a test")
        comm.all_reduce(torch.ones(4), "a test")
        comm.gather_status(torch.zeros(3, dtype=torch.int32), "a test")
        alive += sum(ref() is not None for ref in handed)
        handed.clear()
    dist.destroy_process_group()
    print("alive", alive)
    """
)


def test_no_tensor_handed_to_gloo_outlives_its_collective():
    script = SCRIPT.format(calls=700)
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-2:] == ["alive", "0"], done.stdout + done.stderr
