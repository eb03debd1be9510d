"""The training run of ``roundpipe train``: build the pipe, train, evaluate, checkpoint.

Step ``k`` trains on ``Batches.batch(k - 1)``, and everything a run does depends on the
step number only, so a resumed run continues as the uninterrupted one would have; a
stop signal (Ctrl-C, SIGTERM, SIGHUP) finishes the step (a second Ctrl-C abandons it)
and checkpoints (docs/design.md#training-loop). Under ``torchrun`` every rank trains on
its rows of the global batch (docs/design.md#training-across-nodes).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass, replace
from typing import TextIO

import torch

from .checkpoints import (
    Position,
    changed_options,
    checkpoint_bytes,
    checkpoint_path,
    complete_checkpoints,
    extra_record,
    prune_checkpoints,
    remove_checkpoint,
)
from .disk import SMALL_FILE, writing
from .hub import ModelSource, resolve_model
from .long_context import fit_sequences, tiling_note
from .memory_check import reporting_host_memory
from .model_checks import lora_config
from .optim import (
    Optimization,
    adopt_options,
    build_optimization,
    lean_note,
    lean_pipe_options,
    lr_factor,
    step_without_update,
)
from .options import TrainOptions, UsageError, write_run_yaml
from .pool_report import pool_line, pool_speeds, where_it_runs
from .preference_run import steps_of
from .preflight import Prepared
from .progress import Progress, Silent, StepReport, open_progress
from .quiet import quiet_transformers
from .ranks import Ranks
from .report import METRICS_FILE, PLOT_FILE, MetricsLog, PendingRows, plot_losses
from .result import DTYPES, result_bytes, result_name, save_dtype, save_result
from .stopping import StopRequest, signal_name
from .trackers import Trackers, open_trackers

PLOT_BYTES = 100_000  # about what loss.png takes


@dataclass(frozen=True)
class Outcome:
    """How a run ended: after ``steps`` steps, finished, or stopped by the signal
    ``stop_signal`` (0: finished)."""

    steps: int
    stop_signal: int = 0


def build_pipe(
    options: TrainOptions, ranks: Ranks | None = None, source: ModelSource | None = None
):
    """The model of ``options`` (in ``source``, else where ``--model`` resolves to) as an
    ``HFRoundPipe``, with the ``GradScaler`` an fp16 model trains with (else ``None``).
    Under ``torchrun`` (``ranks``), data parallel over the world group, whose collectives
    time out after ``--dist-timeout``."""
    from ..cluster import CommOptions
    from ..core.config import RoundPipeRunConfig
    from ..hf.loading import from_pretrained

    assert options.model is not None and options.precision is not None
    source = source or resolve_model(options.model, options.revision)

    scaler = torch.amp.GradScaler("cpu") if options.precision == "fp16" else None
    several = lean_pipe_options(options)
    if ranks is not None and ranks.world > 1:
        several["comm_options"] = CommOptions(timeout_s=options.dist_timeout)
    torch.manual_seed(options.seed)  # the adapters' initialisation (alike on every rank)
    with quiet_transformers():
        pipe = from_pretrained(
            source.directory,
            torch_dtype=DTYPES[options.precision],
            lora=lora_config(options),
            devices=options.devices,
            model_run_config=RoundPipeRunConfig(num_microbatch=options.microbatches),
            grad_scaler=scaler,
            **several,
        )
    pipe.train()  # as Trainer trains: the config's dropout (and --lora-dropout) active
    fit_sequences(pipe, options, ranks or Ranks())  # closes the pipe when it refuses
    return pipe, scaler


def step_run_config(config, devices: int, rows: int, world: int):
    """The run config of a training step of ``rows`` rows over ``world`` processes: the
    microbatch count ``config`` gives, at most the rows of the smallest share."""
    return replace(config, num_microbatch=config.microbatches_for(devices, rows // world))


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
        assert self.options.output is not None
        self.output = self.options.output
        self.metrics = MetricsLog(self.output / METRICS_FILE, write=self.main)
        self.progress: Progress | None = None
        self.trackers = Trackers([])
        self.saved_step: int | None = None
        """The step of the newest checkpoint on disk (None: none yet)."""
        self.step_config = None  # the last step's run config (None: before any step)
        self.method = steps_of(prepared, self.ranks)  # what a step computes; evaluations

    def say(self, text: str) -> None:
        if not self.main:
            return
        if self.progress is not None:
            self.progress.message(text)
        else:
            print(text, file=self.stream, flush=True)

    def train(self) -> Outcome:
        o = self.options
        if self.main:
            with self._writing(self.output / "run.yaml", SMALL_FILE):
                write_run_yaml(o, self.output / "run.yaml")
        for note in self.prepared.notes:
            self.say(note)
        pipe, scaler = build_pipe(o, self.ranks, self._source())
        with pipe:
            self.pipe, self.scaler = pipe, scaler
            self.params = list(pipe.optim_parameters())
            self._use(build_optimization(pipe, o, self.total, scaler))
            self.method.start(pipe, self.say)  # before a checkpoint loads
            start = self._resume() if self.prepared.resume_from else self._start_fresh()
            if start.step == self.total:  # stopped while it wrote the result
                self.say(f"all {self.total} steps are done; writing the {result_name(o.full)}, "
                         "which is missing or incomplete")  # fmt: skip
                position, stopped = start, 0
            else:
                position, stopped = self._train_steps(start)
                for line in pool_speeds(pipe, self.step_config):
                    self.say(line)
            if stopped:
                self.say(f"interrupted: checkpoint of step {position.step} written; continue "
                         "with --resume")  # fmt: skip
                return Outcome(position.step, stopped)
            self._save_result()
        return Outcome(position.step)

    def _train_steps(self, start: Position) -> tuple[Position, int]:
        o, where = self.options, where_it_runs(self.options.devices, self.ranks.world)
        trainable = sum(p.numel() for p in self.pipe.hf_model.parameters() if p.requires_grad)
        self.say(
            f"training {'all weights' if o.full else 'a LoRA adapter'} of {self._model_name()} "
            f"({trainable:,} trainable parameters) on {where}, "
            f"{o.precision}{lean_note(o)}{tiling_note(self.pipe)}, "
            f"steps {start.step + 1}-{self.total}"
        )
        self.say(pool_line(self.pipe.pool))
        self.progress = (
            open_progress(self.total, start.step, self.stream) if self.main else Silent()
        )
        try:
            self.trackers = open_trackers(
                o.trackers(), self.output, o.run_record(), self.main, start.step
            )
            try:
                return self._loop(start)
            finally:
                self.trackers.close()
                self.trackers = Trackers([])
        finally:
            self.progress.close()
            self.progress = None

    def _use(self, optimization: Optimization) -> None:
        """Train with ``optimization``; its step function records the gradient norms
        that complete the rows waiting in ``self.rows``."""
        self.optimizer, self.scheduler = optimization.optimizer, optimization.scheduler
        self.step_fn, self.warmup = optimization.step_fn, optimization.warmup
        self.rows = PendingRows(optimization.norms.pop)

    def _write_rows(self, every: bool = False) -> None:
        """Append the rows whose gradient norm is in to ``metrics.jsonl`` and the
        trackers; with ``every``, first wait for the queued steps, and append all."""
        if every and self.rows.rows:
            self.pipe.synchronize()
        for row in self.rows.ready(every):
            with self._writing(self.metrics.path, SMALL_FILE):
                self.metrics.append(row)
            self.trackers.log(row["step"], row)

    def _load(self, path) -> None:
        """Load the checkpoint ``path``; one whose optimizer has a single parameter
        group (written before weight decay spared biases and norms) loads into such an
        optimizer, which this run then keeps."""
        try:
            self.pipe.load_checkpoint(path, self.optimizer, self.scheduler, grad_scaler=self.scaler)
        except ValueError as error:
            one = build_optimization(self.pipe, self.options, self.total, self.scaler, False)
            try:
                self.pipe.load_checkpoint(
                    path, one.optimizer, one.scheduler, grad_scaler=self.scaler
                )
            except (OSError, ValueError):
                raise error from None
            self._use(one)
            self.say(f"note: {path} holds one AdamW parameter group (an older roundpipe's): "
                     "this run keeps it, weight decay on every parameter, biases and norm "
                     "weights included")  # fmt: skip

    def _start_fresh(self) -> Position:
        shard = self.ranks.shard
        for _, path in complete_checkpoints(self.output, shard):  # an earlier demo run's
            remove_checkpoint(path, shard)
        with self._writing(self.metrics.path, SMALL_FILE):
            self.metrics.start_fresh()
        return Position(step=0, tokens=0, elapsed_s=0.0)

    def _resume(self) -> Position:
        # Several processes load together: one failing would leave the others waiting in
        # the load, so they try only the checkpoint preflight checked on every rank.
        candidates = self.prepared.resume_from[: 1 if self.ranks.world > 1 else None]
        for found in candidates:
            try:
                self._load(found.path)
            except (OSError, ValueError) as error:  # a damaged checkpoint, named
                if self.ranks.world > 1:
                    raise
                self.say(f"warning: cannot load {found.path} ({error}); trying an older one")
                continue
            adopt_options(
                self.optimizer, self.scheduler, self.options.lr, self.options.weight_decay
            )
            self.saved_step = found.position.step
            with self._writing(self.metrics.path, SMALL_FILE):
                self.metrics.keep_until(found.position.step)
            self.say(f"resuming from {found.path} (step {found.position.step})")
            changed = changed_options(found.options, self.options)
            if changed:
                self.say("changed since the checkpoint: " + ", ".join(
                    f"{k} {old!r} -> {new!r}" for k, old, new in
                    ((k, *v) for k, v in changed.items())))  # fmt: skip
            return found.position
        raise UsageError(f"--resume: no checkpoint in {self.output / 'checkpoints'} loads")

    def _loop(self, position: Position) -> tuple[Position, int]:
        """Train from ``position`` to the end, or until a stop signal; returns where it
        stopped and the signal (0: finished; else a checkpoint of that step is written)."""
        several = self.ranks.world > 1 or "TORCHELASTIC_RUN_ID" in os.environ
        stop = StopRequest(abandon=not several)
        self.session_start = time.monotonic()
        self.elapsed_before = position.elapsed_s
        self.mark = self.session_start
        stopped = 0  # the stop signal, agreed by every rank after each step
        with stop.installed():
            try:
                while position.step < self.total and not stopped:
                    position = self._step(position)
                    stopped = self.ranks.max(stop.signum, "the stop-signal exchange")
                if position.step == self.total:  # a signal in the last step: nothing to stop
                    return position, 0
                self.say(f"{signal_name(stopped)}: stopped after step {position.step}")
            except KeyboardInterrupt:
                if self.ranks.world > 1:
                    raise  # no checkpoint: the others stop at their next collective
                stopped = signal.SIGINT
                position = self._after_abandoned_step(position)
            if position.step != self.saved_step:  # a repeated Ctrl-C as during the steps
                self._save_checkpoint(position)
        return position, stopped

    def _step(self, before: Position) -> Position:
        o, index = self.options, before.step
        step = index + 1
        batches = self.prepared.train_batches
        batch = batches.batch(index)
        rows = batch["input_ids"].shape[0]
        config = step_run_config(self.pipe.run_config, len(self.pipe.pool), rows, self.ranks.world)
        self.step_config = config
        pending_loss, shown = self.method.step(self.pipe, index, batch, config)
        self.pipe.step(self.step_fn, is_async=not o.sync)  # queued before the loss is read
        loss = float(pending_loss)
        now = time.monotonic()
        tokens = batches.num_tokens(index)
        tokens_per_s = tokens / max(now - self.mark, 1e-9)
        position = Position(step, before.tokens + tokens, self._elapsed(now))
        evaluated: dict[str, float] = {}
        due = o.eval_every is not None and step % o.eval_every == 0
        if self.prepared.eval_batches is not None and (due or step == self.total):
            evaluated = self.method.evaluate(self.pipe)
        eval_loss = evaluated.get("eval_loss")
        lr = o.lr * lr_factor(index, self.warmup, self.total, o.schedule)  # the step's
        epoch = step / batches.steps_per_epoch  # as Trainer logs it
        record = {"step": step, "epoch": epoch, "loss": loss, "lr": lr,
                  "tokens": position.tokens, "num_tokens": position.tokens, **shown,
                  "tokens_per_s": tokens_per_s, "elapsed_s": position.elapsed_s,
                  **evaluated}  # fmt: skip
        self.rows.add(record)  # written once the step has measured its gradient norm
        self._write_rows()
        epoch_shown = epoch if o.steps is None else None
        assert self.progress is not None
        extra = self.method.shown(shown)
        self.progress.update(
            StepReport(step, loss, lr, tokens_per_s, eval_loss, epoch_shown, extra)
        )
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
        self.pipe.step(step_without_update(self.optimizer), is_async=False)
        done = self.scheduler.last_epoch  # the steps that ran
        batches = self.prepared.train_batches
        tokens = before.tokens + sum(batches.num_tokens(i) for i in range(before.step, done))
        self._write_rows(every=True)
        with self._writing(self.metrics.path, SMALL_FILE):
            self.metrics.keep_until(done)
        return Position(done, tokens, self._elapsed(time.monotonic()))

    def _save_checkpoint(self, position: Position) -> None:
        self._write_rows(every=True)  # the rows up to the checkpoint's step
        path = checkpoint_path(self.output, position.step)
        with self._writing(path, self._checkpoint_bytes()):
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

    def _checkpoint_bytes(self) -> int:
        trainable = [p for p in self.pipe.hf_model.parameters() if p.requires_grad]
        return checkpoint_bytes([*trainable, *self.params], self.optimizer)

    def _plot(self) -> None:
        if self.main:
            o = self.options
            how = "full fine-tune" if o.full else f"LoRA r{o.lora_r}"
            title = f"{self.output.name}: {self._model_name()}, {how}"
            with self._writing(self.output / PLOT_FILE, PLOT_BYTES):
                plot_losses(self.metrics.records(), self.output / PLOT_FILE, title=title)

    def _source(self) -> ModelSource:
        """Where ``--model`` lies (resolved by preflight)."""
        if self.prepared.source is None:
            assert self.options.model is not None
            self.prepared.source = resolve_model(self.options.model, self.options.revision)
        return self.prepared.source

    def _model_name(self) -> str:
        return self._source().name

    def _save_result(self) -> None:
        full = self.options.full
        dtype = save_dtype(self.options, self._source().directory)
        with self._writing(self.output, result_bytes(self.pipe, full, dtype)):
            save_result(self.pipe, self.prepared.tokenizer, self.output, self.main, dtype)
        self.say(f"saved the {result_name(full)} and its tokenizer to {self.output}")

    def _writing(self, path, needed: int):
        """:func:`~roundpipe.train.disk.writing`, saying where a resumed run would start."""
        then = "run again"
        if self.saved_step is not None:
            then = f"continue with --resume (from the checkpoint of step {self.saved_step})"
        return writing(path, needed, then)


def train(prepared: Prepared, stream: TextIO | None = None, ranks: Ranks | None = None) -> Outcome:
    """Run ``prepared`` (see :class:`Run`) in its ``--output``, which exists and which
    this process holds (:func:`roundpipe.train.lock.holding`); progress and messages go
    to ``stream`` (on rank 0 of ``ranks``, the processes of a ``torchrun`` launch).
    Running out of host memory raises :class:`~.memory_check.OutOfHostMemory`."""
    run = Run(prepared, stream, ranks)

    def newest():
        step = run.saved_step
        return None if step is None else (step, checkpoint_path(run.output, step))

    with reporting_host_memory(newest):
        return run.train()
