"""Which weights a call uses: one version owner, no parity between even and odd step counts.

Weight version ``v_k`` is the weights after the ``k``-th optimizer step. Decided rules:

- async: the calls made after the ``k``-th ``step(..., is_async=True)`` use ``v_{k-1}``;
- ``synchronize()`` (and ``state_dict()``, which calls it) applies every queued step, and
  the NEXT call uses the newest weights, at any step count. So a run that synchronizes
  after step ``k`` continues exactly like a run saved at ``k`` and resumed;
- weights written with ``load_state_dict`` or in place (``p.copy_(w)`` under ``no_grad``,
  after ``synchronize()``) are what the next call uses, at any step count;
- a failing ``step_fn`` leaves the fp32 masters exactly as it left them (never rounded to
  the model's bf16 upload copy), and the next calls use those masters.

Every run is compared with plain PyTorch. The step counts cover even and odd values:
today's double buffering (``version % 2``) gets one parity right and the other wrong.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from support.oracle import assert_weights_close, batch, mlp, mse_sum, reference_loss_and_grads
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig

NUM_MICROBATCH = 3
CONFIG = RoundPipeRunConfig(num_microbatch=NUM_MICROBATCH, execute_plan="2,2|2,1,1,1,1")
DEVICES = "emulated:3"
LR = 0.1


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)


def adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def step_fn(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    return lambda: (optimizer.step(), optimizer.zero_grad())


def train_call(model: RoundPipe, seed: int) -> torch.Tensor:
    x, y = batch(seed=seed)
    return model.forward_backward((x,), label=y, loss_fn=mse_sum)


def run_async_steps(model: RoundPipe, optimizer, seeds, no_hang) -> None:
    for seed in seeds:
        no_hang(train_call, model, seed)
        no_hang(model.step, step_fn(optimizer), is_async=True)


def train_with_versions(
    model: nn.Module,
    seeds: list[int],
    make_optimizer: Callable,
    version_of_call: Callable[[int], int],
) -> tuple[nn.Module, list[float]]:
    """PyTorch: call ``i`` computes its gradients at ``v_{version_of_call(i)}``, then step ``i+1``.

    The update itself is applied to the newest weights, as RoundPipe's optimizer does.
    """
    model = copy.deepcopy(model)
    optimizer = make_optimizer(model.parameters())
    versions = [copy.deepcopy(model)]
    losses = []
    for i, seed in enumerate(seeds):
        x, y = batch(seed=seed)
        grad_model = copy.deepcopy(versions[version_of_call(i)])
        grad_model.zero_grad()
        losses.append(reference_loss_and_grads(grad_model, x, y, NUM_MICROBATCH).item())
        for p, g in zip(model.parameters(), grad_model.parameters(), strict=True):
            p.grad = g.grad.clone()
        optimizer.step()
        optimizer.zero_grad()
        versions.append(copy.deepcopy(model))
    return model, losses


def named(name: str) -> Callable[[str], str]:
    return lambda message: f"{name}: {message}"


def one_step_stale(i: int) -> int:
    return max(i - 1, 0)


def random_weights() -> dict[str, torch.Tensor]:
    return mlp(seed=99).state_dict()


# -- external writes ------------------------------------------------------------------


def write_with_load_state_dict(model: RoundPipe, weights: dict[str, torch.Tensor], no_hang):
    no_hang(model.load_state_dict, weights)


def write_in_place(model: RoundPipe, weights: dict[str, torch.Tensor], no_hang):
    no_hang(model.synchronize)
    with torch.no_grad():
        for name, param in model.model.named_parameters():
            param.copy_(weights[name])


@pytest.mark.parametrize(
    "write", [write_with_load_state_dict, write_in_place], ids=["load_state_dict", "copy_"]
)
@pytest.mark.parametrize("steps", [0, 1, 2, 3, 4])
def test_written_weights_are_what_the_next_call_trains_from(steps, write, wrap, no_hang):
    model, _ = wrap(mlp(), devices=DEVICES, model_run_config=CONFIG)
    optimizer = sgd(model.optim_parameters())
    run_async_steps(model, optimizer, range(steps), no_hang)
    weights = random_weights()
    write(model, weights, no_hang)

    loss = no_hang(train_call, model, 10)
    no_hang(model.step, step_fn(optimizer), is_async=False)
    no_hang(model.synchronize)

    expected = mlp()
    expected.load_state_dict(weights)
    x, y = batch(seed=10)
    want = reference_loss_and_grads(expected, x, y, NUM_MICROBATCH)
    step_fn(sgd(expected.parameters()))()
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)
    assert_weights_close(model.model, expected)


@pytest.mark.parametrize("steps", [1, 2, 3, 4])
def test_written_weights_become_the_masters(steps, wrap, no_hang):
    model, _ = wrap(mlp(), devices=DEVICES, model_run_config=CONFIG)
    optimizer = sgd(model.optim_parameters())
    run_async_steps(model, optimizer, range(steps), no_hang)
    weights = random_weights()
    no_hang(model.load_state_dict, weights)
    for name, master in model.optim_named_parameters():
        torch.testing.assert_close(master.detach(), weights[name], atol=0, rtol=0, msg=named(name))


# -- what synchronize() shows and what runs after it ----------------------------------


@pytest.mark.parametrize("steps", [1, 2, 3, 4])
def test_state_dict_after_async_steps_holds_the_newest_weights(steps, wrap, no_hang):
    model, reference = wrap(mlp(), devices=DEVICES, model_run_config=CONFIG)
    optimizer = sgd(model.optim_parameters())
    run_async_steps(model, optimizer, range(steps), no_hang)
    state = no_hang(model.state_dict)
    expected, _ = train_with_versions(reference, list(range(steps)), sgd, one_step_stale)
    for name, want in expected.state_dict().items():
        torch.testing.assert_close(state[name], want, atol=1e-5, rtol=1e-5, msg=named(name))


@pytest.mark.parametrize("steps", [1, 2, 3, 4])
def test_inference_after_synchronize_runs_the_weights_state_dict_shows(steps, wrap, no_hang):
    model, _ = wrap(mlp(), devices=DEVICES, model_run_config=CONFIG)
    optimizer = sgd(model.optim_parameters())
    run_async_steps(model, optimizer, range(steps), no_hang)
    no_hang(model.synchronize)
    plain = mlp()
    plain.load_state_dict(no_hang(model.state_dict))
    x, _ = batch(seed=20)

    def infer() -> torch.Tensor:
        with torch.no_grad():  # grad mode is per thread: enter it on the calling one
            return model(x)

    got = no_hang(infer)
    with torch.no_grad():
        want = plain(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def sync_points() -> list:
    return [
        pytest.param(k, action, id=f"{action}-after-step-{k}")
        for k in (1, 2, 3)
        for action in ("synchronize", "state_dict")
    ]


TOTAL_STEPS = 6


def train_with_a_sync_point(model: RoundPipe, optimizer, sync_after: int, action: str, no_hang):
    for i in range(TOTAL_STEPS):
        no_hang(train_call, model, i)
        no_hang(model.step, step_fn(optimizer), is_async=True)
        if i + 1 == sync_after:
            no_hang(getattr(model, action))
    no_hang(model.synchronize)


@pytest.mark.parametrize("sync_after, action", sync_points())
def test_training_after_a_sync_point_continues_from_the_newest_weights(
    sync_after, action, wrap, no_hang
):
    """PyTorch oracle: the call right after the sync point uses ``v_k``, not ``v_{k-1}``."""
    model, reference = wrap(mlp(), devices=DEVICES, model_run_config=CONFIG)
    optimizer = adam(model.optim_parameters())
    train_with_a_sync_point(model, optimizer, sync_after, action, no_hang)

    def version_of_call(i: int) -> int:
        return i if i == sync_after else one_step_stale(i)

    expected, _ = train_with_versions(reference, list(range(TOTAL_STEPS)), adam, version_of_call)
    assert_weights_close(model.model, expected)


@pytest.mark.parametrize("sync_after, action", sync_points())
def test_sync_point_continues_exactly_like_save_and_resume(sync_after, action, wrap, no_hang):
    run_a, initial = wrap(mlp(), devices=DEVICES, model_run_config=CONFIG)
    train_with_a_sync_point(run_a, adam(run_a.optim_parameters()), sync_after, action, no_hang)

    saved, _ = wrap(copy.deepcopy(initial), devices=DEVICES, model_run_config=CONFIG)
    saved_optimizer = adam(saved.optim_parameters())
    run_async_steps(saved, saved_optimizer, range(sync_after), no_hang)
    model_state = copy.deepcopy(no_hang(saved.state_dict))
    optimizer_state = copy.deepcopy(saved_optimizer.state_dict())

    resumed, _ = wrap(copy.deepcopy(initial), devices=DEVICES, model_run_config=CONFIG)
    no_hang(resumed.load_state_dict, model_state)
    resumed_optimizer = adam(resumed.optim_parameters())
    resumed_optimizer.load_state_dict(optimizer_state)
    run_async_steps(resumed, resumed_optimizer, range(sync_after, TOTAL_STEPS), no_hang)
    no_hang(resumed.synchronize)

    assert_weights_close(run_a.model, resumed.model, atol=1e-6)


def test_sync_point_changes_the_trained_weights():
    """Guards the two tests above: a sync point really changes which weights calls use."""
    reference = mlp()
    seeds = list(range(TOTAL_STEPS))
    stale, _ = train_with_versions(reference, seeds, adam, one_step_stale)
    synced, _ = train_with_versions(
        reference, seeds, adam, lambda i: i if i == 2 else one_step_stale(i)
    )
    assert not torch.allclose(stale[0].weight, synced[0].weight, atol=1e-4)


# -- a failing step_fn on a bf16 model ------------------------------------------------


def bf16_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)).to(torch.bfloat16)


def bf16_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(seed=seed)
    return x.to(torch.bfloat16), y.to(torch.bfloat16)


class FailingStep:
    """``optimizer.step()`` then raise; snapshots the masters and gradients it started from."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.masters: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []

    def __call__(self) -> None:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.masters = [p.detach().clone() for p in params]
        self.grads = [p.grad.detach().clone() for p in params]
        self.optimizer.step()
        raise ValueError("injected fault in step_fn")

    def expected_masters(self) -> list[torch.Tensor]:
        """One fp32 SGD step from the snapshot: what the masters hold after the failed step."""
        params = [nn.Parameter(m.clone()) for m in self.masters]
        for p, g in zip(params, self.grads, strict=True):
            p.grad = g.clone()
        sgd(params).step()
        return [p.detach() for p in params]


def fail_step_synchronously(model: RoundPipe, step: FailingStep, error_of) -> BaseException:
    return error_of(model.step, step, is_async=False)


def fail_step_asynchronously(model: RoundPipe, step: FailingStep, error_of) -> BaseException:
    model.step(step, is_async=True)
    return error_of(model.synchronize)


@pytest.fixture
def failed_bf16_step(wrap, no_hang, error_of):
    """``failed_bf16_step(fail)``: a bf16 model after one good step, one call, a failed step."""

    def run(fail) -> tuple[RoundPipe, FailingStep]:
        model, _ = wrap(
            bf16_model(),
            devices="emulated:2",
            model_run_config=RoundPipeRunConfig(num_microbatch=NUM_MICROBATCH),
        )
        masters = list(model.optim_parameters())
        assert all(m.dtype == torch.float32 for m in masters)
        optimizer = sgd(masters)
        for seed in (1, 2):
            x, y = bf16_batch(seed)
            no_hang(model.forward_backward, (x,), label=y, loss_fn=mse_sum)
            if seed == 1:
                no_hang(model.step, step_fn(optimizer), is_async=False)
        step = FailingStep(optimizer)
        error = fail(model, step, error_of)
        assert "injected fault in step_fn" in str(error)
        return model, step

    return run


FAILURES = [
    pytest.param(fail_step_synchronously, id="sync"),
    pytest.param(fail_step_asynchronously, id="async"),
]


@pytest.mark.parametrize("fail", FAILURES)
def test_failing_step_fn_leaves_the_fp32_masters_as_it_left_them(fail, failed_bf16_step):
    model, step = failed_bf16_step(fail)
    expected = step.expected_masters()
    rounded = [e.to(torch.bfloat16).float() for e in expected]
    assert any(not torch.equal(e, r) for e, r in zip(expected, rounded, strict=True)), (
        "the fp32 update is representable in bf16; the test could not see a rounding"
    )
    for (name, master), want in zip(model.optim_named_parameters(), expected, strict=True):
        torch.testing.assert_close(master.detach(), want, atol=0, rtol=0, msg=named(name))


@pytest.mark.parametrize("fail", FAILURES)
def test_calls_after_a_failing_step_fn_use_its_masters(fail, failed_bf16_step, no_hang):
    model, step = failed_bf16_step(fail)
    no_hang(model.synchronize)
    expected = [e.to(torch.bfloat16) for e in step.expected_masters()]
    for (name, param), want in zip(model.model.named_parameters(), expected, strict=True):
        torch.testing.assert_close(param.detach(), want, atol=0, rtol=0, msg=named(name))

    plain = bf16_model()
    with torch.no_grad():
        for param, want in zip(plain.parameters(), expected, strict=True):
            param.copy_(want)
    x, _ = bf16_batch(30)

    def infer() -> torch.Tensor:
        with torch.no_grad():
            return model(x)

    got = no_hang(infer)
    with torch.no_grad():
        want = torch.cat([plain(xm) for xm in torch.tensor_split(x, NUM_MICROBATCH)])
    torch.testing.assert_close(got, want, atol=0, rtol=0)  # the same bf16 ops on each side
