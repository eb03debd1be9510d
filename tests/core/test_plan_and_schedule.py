"""Plans and their lowering to jobs: properties that must hold for every valid plan,
and random plans trained against the PyTorch oracle."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.oracle import assert_grads_close, batch, mlp, mse_sum, reference_loss_and_grads
from support.programs import plans

from roundpipe import JobKind, Plan, PlanError, RoundPipe, RoundPipeRunConfig, lower


@given(plans(), st.integers(1, 8), st.integers(0, 7))
def test_every_layer_runs_once_forward_and_once_backward(plan, devices, first):
    schedule = lower(plan.validate(plan.num_layers), devices, first)
    forward_layers = [i for j in schedule.jobs if j.kind is not JobKind.BACKWARD for i in j.layers]
    backward_layers = [i for j in schedule.jobs if j.kind is not JobKind.FORWARD for i in j.layers]
    assert forward_layers == list(range(plan.num_layers))
    assert sorted(backward_layers) == list(range(plan.num_layers))
    assert [j.kind for j in schedule.jobs].count(JobKind.FUSED) == 1


@given(plans(), st.integers(1, 8), st.integers(0, 7))
def test_jobs_go_round_robin_and_the_cursor_continues(plan, devices, first):
    schedule = lower(plan, devices, first)
    assert [j.device for j in schedule.jobs] == [
        (first + i) % devices for i in range(len(schedule.jobs))
    ]
    following = lower(plan, devices, schedule.next_device)
    assert following.jobs[0].device == (schedule.jobs[-1].device + 1) % devices


@given(plans())
def test_backward_stages_recompute_from_an_input_the_forward_saved(plan):
    schedule = lower(plan, 3)
    for job in schedule.jobs:
        if job.kind is JobKind.BACKWARD:
            source = schedule.jobs[job.saved_input_from]
            assert source.kind is JobKind.FORWARD and job.layers.start in source.layers


@given(plans())
def test_a_plan_reads_back_from_its_string_form(plan):
    assert Plan.parse(str(plan)) == plan


@given(plans(), st.integers(1, 3))
def test_a_plan_for_another_layer_count_is_rejected(plan, extra):
    with pytest.raises(PlanError):
        plan.validate(plan.num_layers + extra)


@settings(max_examples=12, deadline=None)
@given(
    plans(max_layers=6).filter(lambda p: p.num_layers == 6), st.integers(1, 4), st.integers(1, 5)
)
def test_random_plans_train_exactly_like_pytorch(plan, devices, num_microbatch):
    model = mlp()
    reference = copy.deepcopy(model)
    x, y = batch()
    config = RoundPipeRunConfig(num_microbatch=num_microbatch, execute_plan=plan)
    with RoundPipe(model, devices=f"emulated:{devices}", model_run_config=config) as pipe:
        loss = pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
        pipe.synchronize()
    torch.testing.assert_close(loss, reference_loss_and_grads(reference, x, y, num_microbatch))
    assert_grads_close(model, reference)
