"""Full training-state checkpoints: a run resumed from one continues bit for bit."""

from __future__ import annotations

import json
import os

import pytest
import torch
from support.oracle import batch, mse_sum
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig

CONFIG = RoundPipeRunConfig(num_microbatch=3, execute_plan="3,3|2,2,1,3")


def mlp8(seed: int) -> nn.Sequential:
    # No dropout: these tests check the state a checkpoint restores, not random draws
    # (tests/runtime/test_dropout_determinism.py resumes a model with dropout).
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
        nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 4),
    )  # fmt: skip


def trainer(pipe):
    optimizer = torch.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)

    def update() -> None:
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()

    return optimizer, scheduler, update


def train(pipe, update, seeds, is_async, dtype=torch.float32):
    for seed in seeds:
        x, y = (t.to(dtype) for t in batch(seed))
        pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
        pipe.step(update, is_async=is_async)


@pytest.mark.parametrize("is_async", [False, True])
def test_a_resumed_run_continues_bit_for_bit(tmp_path, is_async):
    path = tmp_path / "ckpt"
    with RoundPipe(mlp8(0), devices="emulated:3", model_run_config=CONFIG) as pipe:
        optimizer, scheduler, update = trainer(pipe)
        train(pipe, update, range(3), is_async)
        x, y = batch(99)
        pipe.forward_backward((x,), label=y, loss_fn=mse_sum)  # gradients not stepped yet
        pipe.save_checkpoint(path, optimizer, scheduler, extra={"batches_seen": 4})
        pipe.step(update, is_async=is_async)
        train(pipe, update, range(4, 7), is_async)
        pipe.synchronize()
        want = [p.detach().clone() for p in pipe.model.parameters()]

    # another initialisation, another RNG stream: everything must come from the checkpoint
    torch.manual_seed(1234)
    with RoundPipe(mlp8(7), devices="emulated:3", model_run_config=CONFIG) as pipe:
        optimizer, scheduler, update = trainer(pipe)
        assert pipe.load_checkpoint(path, optimizer, scheduler) == {"batches_seen": 4}
        pipe.step(update, is_async=is_async)
        train(pipe, update, range(4, 7), is_async)
        pipe.synchronize()
        got = [p.detach() for p in pipe.model.parameters()]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_bf16_weights_resume_from_their_fp32_masters(tmp_path):
    model = mlp8(0).to(torch.bfloat16)
    with RoundPipe(model, devices="emulated:2", model_run_config=CONFIG) as pipe:
        optimizer, scheduler, update = trainer(pipe)
        train(pipe, update, range(2), is_async=False, dtype=torch.bfloat16)
        pipe.save_checkpoint(tmp_path / "c", optimizer, scheduler)
        masters = [m.detach().clone() for m in pipe.optim_parameters()]
    with RoundPipe(mlp8(3).bfloat16(), devices="emulated:2", model_run_config=CONFIG) as pipe:
        optimizer, scheduler, _ = trainer(pipe)
        pipe.load_checkpoint(tmp_path / "c", optimizer, scheduler)
        for a, b in zip(pipe.optim_parameters(), masters, strict=True):
            assert a.dtype == torch.float32 and torch.equal(a, b)  # not rounded through bf16


def test_saving_is_atomic_and_a_swap_cut_short_falls_back_to_the_old_copy(tmp_path):
    path = tmp_path / "ckpt"
    with RoundPipe(mlp8(0), devices="emulated:2", model_run_config=CONFIG) as pipe:
        optimizer, scheduler, update = trainer(pipe)
        pipe.save_checkpoint(path, optimizer, extra=1)
        train(pipe, update, range(1), is_async=False)
        pipe.save_checkpoint(path, optimizer, extra=2)  # replaces the first one
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
        assert json.loads((path / "state.json").read_text())["extra"] == 2
        path.rename(tmp_path / "ckpt.old")  # killed between the swap's two renames
        assert pipe.load_checkpoint(path, optimizer) == 2
        with pytest.raises(FileNotFoundError, match="no checkpoint"):
            pipe.load_checkpoint(tmp_path / "nothing")


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    with RoundPipe(mlp8(0), devices="emulated:2", model_run_config=CONFIG) as pipe:
        pipe.save_checkpoint(tmp_path / "c")
    other = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 4))
    with (
        RoundPipe(other, devices="emulated:1") as pipe,
        pytest.raises(ValueError, match="not a checkpoint of this model"),
    ):
        pipe.load_checkpoint(tmp_path / "c")


@pytest.mark.parametrize("delay", [0.05, 0.2, 0.4])
def test_a_save_killed_with_sigkill_leaves_a_loadable_checkpoint(tmp_path, delay):
    import signal
    import time

    from support.children.harness import CHILDREN, start_child

    path = tmp_path / "ckpt"
    child = start_child([os.path.join(CHILDREN, "save_forever.py"), str(path)])
    try:
        assert child.stdout.readline().strip() == "SAVED 1", child.stderr.read()
        time.sleep(delay)  # somewhere in the middle of a later save
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=60)
    torch.manual_seed(3)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])
    with RoundPipe(model, devices="emulated:2") as pipe:
        optimizer = torch.optim.AdamW(pipe.optim_parameters())
        extra = pipe.load_checkpoint(path, optimizer)
        assert isinstance(extra, int) and extra >= 1
        for master, param in zip(pipe.optim_parameters(), model.parameters(), strict=True):
            assert torch.equal(master, param.detach())  # a complete, consistent checkpoint


def test_an_extra_json_cannot_hold_is_refused_and_the_old_checkpoint_kept(tmp_path):
    path = tmp_path / "ckpt"
    with RoundPipe(mlp8(0), devices="emulated:2", model_run_config=CONFIG) as pipe:
        pipe.save_checkpoint(path, extra="first")
        with pytest.raises(TypeError, match="JSON"):
            pipe.save_checkpoint(path, extra={"a set": {1, 2}})
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # nothing left over
        assert pipe.load_checkpoint(path) == "first"
