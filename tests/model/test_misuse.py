"""Model shapes PyTorch accepts, and misuse that must fail early and clearly.

A module repeated in an ``nn.Sequential`` and in-place ops on a layer's input train
exactly as PyTorch does. A detached loss, an optimizer over the wrong parameters,
malformed plans, device specs and options, and pickling raise an error that says what
is wrong (and what to do) instead of training silently wrong or failing later
somewhere else.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Callable

import pytest
import torch
from support.oracle import batch, mlp, mse_sum
from torch import nn

from roundpipe import (
    Plan,
    PlanError,
    RoundPipe,
    RoundPipeRunConfig,
    make_pool,
)

NUM_MICROBATCH = 3


def config(**fields) -> RoundPipeRunConfig:
    return RoundPipeRunConfig(num_microbatch=NUM_MICROBATCH, **fields)


def sgd_step(optimizer: torch.optim.Optimizer) -> Callable[[], object]:
    return lambda: (optimizer.step(), optimizer.zero_grad())


def construct(module: nn.Module, **options) -> None:
    """Build a RoundPipe and close it again (reached only if the options were accepted)."""
    RoundPipe(module, **options).close()


# -- a module repeated in an nn.Sequential -----------------------------------------------


def repeated_linear_model() -> nn.Sequential:
    """Five entries, four modules: the same Linear(16, 16) at positions 1 and 3."""
    torch.manual_seed(0)
    shared = nn.Linear(16, 16)
    return nn.Sequential(nn.Linear(8, 16), shared, nn.Tanh(), shared, nn.Linear(16, 4))


@pytest.mark.parametrize(
    "plan",
    ["1,2|2,1,1,1", "2|3,1,1", None],
    ids=["repeats-in-forward-fused-and-backward", "repeats-in-fused-and-backward", "auto"],
)
def test_a_module_repeated_in_a_sequential_runs_at_every_position(plan, wrap, trains_like_pytorch):
    model, reference = wrap(
        repeated_linear_model(), devices="emulated:2", model_run_config=config(execute_plan=plan)
    )
    trains_like_pytorch(model, reference)  # the shared weight gets both positions' gradients


def test_a_module_with_buffers_repeated_in_a_sequential_is_rejected_at_construction():
    norm = nn.BatchNorm1d(16)
    repeated = nn.Sequential(nn.Linear(8, 16), norm, nn.Linear(16, 16), norm, nn.Linear(16, 4))
    with pytest.raises(ValueError, match=r"buffer.*(separate|two|copy)") as caught:
        construct(repeated, devices="emulated:1")
    assert "BatchNorm1d" in str(caught.value)


# -- in-place ops on a layer's input ------------------------------------------------------


class AddOneInPlace(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x += 1
        return x


def in_place_model(kind: str) -> nn.Sequential:
    """Seven layers; layers 1, 3 and 5 work in place on their input (a Linear's output)."""
    torch.manual_seed(0)

    def in_place() -> nn.Module:
        return nn.ReLU(inplace=True) if kind == "relu" else AddOneInPlace()

    return nn.Sequential(
        nn.Linear(8, 16),
        in_place(),
        nn.Linear(16, 16),
        in_place(),
        nn.Linear(16, 16),
        in_place(),
        nn.Linear(16, 4),
    )


# In both plans the in-place layers start a forward stage, the fused stage and backward
# stages (whose recompute runs them again on the saved stage input).
IN_PLACE_PLANS = {"1,2|4,2,1": "forward-1-fused-3", "3,2|2,2,2,1": "forward-3-fused-5"}


@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("plan", list(IN_PLACE_PLANS), ids=list(IN_PLACE_PLANS.values()))
@pytest.mark.parametrize("kind", ["relu", "add"], ids=["ReLU(inplace=True)", "x+=1"])
def test_a_layer_working_in_place_on_its_input_trains_like_pytorch(
    kind, plan, grain, wrap, trains_like_pytorch
):
    model, reference = wrap(
        in_place_model(kind),
        devices="emulated:2",
        model_run_config=config(execute_plan=plan, recompute_grain=grain),
    )
    trains_like_pytorch(model, reference)


# -- a loss that does not require grad ----------------------------------------------------


def detached_loss(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return mse_sum(output, label).detach()


def test_a_loss_that_does_not_require_grad_raises(wrap, no_hang):
    model, _ = wrap(mlp(), devices="emulated:2", model_run_config=config())
    x, y = batch()
    with pytest.raises((RuntimeError, ValueError), match=r"requires? grad|detached"):
        no_hang(model.forward_backward, (x,), label=y, loss_fn=detached_loss)


def test_after_a_detached_loss_the_model_trains_like_pytorch(wrap, no_hang, trains_like_pytorch):
    model, reference = wrap(mlp(), devices="emulated:2", model_run_config=config())
    x, y = batch()
    with pytest.raises((RuntimeError, ValueError)):
        no_hang(model.forward_backward, (x,), label=y, loss_fn=detached_loss)
    trains_like_pytorch(model, reference)


# -- an optimizer over the wrapped model's parameters ------------------------------------


@pytest.mark.parametrize(
    "parameters",
    [lambda pipe: pipe.parameters(), lambda pipe: pipe.model.parameters()],
    ids=["pipe.parameters()", "pipe.model.parameters()"],
)
def test_an_optimizer_over_the_model_parameters_fails_on_its_first_step(parameters, wrap, no_hang):
    model, _ = wrap(mlp(), devices="emulated:2", model_run_config=config())
    optimizer = torch.optim.SGD(parameters(model), lr=0.1)
    x, y = batch()
    no_hang(model.forward_backward, (x,), label=y, loss_fn=mse_sum)
    with pytest.raises(RuntimeError, match="optim_parameters"):
        no_hang(model.step, sgd_step(optimizer), is_async=False)


# -- plans ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "forward, backward, shown",
    [
        ((2.7, 1.2), (1, 1, 1), "2.7"),
        ((2.0,), (1, 1), "2.0"),
        ((True,), (1, 1), "True"),
        ((2,), (1, "1"), "'1'"),
        ((-1, 3), (1, 1, 1), "-1"),
    ],
    ids=["fractions", "float", "bool", "string", "negative"],
)
def test_a_plan_with_a_stage_size_that_is_not_a_layer_count_is_rejected(forward, backward, shown):
    with pytest.raises(PlanError, match=re.escape(shown)):
        Plan(forward, backward)


def test_a_plan_with_an_empty_stage_is_rejected_naming_its_sizes():
    with pytest.raises(PlanError, match=re.escape("[2, 0, 1]")):
        Plan((2, 0, 1), (2, 1, 1, 1)).validate(5)


def test_a_plan_string_with_a_fractional_size_is_rejected():
    with pytest.raises(PlanError, match=re.escape("2.5")):
        Plan.parse("2.5|1,1")


# -- device specs ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec", ["emulated:", "emulated", "emulated:0", "emulated:-1", "emulated:x"]
)
def test_an_emulated_spec_needs_a_positive_device_count(spec):
    with pytest.raises(ValueError, match=re.escape(repr(spec))):
        make_pool(spec)


@pytest.mark.parametrize("spec", ["cuda:", "cuda:-1", "cuda:0,,1"])
def test_a_malformed_cuda_spec_is_rejected_with_or_without_cuda(spec):
    with pytest.raises(ValueError, match=re.escape(repr(spec))):
        make_pool(spec)


# -- run configs and model options ------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {"prefetch_stages": 1.5},
        {"prefetch_stages": "2"},
        {"weight_chunk_bytes": 1.5e6},
        {"weight_chunk_bytes": True},
        {"seq_chunk_tokens": 4096.0},
        {"seq_chunk_tokens": True},
        {"preserve_rng_state": "yes"},
        {"split_input": 3},
        {"split_label": "dim0"},
        {"merge_output": [torch.cat]},
        {"recompute_grain": 1},
    ],
    ids=lambda fields: next(iter(fields)),
)
def test_a_run_config_field_of_the_wrong_type_is_rejected_naming_it(fields):
    (name,) = fields
    with pytest.raises(TypeError, match=name):
        RoundPipeRunConfig(**fields)


@pytest.mark.parametrize("tokens", [0, -4096])
def test_a_sequence_chunk_must_be_positive(tokens):
    with pytest.raises(ValueError, match=f"seq_chunk_tokens must be positive, got {tokens}"):
        RoundPipeRunConfig(seq_chunk_tokens=tokens)


def test_a_run_config_given_as_a_dict_to_a_call_is_rejected(wrap, no_hang):
    model, _ = wrap(mlp(), devices="emulated:2")
    x, y = batch()
    with pytest.raises(TypeError, match="RoundPipeRunConfig"):
        no_hang(
            model.forward_backward, (x,), label=y, loss_fn=mse_sum, run_config={"num_microbatch": 2}
        )


def test_a_run_config_given_as_a_dict_to_the_model_is_rejected():
    with pytest.raises(TypeError, match="RoundPipeRunConfig"):
        construct(mlp(), devices="emulated:2", model_run_config={"num_microbatch": 2})


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool])
def test_a_non_floating_optim_dtype_is_rejected_at_construction(dtype):
    with pytest.raises((TypeError, ValueError), match="optim_dtype"):
        construct(mlp(), devices="emulated:1", optim_dtype=dtype)


def test_a_zero_size_batch_is_rejected_without_suggesting_zero_microbatches(wrap, no_hang):
    model, _ = wrap(mlp(), devices="emulated:2", model_run_config=config())
    with pytest.raises(ValueError) as caught:
        no_hang(
            model.forward_backward, (torch.zeros(0, 8),), label=torch.zeros(0, 4), loss_fn=mse_sum
        )
    assert "num_microbatch=0" not in str(caught.value)


@pytest.mark.parametrize("trained", [False, True], ids=["fresh", "trained"])
def test_pickling_a_model_raises_type_error_saying_to_save_its_state_dict(trained, wrap, no_hang):
    model, _ = wrap(mlp(depth=4), devices="emulated:2", model_run_config=config())
    if trained:
        x, y = batch()
        no_hang(model.forward_backward, (x,), label=y, loss_fn=mse_sum)
    with pytest.raises(TypeError, match="state_dict"):
        pickle.dumps(model)
