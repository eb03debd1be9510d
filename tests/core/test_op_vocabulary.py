"""The op vocabulary (:class:`~roundpipe.core.program.OpKind`) and its one handler table.

- every kind the lowering emits is an ``OpKind``, on the stream its kind names, and an op
  stream (``StreamName``) is a different thing from an op kind of the same spelling;
- the runtime's table (:data:`roundpipe.runtime.op_table.OP_HANDLERS`) handles every kind,
  the weight uploads on the prefetch thread and nothing else there;
- an unknown kind is refused by name when an op is built, parsed or issued;
- a printed program parses back to the same ops and prints the same again: on every
  golden program and on programs lowered for random plans.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from support.programs import CASES, GOLDEN, lowered, programs_cases

from roundpipe.core.keys import Activation, InputGrad, Loss, Output, RngState
from roundpipe.core.op_kinds import OpKind, StreamName
from roundpipe.core.program import (
    CallShape,
    DeviceOp,
    JobProgram,
    job_program,
    recompute_inputs,
)
from roundpipe.core.schedule import lower
from roundpipe.runtime.op_table import OP_HANDLERS, IssuingThread, handler_for

# -- the kinds -------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(programs_cases())
def test_every_op_the_lowering_emits_has_a_known_kind_on_its_kinds_stream(case):
    _, programs = lowered(case)
    for program in programs:
        for op in program.ops:
            assert isinstance(op.kind, OpKind)
            assert isinstance(op.stream, StreamName)
            assert op.stream is op.kind.stream


def test_every_kind_says_roughly_what_it_does():
    for kind in OpKind:
        assert kind.roughly.strip(), kind


def test_a_download_op_is_not_the_download_stream():
    assert str(OpKind.DOWNLOAD) == str(StreamName.DOWNLOAD) == "download"
    assert OpKind.DOWNLOAD != StreamName.DOWNLOAD
    assert OpKind.DOWNLOAD.stream is StreamName.DOWNLOAD


def test_an_op_is_built_from_a_kind_or_its_name():
    assert DeviceOp(0, "forward", microbatch=0) == DeviceOp(0, OpKind.FORWARD, microbatch=0)


def test_an_unknown_kind_is_refused_by_name_when_an_op_is_built():
    with pytest.raises(ValueError, match=r"unknown op kind 'warp'.*upload_weights.*release"):
        DeviceOp(0, "warp")


def test_an_unknown_stream_is_refused_by_name():
    with pytest.raises(ValueError, match=r"unknown stream 'sideways'.*compute.*download"):
        StreamName("sideways")


# -- the handler table ----------------------------------------------------------------


def test_the_handler_table_covers_every_kind():
    assert set(OP_HANDLERS) == set(OpKind)


def test_the_prefetch_thread_issues_exactly_the_weight_upload_stream():
    prefetched = {
        kind for kind, handler in OP_HANDLERS.items() if handler.thread is IssuingThread.PREFETCH
    }
    assert prefetched == {kind for kind in OpKind if kind.stream is StreamName.WEIGHT_UPLOAD}
    assert prefetched == {OpKind.UPLOAD_WEIGHTS, OpKind.UPLOAD_BUFFERS}


def test_an_unknown_kind_is_refused_by_name_when_issued():
    with pytest.raises(ValueError, match=r"no handler for op kind 'warp'.*upload_input.*release"):
        handler_for("warp")


# -- printing and parsing back --------------------------------------------------------


def test_an_op_prints_and_parses_back():
    op = DeviceOp(
        7,
        OpKind.FORWARD,
        microbatch=2,
        layers=range(3, 6),
        posts=(RngState(3, 2), Output(2)),
        inputs=(1, 6),
        host_wait=4,
    )
    assert str(op) == (
        "#7 compute       forward mb2 L3-5 posts RngState(3,2),Output(2) after #1,#6 host waits #4"
    )
    assert DeviceOp.from_str(str(op)) == op


def test_a_download_parses_back_its_keys_and_an_upload_its_key():
    download = DeviceOp(3, OpKind.DOWNLOAD, microbatch=0, keys=(Loss(0),), inputs=(2,))
    upload = DeviceOp(1, OpKind.UPLOAD_GRAD, microbatch=0, key=InputGrad(2, 0))
    several = DeviceOp(4, OpKind.DOWNLOAD, microbatch=1, keys=(Activation(1, 1), Activation(2, 1)))
    for op in (download, upload, several):
        assert DeviceOp.from_str(str(op)) == op


def test_an_unknown_kind_is_refused_by_name_when_parsed():
    with pytest.raises(ValueError, match=r"unknown op kind 'warp'.*upload_weights"):
        DeviceOp.from_str("#0 compute       warp mb0")


def test_an_op_on_another_stream_than_its_kind_is_refused_when_parsed():
    with pytest.raises(ValueError, match=r"forward runs on compute, not download"):
        DeviceOp.from_str("#0 download      forward mb0")


def test_an_unreadable_op_line_is_refused_naming_the_line():
    line = "#0 compute       forward mb0 ?"
    with pytest.raises(ValueError, match=re.escape(f"cannot parse the op {line!r}: expected")):
        DeviceOp.from_str(line)


def test_a_program_whose_ops_are_misnumbered_is_refused():
    job = lower(CASES[0].plan, CASES[0].num_devices, CASES[0].first_device).jobs[0]
    text = f"{job}:\n  #1 compute       release"
    with pytest.raises(ValueError, match=r"op #1 stands at position 0"):
        JobProgram.from_str(text, job)


def golden_programs(name: str) -> list[str]:
    """The printed job programs of a golden file (the blocks after the schedule line)."""
    blocks = (GOLDEN / f"{name}.txt").read_text().strip().split("\n\n")
    return blocks[2:]


def lowered_golden(case) -> list[JobProgram]:
    """The programs a golden file was rendered from (as ``test_golden_programs.render``)."""
    schedule = lower(case.plan, case.num_devices, case.first_device)
    saved = recompute_inputs(schedule, case.recompute_grain, forward_only=False, deferred=False)
    shape = CallShape(
        case.num_microbatches,
        case.recompute_grain,
        saved,
        case.preserve_rng_state,
        case.return_outputs,
    )
    args = (case.weight_chunks, case.has_buffers, case.writes_back)
    return [job_program(job, shape, *args) for job in schedule.jobs]


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_every_golden_program_parses_back_to_the_lowered_program_and_prints_the_same(case):
    programs = lowered_golden(case)
    printed = golden_programs(case.name)
    assert len(printed) == len(programs)
    for program, text in zip(programs, printed, strict=True):
        parsed = JobProgram.from_str(text, program.job)
        assert parsed.ops == program.ops
        assert str(parsed) == text


@settings(max_examples=100, deadline=None)
@given(programs_cases())
def test_every_lowered_program_parses_back_to_equal_ops_and_prints_the_same(case):
    _, programs = lowered(case)
    for program in programs:
        parsed = JobProgram.from_str(str(program), program.job)
        assert parsed == program
        assert str(parsed) == str(program)
