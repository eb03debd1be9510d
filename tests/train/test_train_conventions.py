"""``roundpipe train`` follows ``transformers``' ``Trainer`` where Trainer users carry a
convention over: the learning-rate schedule (``get_scheduler``' factors, the warm-up
of ``warmup_steps`` and of a ratio), the weight decay that spares biases and norm
weights (``Trainer.get_decay_parameter_names``, ``create_optimizer``'s two groups),
and the logged ``grad_norm`` (what ``clip_grad_norm_`` returns, before clipping).

The oracles are transformers' own functions and a plain PyTorch run with Trainer's
optimizer and scheduler over the command's batches (stale by one step where the run
was asynchronous); the runs are the shared ``train_runs`` (``conftest.py``).
"""

from __future__ import annotations

import copy
import math
from dataclasses import fields

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("yaml")

from support.train_cli import metrics  # noqa: E402

from roundpipe.train.optim import (  # noqa: E402
    GradNorms,
    build_scheduler,
    decay_parameter_names,
    step_function,
    warmup_steps,
)

HF_SCHEDULES = {"linear": "linear", "cosine": "cosine", "constant": "constant_with_warmup"}


def hf_decay_names(model: nn.Module) -> set[str]:
    """``Trainer.get_decay_parameter_names`` (it reads nothing of the Trainer)."""
    return set(transformers.Trainer.get_decay_parameter_names(None, model))


def trainer_optimizer(model: nn.Module, output, weight_decay: float, lr: float):
    """The AdamW ``Trainer.create_optimizer`` builds for ``model``."""
    args = transformers.TrainingArguments(
        output_dir=str(output), learning_rate=lr, weight_decay=weight_decay, report_to="none",
        use_cpu=True, optim="adamw_torch",
    )  # fmt: skip
    return transformers.Trainer(model=model, args=args).create_optimizer()


# -- the schedule ----------------------------------------------------------------------


@pytest.mark.parametrize("schedule", sorted(HF_SCHEDULES))
@pytest.mark.parametrize("warmup", [0, 1, 5])
def test_the_learning_rate_of_each_step_is_get_schedulers(schedule, warmup):
    total = 10
    ours = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    theirs = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    ours_schedule = build_scheduler(ours, warmup, total, schedule)
    their_schedule = transformers.get_scheduler(
        HF_SCHEDULES[schedule], theirs, num_warmup_steps=warmup, num_training_steps=total
    )
    got, want = [], []
    for _ in range(total):
        got.append(ours.param_groups[0]["lr"])
        want.append(theirs.param_groups[0]["lr"])
        ours.step(), theirs.step()
        ours_schedule.step(), their_schedule.step()
    assert got == want
    assert warmup == 0 or got[0] == 0.0  # the first step of a warm-up has rate 0


@pytest.mark.parametrize("total", [7, 10, 33])
@pytest.mark.parametrize("ratio", [0.0, 0.05, 0.1, 0.25, 0.5, 0.99])  # v5: below 1
def test_a_warmup_ratio_gives_training_arguments_warmup_steps(tmp_path, total, ratio):
    names = {f.name for f in fields(transformers.TrainingArguments)}
    given = {"warmup_ratio": ratio} if "warmup_ratio" in names else {"warmup_steps": ratio}
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", **given)
    assert warmup_steps(total, 0, ratio) == args.get_warmup_steps(total)


def test_nonzero_warmup_steps_win_over_a_ratio():
    assert warmup_steps(100, 3, 0.5) == 3 and warmup_steps(100, 0, None) == 0


# -- weight decay ------------------------------------------------------------------------


class Mixed(nn.Module):
    """Every kind of parameter the rule tells apart: a LayerNorm (weight and bias),
    norms by name (``norm``, ``*_norm``, ``*layernorm*``, ``*rmsnorm*``), biases, and a
    tied weight under two names."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.ln = nn.LayerNorm(4)
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(4))
        self.proj = nn.Linear(4, 4)
        self.post_norm = nn.Module()
        self.post_norm.weight = nn.Parameter(torch.ones(4))
        self.input_layernorm = nn.Module()
        self.input_layernorm.scale = nn.Parameter(torch.ones(4))
        self.q_rmsnorm = nn.Module()
        self.q_rmsnorm.gain = nn.Parameter(torch.ones(4))
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.embed.weight
        self.normalizer = nn.Linear(4, 4)  # "norm" inside a word decays, as in Trainer


def tiny_qwen3() -> nn.Module:
    from support.train_fixtures import build_tokenizer, tiny_qwen3_config

    config = tiny_qwen3_config(len(build_tokenizer()), attention_bias=True)
    return transformers.Qwen3ForCausalLM(config)


@pytest.mark.parametrize("kind", ["mixed", "qwen3", "qwen3-lora"])
def test_weight_decay_applies_to_the_parameters_trainer_decays(kind):
    if kind == "mixed":
        model = Mixed()
    elif kind == "qwen3":
        model = tiny_qwen3()
    else:
        model = peft.get_peft_model(tiny_qwen3(), peft.LoraConfig(r=2, target_modules="all-linear"))
    want = hf_decay_names(model)
    assert decay_parameter_names(model) == want
    assert any("norm" in name for name, _ in model.named_parameters() if name not in want)


def test_the_run_groups_the_masters_as_trainer_create_optimizer_does(train_files, tmp_path):
    from roundpipe.train.loop import build_pipe
    from roundpipe.train.optim import build_optimization
    from roundpipe.train.options import resolve

    options = resolve({"model": train_files["model"], "data": train_files["text"],
                       "full": True, "output": tmp_path, "weight_decay": 0.1,
                       "devices": "emulated:1"})  # fmt: skip
    pipe, _ = build_pipe(options)
    with pipe:
        optimization = build_optimization(pipe, options, total=10, scaler=None)
        name_of = {id(p): n for n, p in pipe.optim_named_parameters()}
        got = [({name_of[id(p)] for p in g["params"]}, g["weight_decay"])
               for g in optimization.optimizer.param_groups]  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(train_files["model"])
    names = {id(p): n for n, p in model.named_parameters()}
    optimizer = trainer_optimizer(model, tmp_path / "trainer", weight_decay=0.1, lr=1e-2)
    want = [({names[id(p)] for p in g["params"]}, g["weight_decay"])
            for g in optimizer.param_groups]  # fmt: skip
    assert got == want and got[1][0]  # the norm weights are there, undecayed


def test_a_checkpoint_with_one_parameter_group_resumes_keeping_it(
    train_files, tmp_path, monkeypatch, capsys
):
    """A checkpoint written before the two groups (one AdamW group, weight decay on every
    parameter) resumes, and the run goes on as the one that wrote it would have: bit for
    bit as an uninterrupted run of then."""
    from safetensors.torch import load_file
    from support.train_cli import COMMON

    import roundpipe.train.loop as loop
    from roundpipe.cli import main
    from roundpipe.train.optim import build_optimization

    args = ["train", "--model", str(train_files["model"]), "--data", str(train_files["text"]),
            *COMMON, "--full", "--sync", "--weight-decay", "0.1", "--save-every", "1",
            "--schedule", "constant"]  # the same rates whatever the total  # fmt: skip
    old, whole = tmp_path / "old", tmp_path / "whole"
    with monkeypatch.context() as then:  # the roundpipe of one group
        then.setattr(loop, "build_optimization",
                     lambda *a, **k: build_optimization(*a, **k, grouped=False))  # fmt: skip
        assert main([*args, "--output", str(old), "--steps", "2"]) == 0
        assert main([*args, "--output", str(whole), "--steps", "3"]) == 0
    capsys.readouterr()
    assert main([*args, "--output", str(old), "--steps", "3", "--resume"]) == 0
    assert "holds one AdamW parameter group" in capsys.readouterr().out
    got, want = load_file(old / "model.safetensors"), load_file(whole / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


@pytest.mark.parametrize("groups", [2, 1])
def test_a_resumed_run_sets_its_weight_decay_on_the_decayed_group_only(groups):
    from roundpipe.train.optim import adopt_options, build_optimizer, parameter_groups

    named = [("w", nn.Parameter(torch.ones(2))), ("b.bias", nn.Parameter(torch.ones(2)))]
    if groups == 2:
        layout = parameter_groups(named, {"w"}, 0.1)
    else:  # an older roundpipe's single group
        layout = [{"params": [p for _, p in named], "weight_decay": 0.1}]
    optimizer = build_optimizer(layout, lr=1e-3)
    scheduler = build_scheduler(optimizer, 0, 10, "constant")
    adopt_options(optimizer, scheduler, lr=2e-3, weight_decay=0.2)
    decays = [g["weight_decay"] for g in optimizer.param_groups]
    assert decays == ([0.2, 0.0] if groups == 2 else [0.2])
    assert [g["lr"] for g in optimizer.param_groups] == [2e-3] * groups


# -- the gradient norm ---------------------------------------------------------------------


def test_the_norm_is_logged_without_clipping_when_grad_clip_is_0():
    model = nn.Linear(3, 2)
    model(torch.randn(4, 3)).square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    want = float(torch.cat([g.flatten() for g in grads]).norm())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scheduler = build_scheduler(optimizer, 0, 1, "constant")
    seen = {}

    def clip(max_norm):
        seen["max_norm"] = max_norm
        norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_norm)
        seen["grads"] = [p.grad.clone() for p in model.parameters()]
        return norm

    norms = GradNorms()
    step_function(optimizer, scheduler, clip, 0.0, None, norms)()
    assert norms.pop(1) == pytest.approx(want, rel=1e-6) and seen["max_norm"] == math.inf
    for got, before in zip(seen["grads"], grads, strict=True):
        assert torch.equal(got, before)  # measured, not clipped


def reference_run(output, tmp_path, stale: bool):
    """Train as the run in ``output`` did (its ``run.yaml``), in plain PyTorch with
    Trainer's optimizer and ``get_scheduler``; with ``stale`` each gradient is taken at
    the weights one step older, as asynchronous steps take it (but after a checkpoint
    or an evaluation, which wait for the step). -> losses, lrs, norms and the trained
    model."""
    from roundpipe.train.loop import build_pipe
    from roundpipe.train.options import read_config, resolve
    from roundpipe.train.preflight import prepare

    options = resolve({"output": tmp_path}, read_config(output / "run.yaml"))
    prepared = prepare(options)
    model = transformers.AutoModelForCausalLM.from_pretrained(options.model, dtype=torch.float32)
    if not options.full:
        pipe, _ = build_pipe(prepared.options)  # the initial adapter, as the run built it
        with pipe:
            initial = {k: v.detach().clone() for k, v in pipe.hf_model.state_dict().items()}
        lora = peft.LoraConfig(r=options.lora_r, lora_alpha=options.lora_alpha,
                               target_modules=options.lora_target_modules())  # fmt: skip
        model = peft.get_peft_model(model, lora)
        model.load_state_dict(initial)
    optimizer = trainer_optimizer(model, tmp_path / "trainer", options.weight_decay, options.lr)
    total = prepared.total_steps
    scheduler = transformers.get_scheduler(
        HF_SCHEDULES[options.schedule], optimizer,
        num_warmup_steps=warmup_steps(total, options.warmup_steps, options.warmup_ratio),
        num_training_steps=total,
    )  # fmt: skip
    params = [p for p in model.parameters() if p.requires_grad]
    previous = copy.deepcopy(model)
    losses, lrs, norms = [], [], []
    for step in range(total):
        at = previous if stale else model
        at.zero_grad()
        loss = at(**prepared.train_batches.batch(step)).loss
        loss.backward()
        snapshot = copy.deepcopy(model)
        for p, q in zip(model.parameters(), at.parameters(), strict=True):
            p.grad = None if q.grad is None else q.grad.clone()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, options.grad_clip or math.inf)))
        lrs.append(optimizer.param_groups[0]["lr"])
        losses.append(loss.item())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        previous = copy.deepcopy(model) if synchronizes(options, step + 1) else snapshot
    return losses, lrs, norms, model


def synchronizes(options, step: int) -> bool:
    """Whether the run waited for step ``step`` before the next call (a checkpoint or an
    evaluation there): that call then takes the newest weights."""
    due = [every for every in (options.save_every, options.eval_every) if every is not None]
    return any(step % every == 0 for every in due)


@pytest.mark.parametrize(
    "run, stale",
    [("prompt_completion", False), ("text", True)],
    ids=["sync-lora", "async-full-weight-decay"],
)
def test_a_run_logs_and_trains_as_trainer_conventions_in_plain_pytorch(
    train_runs, tmp_path, run, stale
):
    """Row N's ``lr`` and ``grad_norm`` are step N's (also with asynchronous steps, one
    step behind the loop), and the weights end as the reference's: the ``text`` run
    decays all weights but biases and norms (``weight_decay`` 0.1) after a one-step
    linear warm-up from 0."""
    losses, lrs, norms, reference = reference_run(train_runs[run], tmp_path, stale)
    records = metrics(train_runs[run])
    assert [r["loss"] for r in records] == pytest.approx(losses, rel=1e-4)
    assert [r["lr"] for r in records] == pytest.approx(lrs, rel=1e-12)
    assert [r["grad_norm"] for r in records] == pytest.approx(norms, rel=1e-4)
    if run == "text":
        trained = transformers.AutoModelForCausalLM.from_pretrained(train_runs[run])
        want = dict(reference.named_parameters())
        for name, got in trained.named_parameters():
            torch.testing.assert_close(got, want[name], rtol=1e-3, atol=1e-5, msg=name)
