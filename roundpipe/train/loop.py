"""The training run of ``roundpipe train``: build the pipe, train, evaluate, checkpoint.

Step ``k`` trains on ``Batches.batch(k - 1)``, and everything a run does depends on the
step number only, so a resumed run continues as the uninterrupted one would have;
Ctrl-C finishes (or, a second time, abandons) the step and checkpoints
(docs/design.md#training-loop). Under ``torchrun`` every rank trains on its rows of the
global batch (docs/design.md#training-across-nodes).
"""

from __future__ import annotations

import os
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
    remove_checkpoint,
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
from .progress import Progress, Silent, StepReport, open_progress
from .ranks import Ranks
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

    def __init__(self, abandon: bool = True) -> None:
        self.requested = False
        self.abandon = abandon
        """False: a second Ctrl-C only repeats the request (several processes)."""

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested and self.abandon:
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
            # Asked to stop where a Ctrl-C never abandons a step (several processes):
            # the process is on its way out with 130, and a Ctrl-C from now on could only
            # kill it half-way through its exit while the other ranks wait for it.
            keep_out = self.requested and not self.abandon
            signal.signal(signal.SIGINT, signal.SIG_IGN if keep_out else previous)


def build_pipe(options: TrainOptions, ranks: Ranks | None = None):
    """The model of ``options`` as an ``HFRoundPipe``, with the ``GradScaler`` an fp16
    model trains with (else ``None``). Under ``torchrun`` (``ranks``), data parallel over
    the world group, whose collectives time out after ``--dist-timeout``."""
    from ..cluster import CommOptions
    from ..core.config import RoundPipeRunConfig
    from ..hf.loading import from_pretrained

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
    several = {}
    if ranks is not None and ranks.world > 1:
        several["comm_options"] = CommOptions(timeout_s=options.dist_timeout)
    torch.manual_seed(options.seed)  # the adapters' initialisation (alike on every rank)
    with quiet_transformers():
        pipe = from_pretrained(
            options.model,
            torch_dtype=DTYPES[options.precision],
            lora=lora,
            devices=options.devices,
            model_run_config=RoundPipeRunConfig(num_microbatch=options.microbatches),
            grad_scaler=scaler,
            **several,
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


def mean_token_loss(pipe, batches, ranks: Ranks | None = None) -> float:
    """The mean cross-entropy over every label token of ``batches`` (all of its first
    epoch), without gradients and through the head's chunked loss; the pipe is
    synchronized first, so the newest weights answer. Under ``torchrun`` rank r
    evaluates batches r, r + K, ... and the ranks' sums are added (every rank returns
    the whole set's mean)."""
    ranks = ranks or Ranks()
    pipe.synchronize()
    total, count = 0.0, 0
    for index in range(ranks.rank, batches.steps_per_epoch, ranks.world):
        tokens = batches.num_label_tokens(index)
        total += float(pipe.eval_loss(batches.batch(index))) * tokens
        count += tokens
    if ranks.world > 1:
        total, count = ranks.sum([total, count], "the evaluation sums")
    return total / count


class Run:
    """One invocation of ``roundpipe train`` from model loading to the saved result."""

    def __init__(
        self, prepared: Prepared, stream: TextIO | None = None, ranks: Ranks | None = None
    ) -> None:
        self.prepared = prepared
        self.options = prepared.options
        self.total = prepared.total_steps
        self.stream = stream or sys.stdout
        self.ranks = ranks or Ranks()
        self.main = self.ranks.main
        self.output = self.options.output
        self.metrics = MetricsLog(self.output / METRICS_FILE, write=self.main)
        self.progress: Progress | None = None

    def say(self, text: str) -> None:
        if not self.main:
            return
        if self.progress is not None:
            self.progress.message(text)
        else:
            print(text, file=self.stream, flush=True)

    def train(self) -> Outcome:
        o = self.options
        self.output.mkdir(parents=True, exist_ok=True)
        if self.main:
            write_run_yaml(o, self.output / "run.yaml")
        for note in self.prepared.notes:
            self.say(note)
        pipe, scaler = build_pipe(o, self.ranks)
        with pipe:
            self.pipe, self.scaler = pipe, scaler
            params = list(pipe.optim_parameters())
            self.optimizer = build_optimizer(params, o.lr, o.weight_decay)
            self.scheduler = build_scheduler(self.optimizer, o.warmup_steps, self.total, o.schedule)
            self.step_fn = step_function(
                self.optimizer, self.scheduler, pipe.clip_grad_norm_, o.grad_clip, scaler
            )
            start = self._resume() if self.prepared.resume_from else self._start_fresh()
            self.saved_step = start.step if self.prepared.resume_from else None
            where = o.devices
            if self.ranks.world > 1:
                where = f"{self.ranks.world} processes ({o.devices} each)"
            trainable = sum(p.numel() for p in pipe.hf_model.parameters() if p.requires_grad)
            self.say(
                f"training {'all weights' if o.full else 'a LoRA adapter'} of {o.model.name} "
                f"({trainable:,} trainable parameters) on {where}, "
                f"{o.precision}, steps {start.step + 1}-{self.total}"
            )
            self.progress = (
                open_progress(self.total, start.step, self.stream) if self.main else Silent()
            )
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
        shard = self.ranks.shard
        for _, path in complete_checkpoints(self.output, shard):  # an earlier demo run's
            remove_checkpoint(path, shard)
        self.metrics.start_fresh()
        return Position(step=0, tokens=0, elapsed_s=0.0)

    def _resume(self) -> Position:
        # Several processes load together: one failing would leave the others waiting in
        # the load, so they try only the checkpoint preflight checked on every rank.
        candidates = self.prepared.resume_from[: 1 if self.ranks.world > 1 else None]
        for found in candidates:
            try:
                self.pipe.load_checkpoint(
                    found.path, self.optimizer, self.scheduler, grad_scaler=self.scaler
                )
            except (OSError, ValueError, KeyError, RuntimeError) as error:
                if self.ranks.world > 1:
                    raise
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
        several = self.ranks.world > 1 or "TORCHELASTIC_RUN_ID" in os.environ
        stop = StopRequest(abandon=not several)
        self.session_start = time.monotonic()
        self.elapsed_before = position.elapsed_s
        self.mark = self.session_start
        stopping = False  # agreed by every rank after each step
        with stop.installed():
            try:
                while position.step < self.total and not stopping:
                    position = self._step(position)
                    stopping = self.ranks.any(stop.requested, "the Ctrl-C flag exchange")
                if not stopping:
                    return position, False
                self.say(f"Ctrl-C: stopped after step {position.step}")
            except KeyboardInterrupt:
                if self.ranks.world > 1:
                    raise  # no checkpoint: the others stop at their next collective
                position = self._after_abandoned_step(position)
            if position.step != self.saved_step:  # a repeated Ctrl-C as during the steps
                self._save_checkpoint(position)
        return position, True

    def _step(self, before: Position) -> Position:
        o, index = self.options, before.step
        step = index + 1
        batches = self.prepared.train_batches
        batch = batches.batch(index)
        default_split = self.pipe.run_config.num_microbatch or len(self.pipe.pool) + 1
        smallest_share = batch["input_ids"].shape[0] // self.ranks.world
        config = replace(self.pipe.run_config, num_microbatch=min(default_split, smallest_share))
        share = self.ranks.share(batch)
        pending_loss = self.pipe.forward_backward(input_kwargs=share, run_config=config)
        self.pipe.step(self.step_fn, is_async=not o.sync)  # queued before the loss is read
        loss = float(pending_loss)
        now = time.monotonic()
        tokens = batches.num_tokens(index)
        tokens_per_s = tokens / max(now - self.mark, 1e-9)
        position = Position(step, before.tokens + tokens, self._elapsed(now))
        eval_loss = None
        evaluate = o.eval_every is not None and step % o.eval_every == 0
        if self.prepared.eval_batches is not None and (evaluate or step == self.total):
            eval_loss = mean_token_loss(self.pipe, self.prepared.eval_batches, self.ranks)
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
        prune_checkpoints(self.output, self.options.keep_checkpoints, self.ranks.shard)
        self._plot()

    def _plot(self) -> None:
        if self.main:
            title = self.options.model.name
            plot_losses(self.metrics.records(), self.output / PLOT_FILE, title=title)

    def _save_result(self) -> None:
        """The adapter (LoRA) or the model (``--full``) with its tokenizer, so that
        ``--output`` loads on its own."""
        with quiet_transformers():
            self.pipe.save_pretrained(self.output)  # collective: rank 0 writes
        if self.main:
            self.prepared.tokenizer.save_pretrained(self.output)
        what = "model" if self.options.full else "LoRA adapter"
        self.say(f"saved the {what} and its tokenizer to {self.output}")


def train(prepared: Prepared, stream: TextIO | None = None, ranks: Ranks | None = None) -> Outcome:
    """Run ``prepared`` (see :class:`Run`); progress and messages go to ``stream`` (on
    rank 0 of ``ranks``, the processes of a ``torchrun`` launch)."""
    return Run(prepared, stream, ranks).train()
