"""The op program of a stage job (:mod:`roundpipe.core.program`) and the runtime that runs it.

The runtime and the simulator share one description of what a job does on its device:
``job_program`` lowers each job of ``schedule.lower`` to an ordered tuple of device ops
(weight chunks, activation uploads, compute, downloads, write-back, release). The
simulator replays these programs, so its predictions are only worth something if the
runtime executes exactly them. These tests check:

- the runtime follows the program: on every (device, stream) the ops it runs are, in
  execution order, the program's ops on that stream, job after job in schedule order,
  each op exactly once (random plans, device counts, microbatches, recompute grains,
  buffers, weight chunking and timing jitter on the emulated backend);
- the programs are well formed on their own: dependencies point backwards, every
  handoff read is produced earlier in the schedule (or is a call input), every handoff
  produced is read (or returned to the caller), each job ends with its release, the
  first compute waits for the weights, and a program prints every op;
- host waits bound uploads: an upload of microbatch *m* ≥ 2 is issued only after the
  last compute op of microbatch *m* − 2.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from support.programs import (
    call_shape,
    composition_sizes,
    lowered,
    model_programs,
    programs_cases,
)
from torch import nn

from roundpipe import EmulatedOptions, JobKind, Plan, RoundPipe, RoundPipeRunConfig, lower
from roundpipe.core.keys import Activation, InputGrad, Loss, Output
from roundpipe.core.op_kinds import COMPUTES, UPLOADS, OpKind, StreamName
from roundpipe.core.program import (
    DeviceOp,
)

WIDTH = 8

# -- random plans ----------------------------------------------------------------------


def random_composition(rng: random.Random, total: int) -> tuple[int, ...]:
    if total == 0:
        return ()
    return composition_sizes([rng.random() < 0.5 for _ in range(total - 1)])


def random_plan(rng: random.Random, layers: int) -> Plan:
    """A plan whose fused stage holds at most half the layers (if more than one), so most
    plans have forward and backward stages."""
    fused = rng.randint(1, max(1, layers // 2))
    rest = layers - fused
    return Plan(random_composition(rng, rest), (fused, *random_composition(rng, rest)))


# -- programs of a schedule --------------------------------------------------------------


# -- 1. the runtime follows the program ------------------------------------------------


def build_model(rng: random.Random, layers: int, with_norm: bool) -> nn.Sequential:
    torch.manual_seed(rng.randrange(2**31))
    kinds = [rng.choice(["linear", "linear", "tanh"]) for _ in range(layers)]
    if with_norm:
        kinds[rng.randrange(layers)] = "norm"
    make = {
        "linear": lambda: nn.Linear(WIDTH, WIDTH),
        "tanh": nn.Tanh,
        "norm": lambda: nn.BatchNorm1d(WIDTH),
    }
    return nn.Sequential(*[make[k]() for k in kinds])


def mse_sum(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return ((output - label) ** 2).sum()


def spans_by_stream(pipe: RoundPipe) -> dict[tuple[int, str], list[tuple[int, int]]]:
    """(job, op) of every program op run, per (device, stream), in execution order."""
    runs: dict[tuple[int, str], list] = {}
    for span in pipe.pool.spans():
        if span.info.op >= 0:
            runs.setdefault((span.device, span.stream), []).append(span)
    return {
        where: [(s.info.job, s.info.op) for s in sorted(spans, key=lambda s: s.start)]
        for where, spans in runs.items()
    }


@pytest.mark.parametrize("seed", range(40))
def test_the_runtime_runs_exactly_each_jobs_program_in_order_on_every_stream(seed):
    rng = random.Random(seed)
    devices = rng.randint(1, 4)
    microbatches = rng.randint(1, 5)
    layers = rng.randint(1, 8)
    grain = rng.choice(["stage", "layer"])
    with_norm = rng.random() < 0.5
    chunk_bytes = rng.choice([None, 48, 160, 10**6])
    rng_state = rng.random() < 0.7
    outputs = rng.random() < 0.3
    jitter = rng.random() < 0.5
    plan = random_plan(rng, layers)
    model = build_model(rng, layers, with_norm)
    config = RoundPipeRunConfig(
        num_microbatch=microbatches,
        execute_plan=plan,
        recompute_grain=grain,
        preserve_rng_state=rng_state,
        weight_chunk_bytes=chunk_bytes,
        gate_weight_chunks=rng.random() < 0.7,
    )
    options = EmulatedOptions(jitter_s=0.001 if jitter else 0.0, seed=seed)
    x, y = torch.randn(12, WIDTH), torch.randn(12, WIDTH)
    schedule = lower(plan, devices, 0)
    shape = call_shape(schedule, microbatches, grain, rng_state, outputs)
    programs = model_programs(model, schedule, shape, chunk_bytes)
    case = (
        f"plan {plan}, {devices} devices, {microbatches} microbatches, grain {grain}, "
        f"chunks {chunk_bytes}, norm {with_norm}, jitter {jitter}"
    )

    with RoundPipe(
        model, devices=f"emulated:{devices}", model_run_config=config, emulated_options=options
    ) as pipe:
        pipe.pool.start_recording()
        pipe.forward_backward((x,), label=y, loss_fn=mse_sum, return_outputs=outputs)
        pipe.synchronize()
        observed = spans_by_stream(pipe)

    # every op of every program ran exactly once, and nothing else did
    ran = Counter(op for ops in observed.values() for op in ops)
    expected = Counter((p.job.index, op.index) for p in programs for op in p.ops)
    assert ran == expected, f"{case}: ops run differ from the programs"

    for device in range(devices):
        on_device = [p for p in programs if p.job.device == device]
        for stream in StreamName:
            got = observed.get((device, stream.value), [])
            # per job: the program's ops on this stream, in program order
            for program in on_device:
                mine = [op for job, op in got if job == program.job.index]
                want = [op.index for op in program.on(stream)]
                assert mine == want, f"{case}: job {program.job} on {stream}\n{program}"
            # per device: the jobs one after another, in schedule order
            want = [(p.job.index, op.index) for p in on_device for op in p.on(stream)]
            assert got == want, f"{case}: device {device}, stream {stream}"


# -- 2. the programs on their own --------------------------------------------------------


def reads_of(op: DeviceOp) -> list:
    if op.kind in (OpKind.UPLOAD_INPUT, OpKind.UPLOAD_GRAD):
        return [op.key]
    if op.kind is OpKind.RECOMPUTE and op.key is not None:
        return [op.key]  # the RNG state the forward drew from
    return []


def produced_by(op: DeviceOp) -> list:
    return [*op.keys, *op.posts]


@settings(max_examples=150, deadline=None)
@given(programs_cases())
def test_ops_depend_only_on_earlier_ops_of_their_job(case):
    _, programs = lowered(case)
    for program in programs:
        assert [op.index for op in program.ops] == list(range(len(program.ops)))
        for op in program.ops:
            assert op.stream in StreamName
            assert all(0 <= i < op.index for i in op.inputs), f"{program}\n#{op.index}"
            if op.host_wait is not None:
                assert 0 <= op.host_wait < op.index, f"{program}\n#{op.index}"


@settings(max_examples=150, deadline=None)
@given(programs_cases())
def test_every_handoff_read_is_produced_earlier_and_every_handoff_produced_is_used(case):
    schedule, programs = lowered(case)
    microbatches = case[2]
    producer: dict = {}
    counts: Counter = Counter()
    for program in programs:
        for op in program.ops:
            for key in produced_by(op):
                counts[key] += 1
                producer[key] = program.job.index
                assert key.microbatch == op.microbatch
    assert all(n == 1 for n in counts.values()), [k for k, n in counts.items() if n > 1]
    call_inputs = {Activation(0, m) for m in range(microbatches)}
    assert any(j.kind is JobKind.FUSED for j in schedule.jobs)  # so no deferred gradient
    read = set()
    for program in programs:
        for op in program.ops:
            for key in reads_of(op):
                read.add(key)
                assert key.microbatch == op.microbatch
                if op.kind is OpKind.UPLOAD_INPUT:
                    assert isinstance(key, Activation)
                if op.kind is OpKind.UPLOAD_GRAD:
                    assert isinstance(key, InputGrad)
                if key in call_inputs:
                    continue
                assert key in producer, f"{program.job} #{op.index} reads {key}, never made"
                assert producer[key] < program.job.index, f"{key} is made after it is read"
    unread = [k for k in producer if k not in read and not isinstance(k, (Loss, Output))]
    assert not unread, f"produced but never read: {unread}"
    # the caller gets every microbatch's loss
    assert {Loss(m) for m in range(microbatches)} <= set(producer)


@settings(max_examples=150, deadline=None)
@given(programs_cases())
def test_a_program_waits_for_its_weights_ends_with_its_release_and_prints_every_op(case):
    _, programs = lowered(case)
    for program in programs:
        last = program.ops[-1]
        assert (last.kind, last.stream) == (OpKind.RELEASE, StreamName.COMPUTE)
        assert [op.kind for op in program.ops].count(OpKind.RELEASE) == 1
        weights = program.weight_ops
        assert weights == program.ops[: len(weights)]  # issued first, by the prefetch
        if weights:
            first_compute = program.on(StreamName.COMPUTE)[0]
            assert first_compute.kind in COMPUTES
            assert weights[-1].index in first_compute.inputs
        text = str(program)
        assert str(program.job) in text
        for op in program.ops:
            assert str(op) in text
            assert f"#{op.index} " in str(op)


@settings(max_examples=100, deadline=None)
@given(programs_cases())
def test_a_forward_job_downloads_its_output_first_then_its_saved_inputs_in_one_op(case):
    schedule, programs = lowered(case)
    shape = call_shape(schedule, case[2], case[3], case[4], case[5])
    for program in programs:
        job = program.job
        if job.kind is not JobKind.FORWARD:
            continue
        saves = shape.forward_saves(job)
        for m in range(shape.num_microbatches):
            downloads = [op for op in program.on(StreamName.DOWNLOAD) if op.microbatch == m]
            expected = [(Activation(job.layers.stop, m),)]
            if saves:
                expected.append(tuple(Activation(i, m) for i in saves))
            assert [op.keys for op in downloads] == expected, str(program)


# -- 3. host waits bound uploads ------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(programs_cases())
def test_an_upload_of_microbatch_m_waits_for_the_last_compute_of_microbatch_m_minus_2(case):
    _, programs = lowered(case)
    for program in programs:
        last_compute: dict[int, int] = {}
        for op in program.ops:
            if op.stream is StreamName.COMPUTE and op.microbatch is not None:
                last_compute[op.microbatch] = op.index
        for op in program.ops:
            if op.kind not in UPLOADS:
                if op.stream is not StreamName.ACT_UPLOAD:
                    assert op.host_wait is None, f"{program}\n#{op.index}"
                continue
            m = op.microbatch
            if m < 2:
                assert op.host_wait is None, f"{program}\n#{op.index}"
                continue
            waited = program.ops[op.host_wait]
            assert waited.stream is StreamName.COMPUTE and waited.kind in COMPUTES
            assert waited.microbatch == m - 2
            assert waited.index == last_compute[m - 2], f"{program}\n#{op.index}"
