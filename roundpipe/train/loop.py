"""The training run of ``roundpipe train``: build the pipe, train, evaluate, checkpoint.

Step ``k`` (1-based) trains on ``Batches.batch(k - 1)``, queues the optimizer step on
RoundPipe's host optimizer thread (asynchronous unless ``--sync``), appends its line to
``metrics.jsonl``, and evaluates and checkpoints where due. The data order, the LR
schedule and the checkpoints depend on the step number only, so a run resumed from
``checkpoints/step-N`` continues as the uninterrupted run would have (bit for bit with
``--sync``; an asynchronous run resumes as if it had synchronized at the checkpoint,
which every checkpoint save does anyway).

Ctrl-C: the first one lets the current step finish, the second abandons it; either way
a checkpoint of the steps that ran is written and :func:`train` reports the interruption.
"""

from __future__ import annotations

import shutil
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, TextIO

import torch

from .checkpoints import (
    Position,
    checkpoint_path,
    complete_checkpoints,
    extra_record,
    prune_checkpoints,
)
from .optim import (
    adopt_options,
    build_optimizer,
    build_scheduler,
    discard_gradients,
    lr_factor,
    step_function,
)
from .options import TrainOptions, UsageError, changed_options, write_run_yaml
from .preflight import Prepared
from .progress import Progress, StepReport, open_progress
from .report import METRICS_FILE, PLOT_FILE, MetricsLog, plot_losses

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Outcome:
    """How a run ended: after ``steps`` steps, finished or interrupted by Ctrl-C."""

    steps: int
    interrupted: bool


class StopRequest:
    """Ctrl-C while training: the first asks the loop to stop after the current step,
    the second raises ``KeyboardInterrupt`` (abandoning the step)."""

    def __init__(self) -> None:
        self.requested = False

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    @contextmanager
    def installed(self) -> Iterator[StopRequest]:
        if (
            threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # a background job: keep so
        ):
            yield self
            return
        previous = signal.signal(signal.SIGINT, self._handle)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)


def build_pipe(options: TrainOptions):
    """The model of ``options`` as an ``HFRoundPipe``, with the ``GradScaler`` an fp16
    model trains with (else ``None``)."""
    from roundpipe import RoundPipe, RoundPipeRunConfig

    lora = None
    if not options.full:
        import peft

        alpha = options.lora_alpha
        lora = peft.LoraConfig(
            r=options.lora_r,
            lora_alpha=int(alpha) if float(alpha).is_integer() else alpha,
            target_modules=options.lora_target_modules(),
            lora_dropout=options.lora_dropout,
            task_type="CAUSAL_LM",
        )
    scaler = torch.amp.GradScaler("cpu") if options.precision == "fp16" else None
    torch.manual_seed(options.seed)  # the adapters' initialisation
    with quiet_transformers():
        pipe = RoundPipe.from_pretrained(
            options.model,
            torch_dtype=DTYPES[options.precision],
            lora=lora,
            devices=options.devices,
            model_run_config=RoundPipeRunConfig(num_microbatch=options.microbatches),
            grad_scaler=scaler,
        )
    return pipe, scaler


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """Without transformers' progress bars (loading or writing weights) and the
    FutureWarnings peft triggers by calling APIs transformers deprecates: noise in the
    command's output that its user can do nothing about."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


def mean_token_loss(pipe, batches) -> float:
    """The mean cross-entropy over every label token of ``batches`` (all of its first
    epoch), without gradients and through the head's chunked loss; the pipe is
    synchronized first, so the newest weights answer."""
    pipe.synchronize()
    total, count = 0.0, 0
    for index in range(batches.steps_per_epoch):
        tokens = batches.num_label_tokens(index)
        total += float(pipe.eval_loss(batches.batch(index))) * tokens
        count += tokens
    return total / count


class Run:
    """One invocation of ``roundpipe train`` from model loading to the saved result."""

    def __init__(self, prepared: Prepared, stream: TextIO | None = None) -> None:
        self.prepared = prepared
        self.options = prepared.options
        self.total = prepared.total_steps
        self.stream = stream or sys.stdout
        self.output = self.options.output
        self.metrics = MetricsLog(self.output / METRICS_FILE)
        self.progress: Progress | None = None

    def say(self, text: str) -> None:
        if self.progress is not None:
            self.progress.message(text)
        else:
            print(text, file=self.stream, flush=True)

    def train(self) -> Outcome:
        o = self.options
        self.output.mkdir(parents=True, exist_ok=True)
        write_run_yaml(o, self.output / "run.yaml")
        for note in self.prepared.notes:
            self.say(note)
        pipe, scaler = build_pipe(o)
        with pipe:
            self.pipe, self.scaler = pipe, scaler
            params = list(pipe.optim_parameters())
            self.optimizer = build_optimizer(params, o.lr, o.weight_decay)
            self.scheduler = build_scheduler(self.optimizer, o.warmup_steps, self.total, o.schedule)
            self.step_fn = step_function(
                self.optimizer, self.scheduler, params, o.grad_clip, scaler
            )
            start = self._resume() if self.prepared.resume_from else self._start_fresh()
            self.saved_step = start.step if self.prepared.resume_from else None
            self.say(
                f"training {'all weights' if o.full else 'a LoRA adapter'} of {o.model.name} "
                f"({sum(p.numel() for p in params):,} trainable parameters) on {o.devices}, "
                f"{o.precision}, steps {start.step + 1}-{self.total}"
            )
            self.progress = open_progress(self.total, start.step, self.stream)
            try:
                position, interrupted = self._loop(start)
            finally:
                self.progress.close()
                self.progress = None
            if interrupted:
                self.say(f"interrupted: checkpoint of step {position.step} written; continue "
                         "with --resume")  # fmt: skip
                return Outcome(position.step, interrupted=True)
            self._save_result()
        return Outcome(position.step, interrupted=False)

    def _start_fresh(self) -> Position:
        for _, path in complete_checkpoints(self.output):  # an earlier demo run's (see prepare)
            shutil.rmtree(path, ignore_errors=True)
            shutil.rmtree(path.with_name(path.name + ".old"), ignore_errors=True)
        self.metrics.start_fresh()
        return Position(step=0, tokens=0, elapsed_s=0.0)

    def _resume(self) -> Position:
        for found in self.prepared.resume_from:
            try:
                self.pipe.load_checkpoint(
                    found.path, self.optimizer, self.scheduler, grad_scaler=self.scaler
                )
            except (OSError, ValueError, KeyError, RuntimeError) as error:
                self.say(f"cannot load {found.path} ({error}); trying an older checkpoint")
                continue
            adopt_options(
                self.optimizer, self.scheduler, self.options.lr, self.options.weight_decay
            )
            self.metrics.keep_until(found.position.step)
            self.say(f"resuming from {found.path} (step {found.position.step})")
            changed = changed_options(found.options, self.options)
            if changed:
                self.say("changed since the checkpoint: " + ", ".join(
                    f"{k} {old!r} -> {new!r}" for k, old, new in
                    ((k, *v) for k, v in changed.items())))  # fmt: skip
            return found.position
        raise UsageError(f"--resume: no checkpoint in {self.output / 'checkpoints'} loads")

    def _loop(self, position: Position) -> tuple[Position, bool]:
        """Train from ``position`` to the end, or until Ctrl-C; returns where it stopped
        and whether it was interrupted (a checkpoint of that step is then written)."""
        stop = StopRequest()
        self.session_start = time.monotonic()
        self.elapsed_before = position.elapsed_s
        self.mark = self.session_start
        with stop.installed():
            try:
                while position.step < self.total and not stop.requested:
                    position = self._step(position)
                if not stop.requested:
                    return position, False
                self.say(f"Ctrl-C: stopped after step {position.step}")
            except KeyboardInterrupt:
                position = self._after_abandoned_step(position)
        if position.step != self.saved_step:
            self._save_checkpoint(position)
        return position, True

    def _step(self, before: Position) -> Position:
        o, index = self.options, before.step
        step = index + 1
        batches = self.prepared.train_batches
        batch = batches.batch(index)
        default_split = self.pipe.run_config.num_microbatch or len(self.pipe.pool) + 1
        split = min(default_split, batch["input_ids"].shape[0])
        config = replace(self.pipe.run_config, num_microbatch=split)
        pending_loss = self.pipe.forward_backward(input_kwargs=batch, run_config=config)
        self.pipe.step(self.step_fn, is_async=not o.sync)  # queued before the loss is read
        loss = float(pending_loss)
        now = time.monotonic()
        tokens = batches.num_tokens(index)
        tokens_per_s = tokens / max(now - self.mark, 1e-9)
        position = Position(step, before.tokens + tokens, self._elapsed(now))
        eval_loss = None
        evaluate = o.eval_every is not None and step % o.eval_every == 0
        if self.prepared.eval_batches is not None and (evaluate or step == self.total):
            eval_loss = mean_token_loss(self.pipe, self.prepared.eval_batches)
        lr = o.lr * lr_factor(index, o.warmup_steps, self.total, o.schedule)
        record = {"step": step, "loss": loss, "lr": lr, "tokens": position.tokens,
                  "tokens_per_s": tokens_per_s, "elapsed_s": position.elapsed_s}  # fmt: skip
        if eval_loss is not None:
            record["eval_loss"] = eval_loss
        self.metrics.append(record)
        self.progress.update(StepReport(step, loss, lr, tokens_per_s, eval_loss))
        save = (o.save_every is not None and step % o.save_every == 0) or step == self.total
        if save:
            self._save_checkpoint(position)
        # the next step's tokens/s leaves out the time spent evaluating and saving
        self.mark = time.monotonic() if save or eval_loss is not None else now
        return position

    def _elapsed(self, now: float) -> float:
        return self.elapsed_before + (now - self.session_start)

    def _after_abandoned_step(self, before: Position) -> Position:
        """A second Ctrl-C interrupted a step: let the queued work finish, drop the
        gradients of a call whose step did not run, and say where the run stands."""
        self.say("Ctrl-C again: abandoning the current step")
        self.pipe.synchronize()
        self.pipe.step(discard_gradients(self.optimizer), is_async=False)
        done = self.scheduler.last_epoch  # the steps that ran
        batches = self.prepared.train_batches
        tokens = before.tokens + sum(batches.num_tokens(i) for i in range(before.step, done))
        self.metrics.keep_until(done)
        return Position(done, tokens, self._elapsed(time.monotonic()))

    def _save_checkpoint(self, position: Position) -> None:
        path = checkpoint_path(self.output, position.step)
        self.pipe.save_checkpoint(
            path,
            optimizer=self.optimizer,
            lr_scheduler=self.scheduler,
            grad_scaler=self.scaler,
            extra=extra_record(position, self.options),
        )
        self.saved_step = position.step
        prune_checkpoints(self.output, self.options.keep_checkpoints)
        self._plot()

    def _plot(self) -> None:
        plot_losses(self.metrics.records(), self.output / PLOT_FILE, title=self.options.model.name)

    def _save_result(self) -> None:
        """The adapter (LoRA) or the model (``--full``) with its tokenizer, so that
        ``--output`` loads on its own."""
        with quiet_transformers():
            self.pipe.save_pretrained(self.output)
        self.prepared.tokenizer.save_pretrained(self.output)
        what = "model" if self.options.full else "LoRA adapter"
        self.say(f"saved the {what} and its tokenizer to {self.output}")


def train(prepared: Prepared, stream: TextIO | None = None) -> Outcome:
    """Run ``prepared`` (see :class:`Run`); progress and messages go to ``stream``."""
    return Run(prepared, stream).train()
