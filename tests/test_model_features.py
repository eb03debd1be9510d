"""Model features: dropout under recompute, tied/frozen parameters, buffers, rich layer I/O,
inference, weight loading and several models in one process."""

from __future__ import annotations

import copy

import pytest
import torch
from support.oracle import assert_grads_close, batch, mlp, mse_sum, reference_loss_and_grads
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig


def pipe_on(model: nn.Module, devices: int, **config) -> RoundPipe:
    """``model`` wrapped on ``devices`` emulated devices with the given run config."""
    return RoundPipe(
        model, devices=f"emulated:{devices}", model_run_config=RoundPipeRunConfig(**config)
    )


class RecordingDropout(nn.Module):
    """Dropout that logs its masks: by phase (no-grad forward vs grad-enabled run)."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        self.p = p
        self.log: dict[str, list[torch.Tensor]] = {"forward": [], "grad": []}

    def forward(self, x):
        mask = (torch.rand_like(x) > self.p).to(x.dtype) / (1 - self.p)
        self.log["grad" if torch.is_grad_enabled() else "forward"].append(mask)
        return x * mask


class ReplayDropout(nn.Module):
    def __init__(self, masks: list[torch.Tensor]) -> None:
        super().__init__()
        self.masks = list(masks)

    def forward(self, x):
        return x * self.masks.pop(0)


def dropout_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), RecordingDropout(), nn.Linear(16, 16), RecordingDropout(),
        nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4),
    )  # fmt: skip


def shared_dropout_logs(model):
    return [m.log for m in model if isinstance(m, RecordingDropout)]


def run_dropout(devices, grain, preserve, shells_of):
    model = dropout_model()
    reference = copy.deepcopy(model)
    x, y = batch()
    config = RoundPipeRunConfig(
        num_microbatch=3, recompute_grain=grain, preserve_rng_state=preserve,
        execute_plan="2,2|3,1,1,1,1",
    )  # fmt: skip
    wrapped = RoundPipe(model, devices=f"emulated:{devices}", model_run_config=config)
    wrapped.forward_backward((x,), label=y, loss_fn=mse_sum)
    wrapped.synchronize()
    logs = shells_of(wrapped)
    wrapped.close()
    return model, reference, x, y, logs


def collect_logs(wrapped):
    """Masks drawn by the per-device copies of each dropout layer, merged by phase."""
    merged = []
    for index, layer in enumerate(wrapped._layers):
        if not isinstance(layer.module, RecordingDropout):
            continue
        log = {"forward": [], "grad": []}
        for shell in layer._shells.values():
            for phase in log:
                log[phase] += shell.log[phase]
        merged.append((index, log))
    return merged


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_recompute_draws_the_same_dropout_masks_as_the_forward(grain):
    *_, logs = run_dropout(3, grain, True, collect_logs)
    for _, log in logs:
        assert len(log["forward"]) == len(log["grad"]) == 3
        for drawn, redrawn in zip(log["forward"], log["grad"], strict=True):
            assert torch.equal(drawn, redrawn)


def test_without_rng_preservation_masks_differ():
    """Guards the test above: recompute really does redraw masks."""
    *_, logs = run_dropout(3, "stage", False, collect_logs)
    assert any(
        not torch.equal(a, b)
        for _, log in logs
        for a, b in zip(log["forward"], log["grad"], strict=False)
    )


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_dropout_gradients_are_the_gradients_of_the_computed_forward(grain):
    model, reference, x, y, logs = run_dropout(2, grain, True, collect_logs)
    for index, log in logs:
        reference[index] = ReplayDropout(log["forward"])
    reference_loss_and_grads(reference, x, y, 3)
    assert_grads_close(model, reference)


class TiedEnds(nn.Module):
    """Embedding and output projection sharing one weight, on different stages."""

    def __init__(self, weight: nn.Parameter, first: bool) -> None:
        super().__init__()
        self.weight = weight
        self.first = first

    def forward(self, x):
        return x @ (self.weight if self.first else self.weight.t())


def tied_model():
    torch.manual_seed(0)
    shared = nn.Parameter(torch.randn(8, 16) * 0.3)
    return nn.Sequential(
        TiedEnds(shared, True), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), TiedEnds(shared, False)
    )


def test_a_weight_tied_across_stages_gets_the_summed_gradient():
    model = tied_model()
    reference = copy.deepcopy(model)
    x, _ = batch()
    y = torch.randn(13, 8)
    config = RoundPipeRunConfig(num_microbatch=3, execute_plan="2,2|1,1,1,1,1")
    with RoundPipe(model, devices="emulated:3", model_run_config=config) as wrapped:
        wrapped.forward_backward((x,), label=y, loss_fn=mse_sum)
        wrapped.synchronize()
        assert len(list(wrapped.optim_parameters())) == 3  # shared weight counted once
    reference_loss_and_grads(reference, x, y, 3)
    assert_grads_close(model, reference)


def test_frozen_parameters_get_no_master_copy_and_no_gradient():
    model = mlp()
    for p in model[0].parameters():
        p.requires_grad_(False)
    reference = copy.deepcopy(model)
    x, y = batch()
    with pipe_on(model, devices=2, num_microbatch=3) as wrapped:
        trainable = sum(p.requires_grad for p in model.parameters())
        assert len(list(wrapped.optim_parameters())) == trainable
        optimizer = torch.optim.SGD(wrapped.optim_parameters(), lr=0.1)
        frozen_before = model[0].weight.detach().clone()
        wrapped.forward_backward((x,), label=y, loss_fn=mse_sum)
        wrapped.synchronize()
        assert model[0].weight.grad is None
        reference_loss_and_grads(reference, x, y, 3)
        assert_grads_close(model, reference)
        wrapped.step(optimizer.step, is_async=False)
        wrapped.synchronize()
        assert torch.equal(model[0].weight, frozen_before)


def bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))


@pytest.mark.parametrize("plan", ["1,1|2,1,1", "3|1,1,1,1", "|4"])
def test_buffers_end_as_after_running_the_microbatches_in_order(plan):
    model = bn_model()
    reference = copy.deepcopy(model)
    config = RoundPipeRunConfig(num_microbatch=3, execute_plan=plan)
    with RoundPipe(model, devices="emulated:2", model_run_config=config) as wrapped:
        for seed in (1, 2):
            x, y = batch(seed)
            wrapped.forward_backward((x,), label=y, loss_fn=mse_sum)
            reference_loss_and_grads(reference, x, y, 3)
        wrapped.synchronize()
        assert_grads_close(model, reference)
    bn, bn_ref = model[1], reference[1]
    torch.testing.assert_close(bn.running_mean, bn_ref.running_mean)
    torch.testing.assert_close(bn.running_var, bn_ref.running_var)
    assert bn.num_batches_tracked.item() == bn_ref.num_batches_tracked.item() == 6


class Splitter(nn.Module):
    """Returns a dict with a tensor, a non-tensor value and an integer tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 16)

    def forward(self, x, scale=1.0):
        h = self.proj(x) * scale
        return {"hidden": h, "skip": h.tanh(), "tag": "mb", "ids": torch.arange(len(x))}


class Joiner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, state):
        assert state["tag"] == "mb" and state["ids"].dtype == torch.int64
        return (self.proj(state["hidden"]), state["skip"])


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 4)

    def forward(self, pair):
        hidden, skip = pair
        return self.proj(hidden + skip)


def rich_model():
    torch.manual_seed(0)
    return nn.Sequential(Splitter(), Joiner(), Head())


@pytest.mark.parametrize("plan", ["1,1|1,1,1", "2|1,2", "1|2,1"])
def test_layers_pass_dicts_tuples_and_non_tensors_with_gradients_across_stages(plan):
    model = rich_model()
    reference = copy.deepcopy(model)
    x, y = batch()
    config = RoundPipeRunConfig(num_microbatch=3, execute_plan=plan)
    with RoundPipe(model, devices="emulated:3", model_run_config=config) as wrapped:
        loss = wrapped.forward_backward((x,), {"scale": 0.5}, label=y, loss_fn=mse_sum)
        wrapped.synchronize()
    total = torch.zeros(())
    for xm, ym in zip(torch.tensor_split(x, 3), torch.tensor_split(y, 3), strict=False):
        out = reference[2](reference[1](reference[0](xm, scale=0.5)))
        step = mse_sum(out, ym)
        step.backward()
        total += step.detach()
    torch.testing.assert_close(loss, total)
    assert_grads_close(model, reference)


def test_inference_matches_the_plain_model():
    model = mlp()
    reference = copy.deepcopy(model)
    x, _ = batch()
    with RoundPipe(model, devices="emulated:3") as wrapped, torch.no_grad():
        torch.testing.assert_close(wrapped(x), reference(x))


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_backward_through_a_plain_forward_gives_pytorch_gradients(grain):
    model = mlp()
    reference = copy.deepcopy(model)
    x, y = batch()
    config = RoundPipeRunConfig(num_microbatch=4, recompute_grain=grain)
    with RoundPipe(model, devices="emulated:3", model_run_config=config) as wrapped:
        loss = mse_sum(wrapped(x), y)
        loss.backward()
        wrapped.synchronize()
    want = mse_sum(reference(x), y)
    want.backward()
    torch.testing.assert_close(loss, want)
    assert_grads_close(model, reference)


def test_two_plain_forwards_then_one_backward_accumulate_both():
    model = mlp()
    reference = copy.deepcopy(model)
    (x1, y1), (x2, y2) = batch(1), batch(2)
    with pipe_on(model, devices=2, num_microbatch=3) as wrapped:
        total = mse_sum(wrapped(x1), y1) + 0.5 * mse_sum(wrapped(x2), y2)
        total.backward()
        wrapped.synchronize()
    (mse_sum(reference(x1), y1) + 0.5 * mse_sum(reference(x2), y2)).backward()
    assert_grads_close(model, reference)


def test_a_step_between_a_plain_forward_and_its_backward_raises_like_pytorch():
    # PyTorch refuses a backward through weights modified in place since the forward.
    x, y = batch()
    with pipe_on(mlp(), devices=2, num_microbatch=3) as wrapped:
        optimizer = torch.optim.SGD(wrapped.optim_parameters(), lr=0.1)
        mse_sum(wrapped(x), y).backward()
        loss = mse_sum(wrapped(x), y)
        wrapped.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=False)
        with pytest.raises(RuntimeError, match="between model\\(x\\) and .backward"):
            loss.backward()
        mse_sum(wrapped(x), y).backward()  # the model goes on
        wrapped.synchronize()


def test_backward_through_a_plain_forward_with_dropout_uses_the_forward_masks():
    model = dropout_model()
    reference = copy.deepcopy(model)
    x, y = batch()
    with pipe_on(model, devices=2, num_microbatch=3) as wrapped:
        mse_sum(wrapped(x), y).backward()
        wrapped.synchronize()
        logs = collect_logs(wrapped)
    for index, log in logs:
        assert all(torch.equal(a, b) for a, b in zip(log["forward"], log["grad"], strict=True))
        reference[index] = ReplayDropout(log["forward"])
    reference_loss_and_grads(reference, x, y, 3)
    assert_grads_close(model, reference)


def test_forward_backward_can_return_merged_outputs():
    model = mlp()
    reference = copy.deepcopy(model)
    x, y = batch()
    with pipe_on(model, devices=2, num_microbatch=4) as wrapped:
        _, outputs = wrapped.forward_backward((x,), label=y, loss_fn=mse_sum, return_outputs=True)
    torch.testing.assert_close(outputs, reference(x).detach())


def test_weights_loaded_after_the_optimizer_exists_are_used_and_kept():
    x, y = batch()
    source = mlp(seed=5)
    with RoundPipe(
        mlp(seed=0), devices="emulated:2", model_run_config=RoundPipeRunConfig(num_microbatch=3)
    ) as wrapped:
        optimizer = torch.optim.SGD(wrapped.optim_parameters(), lr=0.1)
        wrapped.load_state_dict(source.state_dict())
        for master, want in zip(wrapped.optim_parameters(), source.parameters(), strict=True):
            torch.testing.assert_close(master.detach(), want.detach())
        wrapped.forward_backward((x,), label=y, loss_fn=mse_sum)
        wrapped.step(optimizer.step, is_async=False)
        wrapped.synchronize()
        reference = copy.deepcopy(source)
        reference_loss_and_grads(reference, x, y, 3)
        with torch.no_grad():
            for p in reference.parameters():
                p -= 0.1 * p.grad
        for got, want in zip(wrapped.model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(got.detach(), want.detach())


def test_in_place_writes_to_model_weights_are_adopted():
    x, y = batch()
    model = mlp()
    with pipe_on(model, devices=2, num_microbatch=3) as wrapped:
        list(wrapped.optim_parameters())  # masters exist
        with torch.no_grad():
            model[0].weight.mul_(2.0)
        reference = copy.deepcopy(model)
        wrapped.forward_backward((x,), label=y, loss_fn=mse_sum)
        wrapped.synchronize()
        reference_loss_and_grads(reference, x, y, 3)
        assert_grads_close(model, reference)
        torch.testing.assert_close(
            next(wrapped.optim_parameters()).detach(), model[0].weight.detach()
        )


def test_optimizer_context_yields_master_parameters():
    with RoundPipe(mlp(), devices="emulated:2") as wrapped:
        masters = list(wrapped.optim_parameters())
        with wrapped.OptimizerCtx():
            inside = list(wrapped.parameters())
        outside = list(wrapped.parameters())
    assert [id(p) for p in inside] == [id(p) for p in masters]
    assert all(a is not b for a, b in zip(inside, outside, strict=False))
    assert all(p.dtype == torch.float32 for p in masters)


def test_half_precision_model_gets_fp32_master_weights():
    model = mlp().to(torch.bfloat16)
    with RoundPipe(model, devices="emulated:2") as wrapped:
        assert all(p.dtype == torch.float32 for p in wrapped.optim_parameters())


def test_two_models_in_one_process_train_independently():
    x, y = batch()
    a_model, b_model = mlp(seed=1), mlp(seed=2)
    a_ref, b_ref = copy.deepcopy(a_model), copy.deepcopy(b_model)
    config = RoundPipeRunConfig(num_microbatch=3)
    with (
        RoundPipe(a_model, devices="emulated:2", model_run_config=config) as a,
        RoundPipe(b_model, devices="emulated:3", model_run_config=config) as b,
    ):
        a.forward_backward((x,), label=y, loss_fn=mse_sum)
        b.forward_backward((x * 2,), label=y, loss_fn=mse_sum)
        a.forward_backward((x,), label=y, loss_fn=mse_sum)
        a.synchronize()
        b.synchronize()
    for _ in range(2):
        reference_loss_and_grads(a_ref, x, y, 3)
    reference_loss_and_grads(b_ref, x * 2, y, 3)
    assert_grads_close(a_model, a_ref)
    assert_grads_close(b_model, b_ref)


def test_synchronize_never_drops_pending_gradients():
    x, y = batch()
    model = mlp()
    reference = copy.deepcopy(model)
    with pipe_on(model, devices=2, num_microbatch=3) as wrapped:
        wrapped.forward_backward((x,), label=y, loss_fn=mse_sum)
        wrapped.synchronize()
        wrapped.synchronize()
        wrapped.forward_backward((x,), label=y, loss_fn=mse_sum)
        wrapped.synchronize()
    for _ in range(2):
        reference_loss_and_grads(reference, x, y, 3)
    assert_grads_close(model, reference)


def test_import_starts_no_threads():
    import subprocess
    import sys

    code = (
        "import threading, roundpipe, torch; "
        "from torch import nn; "
        "n = threading.active_count(); "
        "roundpipe.RoundPipe(nn.Sequential(nn.Linear(2, 2)), devices='emulated:2'); "
        "print(n, threading.active_count())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, after = out.stdout.split()
    assert before == after == "1"
