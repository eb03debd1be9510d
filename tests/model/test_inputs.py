"""Bad input is rejected with a clear error before any work starts, and harms nothing.

Covers what a user hands to RoundPipe: the model, the device spec, ``pin_model``,
run-config values, plans, and the inputs and labels of a call. A rejected call must
run no stream op and leave the model training exactly like plain PyTorch.

The model has five layers on three emulated devices, four microbatches, and the plan
``2,1|2,1,1,1``: forward stages (layers 0-1) and (2), the fused stage (3-4), then
backward stages (2), (1), (0).
"""

from __future__ import annotations

import pytest
import torch
from support.oracle import batch, mlp, mse_sum
from torch import nn

from roundpipe import Plan, PlanError, RoundPipe, RoundPipeRunConfig

NUM_MICROBATCH = 4
CONFIG = RoundPipeRunConfig(num_microbatch=NUM_MICROBATCH, execute_plan="2,1|2,1,1,1")


@pytest.fixture
def model_and_reference(wrap):
    return wrap(mlp(depth=5), devices="emulated:3", model_run_config=CONFIG)


# -- calls rejected before any work ------------------------------------------------------


def train_on(model: RoundPipe, x, y, **options):
    return model.forward_backward((x,), label=y, loss_fn=mse_sum, **options)


def input_off_host(model):
    x, y = batch()
    return train_on(model, x.to("meta"), y)


def keyword_input_off_host(model):
    x, y = batch()
    return model.forward_backward(input_kwargs={"input": x.to("meta")}, label=y, loss_fn=mse_sum)


def label_off_host(model):
    x, y = batch()
    return train_on(model, x, y.to("meta"))


def batch_smaller_than_microbatch_count(model):
    x, y = batch(size=NUM_MICROBATCH - 1)
    return train_on(model, x, y)


def label_batch_mismatch(model):
    x, y = batch()
    return train_on(model, x, y[:-3])


def inputs_disagree_on_batch_size(model):
    x, y = batch()
    return model.forward_backward((x, x[:-1]), label=y, loss_fn=mse_sum)


def scalar_input(model):
    _, y = batch()
    return train_on(model, torch.tensor(1.0), y)


def input_without_tensors(model):
    _, y = batch()
    return model.forward_backward((1.0,), label=y, loss_fn=mse_sum)


def missing_loss_fn(model):
    x, y = batch()
    return model.forward_backward((x,), label=y)


def split_input_with_wrong_count(model):
    x, y = batch()
    config = CONFIG.replace(split_input=lambda args, kwargs, num: [(args, kwargs)])
    return train_on(model, x, y, run_config=config)


def split_label_with_wrong_count(model):
    x, y = batch()
    config = CONFIG.replace(split_label=lambda label, num: [label])
    return train_on(model, x, y, run_config=config)


def plan_call(plan: Plan):
    def call(model):
        x, y = batch()
        return train_on(model, x, y, run_config=CONFIG.replace(execute_plan=plan))

    return call


PLAN_MISSING_A_LAYER = Plan((2, 1), (2, 1, 1))  # backward covers 4 of 5 layers
PLAN_WITH_A_LAYER_TWICE = Plan((2, 1), (2, 1, 1, 1, 1))  # backward covers 6 of 5 layers
PLAN_WITH_EMPTY_STAGE = Plan((2, 0, 1), (2, 1, 1, 1))
PLAN_WITHOUT_BACKWARD_STAGES = Plan((5,), ())
PLAN_OVERLAPPING_FUSED_STAGE = Plan((2, 2), (2, 1, 1, 1))  # forward runs into the fused stage

REJECTED_CALLS = {
    "input_off_host": (input_off_host, ValueError, r"host memory.*meta|meta.*host memory"),
    "keyword_input_off_host": (keyword_input_off_host, ValueError, "host memory"),
    "label_off_host": (label_off_host, ValueError, r"label.*host memory"),
    "batch_smaller_than_microbatch_count": (
        batch_smaller_than_microbatch_count,
        ValueError,
        r"3 samples.*4 microbatches.*at least 4.*num_microbatch=3",
    ),
    "label_batch_mismatch": (label_batch_mismatch, ValueError, r"label.*\b10\b.*\b13\b"),
    "inputs_disagree_on_batch_size": (
        inputs_disagree_on_batch_size,
        ValueError,
        r"batch size.*\[12, 13\]",
    ),
    "scalar_input": (scalar_input, ValueError, "0-dimensional"),
    "input_without_tensors": (input_without_tensors, ValueError, "no tensor"),
    "missing_loss_fn": (missing_loss_fn, TypeError, "loss_fn"),
    "split_input_with_wrong_count": (
        split_input_with_wrong_count,
        ValueError,
        r"split_input returned 1 .*expected 4",
    ),
    "plan_missing_a_layer": (plan_call(PLAN_MISSING_A_LAYER), PlanError, r"cover 4 .*has 5"),
    "plan_with_a_layer_twice": (plan_call(PLAN_WITH_A_LAYER_TWICE), PlanError, r"cover 6 .*has 5"),
    "plan_with_empty_stage": (plan_call(PLAN_WITH_EMPTY_STAGE), PlanError, "at least one layer"),
    "plan_without_backward_stages": (
        plan_call(PLAN_WITHOUT_BACKWARD_STAGES),
        PlanError,
        "no backward stages",
    ),
    "plan_overlapping_fused_stage": (
        plan_call(PLAN_OVERLAPPING_FUSED_STAGE),
        PlanError,
        r"forward stages cover 4 layers.*fused stage",
    ),
}


@pytest.mark.parametrize("case", REJECTED_CALLS)
def test_bad_call_raises_a_clear_error(case, model_and_reference, no_hang):
    call, kind, message = REJECTED_CALLS[case]
    model, _ = model_and_reference
    with pytest.raises(kind, match=message):
        no_hang(call, model)


@pytest.mark.parametrize(
    "call",
    [
        *[pytest.param(call, id=case) for case, (call, _, _) in REJECTED_CALLS.items()],
        pytest.param(split_label_with_wrong_count, id="split_label_with_wrong_count"),
    ],
)
def test_rejected_call_runs_nothing_and_leaves_model_trainable(
    call, model_and_reference, no_hang, trains_like_pytorch
):
    model, reference = model_and_reference
    model.pool.start_recording()
    with pytest.raises(Exception):  # noqa: B017 - which error is the test above's business
        no_hang(call, model)
    assert model.pool.spans() == [], "the rejected call started work on the devices"
    trains_like_pytorch(model, reference)
    assert model.pool.spans(), "recording saw no work at all; the check above is vacuous"


def test_split_label_with_wrong_count_raises_a_clear_error(model_and_reference, no_hang):
    model, _ = model_and_reference
    with pytest.raises(ValueError, match=r"split_label.*1 microbatch"):
        no_hang(split_label_with_wrong_count, model)


def test_inference_input_off_host_raises_before_any_work(model_and_reference):
    model, _ = model_and_reference
    model.pool.start_recording()
    x, _ = batch()
    with torch.no_grad(), pytest.raises(ValueError, match="host memory"):
        model(x.to("meta"))
    assert model.pool.spans() == []


def test_bad_plan_pinned_at_construction_raises_by_the_first_call(wrap, no_hang):
    config = CONFIG.replace(execute_plan=PLAN_MISSING_A_LAYER)
    built = []
    with pytest.raises(PlanError, match="every layer"):
        model, _ = wrap(mlp(depth=5), devices="emulated:3", model_run_config=config)
        built.append(model)
        model.pool.start_recording()
        no_hang(train_on, model, *batch())
    assert all(model.pool.spans() == [] for model in built)


def test_plan_from_non_contiguous_ranges_raises_plan_error():
    with pytest.raises(PlanError, match="not contiguous"):
        Plan.from_ranges([range(0, 2), range(3, 4)], [range(4, 5), range(2, 4), range(0, 2)])


# -- the model -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model",
    [lambda x: x, [nn.Linear(2, 2)], None, "nn.Linear(2, 2)"],
    ids=["function", "list_of_modules", "none", "string"],
)
def test_non_module_model_raises_type_error(model):
    with pytest.raises(TypeError, match=r"nn\.Module"):
        RoundPipe(model, devices="emulated:1")


def test_empty_sequential_raises_value_error():
    with pytest.raises(ValueError, match="no layers"):
        RoundPipe(nn.Sequential(), devices="emulated:1")


# -- devices and pinning -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "kind", "message"),
    [
        ("emulated:x", ValueError, r"'emulated:x'.*emulated:N"),
        ("emulated:2.5", ValueError, r"'emulated:2\.5'.*emulated:N"),
        ("emulated:0", ValueError, "at least one device"),
        ("tpu:0", ValueError, r"unknown device spec 'tpu:0'.*cuda.*emulated"),
        ("", ValueError, "unknown device spec"),
        (3, TypeError, "spec string"),
    ],
)
def test_bad_device_spec_raises(spec, kind, message):
    with pytest.raises(kind, match=message):
        RoundPipe(mlp(depth=5), devices=spec)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("spec", ["cuda", "cuda:0,1"])
def test_cuda_spec_without_cuda_raises_and_suggests_emulated(spec):
    with pytest.raises(RuntimeError, match=r"CUDA.*not available.*emulated:N"):
        RoundPipe(mlp(depth=5), devices=spec)


@pytest.mark.parametrize("pin_model", ["yes", True, None, "ALLOC"])
def test_bad_pin_model_raises_listing_the_modes(pin_model):
    with pytest.raises(ValueError, match=r"pin_model.*'alloc'.*'register'.*'off'"):
        RoundPipe(mlp(depth=5), devices="emulated:1", pin_model=pin_model)


# -- run-config values -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "kind", "message"),
    [
        ({"num_microbatch": 0}, ValueError, "num_microbatch.*positive"),
        ({"num_microbatch": -2}, ValueError, "num_microbatch.*positive"),
        ({"num_microbatch": 2.5}, ValueError, "num_microbatch.*positive"),
        ({"num_microbatch": "4"}, ValueError, "num_microbatch.*positive"),
        ({"recompute_grain": "block"}, ValueError, r"recompute_grain.*'stage'.*'layer'"),
        ({"weight_chunk_bytes": 0}, ValueError, "weight_chunk_bytes.*positive"),
        ({"weight_chunk_bytes": -1}, ValueError, "weight_chunk_bytes.*positive"),
        ({"execute_plan": "2,1"}, PlanError, r"fwd,fwd,\.\.\.\|bwd"),
        ({"execute_plan": "2,x|2,1,1"}, PlanError, "could not read plan"),
        pytest.param(
            {"execute_plan": [(2, 1), (2, 1, 1)]},
            TypeError,
            "execute_plan",
            id="execute_plan-list",
        ),
    ],
)
def test_bad_run_config_value_raises(options, kind, message):
    with pytest.raises(kind, match=message):
        RoundPipeRunConfig(**options)


def test_moving_the_wrapped_model_to_another_device_or_dtype_is_refused():
    from torch import nn

    from roundpipe import RoundPipe

    with RoundPipe(nn.Sequential(nn.Linear(2, 2)), devices="emulated:1") as pipe:
        with pytest.raises(RuntimeError, match="host memory"):
            pipe.to(torch.float16)
        assert next(pipe.model.parameters()).dtype == torch.float32
