"""Golden programs: the jobs two small plans lower to, and every job's device ops, as text.

For each case in ``CASES``, :func:`render` prints ``roundpipe.core.schedule.lower(plan,
num_devices, first_device)`` and, for every job, ``roundpipe.core.program.job_program``
(the ops in issue order: stream, microbatch, layers, the handoff keys read and produced,
the ops each waits for, the host waits). The test compares that text with the
checked-in file ``tests/golden/<case>.txt``: any change in what a job does on its
device (an op added, dropped or reordered, another key, stream or wait) fails, naming
the first line that differs (``-vv`` shows the whole diff).

When such a change is intended, regenerate the files and review the diff with the
change:

    ROUNDPIPE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest -q tests/core/test_golden_programs.py
    git diff tests/golden/

With ``ROUNDPIPE_UPDATE_GOLDEN=1`` each test writes its file instead of comparing (and
passes); without it, a missing file fails.

The cases: ``2|1,1,1`` (a forward stage of two layers that keeps the input of its
second layer for recompute, three microbatches so that uploads wait for the compute two
microbatches back, outputs returned) and ``1,1|1,2`` (two forward stages, a backward
stage of two layers recomputed layer by layer with the RNG state preserved, two weight
chunks, buffers written back, starting on device 1).
"""

from __future__ import annotations

import os

import pytest
from support.programs import CASES, GOLDEN, Case

from roundpipe.core.program import CallShape, job_program, recompute_inputs
from roundpipe.core.schedule import lower

UPDATE = os.environ.get("ROUNDPIPE_UPDATE_GOLDEN") == "1"


def render(case: Case) -> str:
    """The schedule of ``case`` and the program of each of its jobs, with the arguments."""
    schedule = lower(case.plan, case.num_devices, case.first_device)
    saved = recompute_inputs(schedule, case.recompute_grain, forward_only=False, deferred=False)
    shape = CallShape(
        num_microbatches=case.num_microbatches,
        recompute_grain=case.recompute_grain,
        recompute_inputs=saved,
        preserve_rng_state=case.preserve_rng_state,
        return_outputs=case.return_outputs,
    )
    lines = [
        f"# lower(Plan({case.plan.forward}, {case.plan.backward}), num_devices="
        f"{case.num_devices}, first_device={case.first_device})",
        f"# CallShape(num_microbatches={shape.num_microbatches}, recompute_grain="
        f"{shape.recompute_grain!r}, recompute_inputs={sorted(saved)},",
        f"#           preserve_rng_state={shape.preserve_rng_state}, "
        f"return_outputs={shape.return_outputs})",
        f"# job_program(job, shape, weight_chunks={case.weight_chunks}, "
        f"has_buffers={case.has_buffers}, writes_back={case.writes_back})",
        "",
        f"schedule: {schedule}",
    ]
    for job in schedule.jobs:
        program = job_program(job, shape, case.weight_chunks, case.has_buffers, case.writes_back)
        lines += ["", str(program)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_the_lowered_programs_match_the_golden_text(case: Case) -> None:
    path = GOLDEN / f"{case.name}.txt"
    actual = render(case)
    if UPDATE:
        path.parent.mkdir(exist_ok=True)
        path.write_text(actual)
        return
    assert path.exists(), f"{path} is missing: run with ROUNDPIPE_UPDATE_GOLDEN=1 to write it"
    expected = path.read_text()
    # compared line by line, so that pytest names the first line that differs
    assert actual.splitlines() == expected.splitlines(), (
        f"the programs (left) differ from {path.relative_to(GOLDEN.parent.parent)} (right); "
        "if intended, regenerate it with ROUNDPIPE_UPDATE_GOLDEN=1 and review git diff"
    )
