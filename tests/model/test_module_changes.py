"""Changes the user makes to the wrapped model between calls count, as in PyTorch.

Each test changes the model between two training steps and compares with plain PyTorch
making the same change; a change RoundPipe cannot honour (new parameters under an
optimizer built on the old masters, a changed layer list) is refused with an error
naming it, and the model stays usable.
"""

from __future__ import annotations

import copy

import pytest
import torch
from support.oracle import batch, mse_sum, weighted_microbatches
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig

MICROBATCHES = 3


class Scale(nn.Module):
    """Multiplies by ``factor``, a plain attribute."""

    def __init__(self, factor: float = 1.0) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class Block(nn.Module):
    """A linear layer and an activation submodule."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = nn.LeakyReLU(0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), Block(16), Scale(), Block(16), nn.Linear(16, 4))


def pytorch_step(reference: nn.Module, x, y, lr: float = 0.05) -> torch.Tensor:
    loss = sum(
        mse_sum(reference(xm), ym) * weight
        for xm, ym, weight in weighted_microbatches(x, y, MICROBATCHES)
    )
    loss.backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= lr * p.grad
            p.grad = None
    return loss.detach()


def roundpipe_step(pipe: RoundPipe, x, y, lr: float = 0.05) -> torch.Tensor:
    optimizer = torch.optim.SGD(pipe.optim_parameters(), lr=lr)
    loss = pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
    pipe.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=False)
    return loss


def wrap(net: nn.Module) -> RoundPipe:
    config = RoundPipeRunConfig(num_microbatch=MICROBATCHES)
    return RoundPipe(net, devices="emulated:2", model_run_config=config)


def assert_same_training(change) -> None:
    """One step, ``change(model)`` on both, two more steps: losses and weights agree."""
    reference = model()
    wrapped = copy.deepcopy(reference)
    x, y = batch(size=12, inputs=8, outputs=4)
    with wrap(wrapped) as pipe:
        losses = [roundpipe_step(pipe, x, y)]
        expected = [pytorch_step(reference, x, y)]
        change(wrapped)
        change(reference)
        for _ in range(2):
            losses.append(roundpipe_step(pipe, x, y))
            expected.append(pytorch_step(reference, x, y))
        pipe.synchronize()
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected))
    for (name, got), want in zip(wrapped.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, msg=name)


def test_a_forward_hook_registered_after_the_first_call_fires() -> None:
    assert_same_training(lambda net: net[1].register_forward_hook(lambda m, i, out: out * 2))


def test_a_forward_pre_hook_registered_on_a_submodule_after_the_first_call_fires() -> None:
    assert_same_training(lambda net: net[3].act.register_forward_pre_hook(lambda m, i: i[0] + 1))


def test_a_removed_hook_stops_firing() -> None:
    handles = []

    def hook_then_remove(net: nn.Module) -> None:
        handles.append(net[1].register_forward_hook(lambda m, i, out: out * 3))

    reference, wrapped = model(), None
    wrapped = copy.deepcopy(reference)
    x, y = batch(size=12, inputs=8, outputs=4)
    with wrap(wrapped) as pipe:
        hook_then_remove(wrapped)
        hook_then_remove(reference)
        losses = [roundpipe_step(pipe, x, y)]
        expected = [pytorch_step(reference, x, y)]
        for handle in handles:
            handle.remove()
        losses.append(roundpipe_step(pipe, x, y))
        expected.append(pytorch_step(reference, x, y))
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected))


def test_a_plain_attribute_set_between_calls_takes_effect() -> None:
    def change(net: nn.Module) -> None:
        net[2].factor = 0.5

    assert_same_training(change)


def test_an_attribute_of_a_builtin_submodule_set_between_calls_takes_effect() -> None:
    def change(net: nn.Module) -> None:
        net[3].act.negative_slope = 0.3

    assert_same_training(change)


def test_a_submodule_without_parameters_replaced_between_calls_is_run() -> None:
    def change(net: nn.Module) -> None:
        net[1].act = nn.Tanh()

    assert_same_training(change)


def assert_refused_then_usable(change, undo, match: str) -> None:
    """After a step, ``change(model)`` makes the next call raise matching ``match``;
    after ``undo(model)`` the model trains on."""
    wrapped = model()
    x, y = batch(size=12, inputs=8, outputs=4)
    with wrap(wrapped) as pipe:
        roundpipe_step(pipe, x, y)
        undo_state = change(wrapped)
        with pytest.raises(RuntimeError, match=match):
            pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
        undo(wrapped, undo_state)
        roundpipe_step(pipe, x, y)


def test_a_parameter_replaced_by_a_new_one_is_refused_naming_it() -> None:
    def replace(net: nn.Module) -> nn.Parameter:
        old = net[1].fc.weight
        net[1].fc.weight = nn.Parameter(old.detach().clone())
        return old

    def put_back(net: nn.Module, old: nn.Parameter) -> None:
        net[1].fc.weight = old

    assert_refused_then_usable(replace, put_back, r"1\.fc\.weight.*replaced")


def test_a_layer_appended_to_the_sequential_is_refused_naming_it() -> None:
    def remove(net: nn.Module, _) -> None:
        del net[5]

    assert_refused_then_usable(
        lambda net: net.append(nn.Identity()), remove, r"nn\.Sequential.*entry '5'.*added"
    )


def test_a_layer_replaced_in_the_sequential_is_refused_naming_it() -> None:
    def replace(net: nn.Module) -> nn.Module:
        original, net[2] = net[2], Scale(3.0)
        return original

    def put_back(net: nn.Module, original: nn.Module) -> None:
        net[2] = original

    assert_refused_then_usable(replace, put_back, r"entry '2'.*replaced")


def test_a_module_change_between_model_x_and_its_backward_is_refused() -> None:
    wrapped = model()
    x, y = batch(size=12, inputs=8, outputs=4)
    with wrap(wrapped) as pipe:
        out = pipe(x)
        wrapped[2].factor = 2.0
        with pytest.raises(RuntimeError, match="modules changed"):
            mse_sum(out, y).backward()


def test_an_unchanged_model_is_never_copied_again_even_when_switching_train_and_eval() -> None:
    wrapped = model()
    x, y = batch(size=12, inputs=8, outputs=4)
    with wrap(wrapped) as pipe:
        for _ in range(3):
            roundpipe_step(pipe, x, y)
            pipe.eval()
            with torch.no_grad():
                pipe(x)
            pipe.train()
        assert pipe.runtime.session.ledger.layer_changes == 0


@pytest.mark.parametrize("lora", [False, True])
def test_a_hugging_face_model_is_never_copied_again_between_calls(lora: bool) -> None:
    transformers = pytest.importorskip("transformers")
    import roundpipe

    config = transformers.Qwen3Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(config)
    if lora:
        peft = pytest.importorskip("peft")
        hf = peft.get_peft_model(hf, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    ids = torch.randint(0, 64, (4, 6), generator=torch.Generator().manual_seed(0))
    batch_kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    with roundpipe.from_hf(hf, devices="emulated:2") as pipe:
        optimizer = torch.optim.SGD(pipe.optim_parameters(), lr=0.01)
        for _ in range(3):
            pipe.forward_backward(input_kwargs=batch_kwargs)
            pipe.step(lambda: (optimizer.step(), optimizer.zero_grad()))
        pipe.synchronize()
        assert pipe.runtime.session.ledger.layer_changes == 0
