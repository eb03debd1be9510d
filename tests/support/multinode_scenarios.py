"""What each rank of a multi-node test runs (see ``tests/support/multinode.py``)."""

from __future__ import annotations

import functools
import os
import resource
import time

import torch
import torch.distributed as dist

import roundpipe
from roundpipe import EmulatedOptions, RoundPipe, RoundPipeRunConfig
from roundpipe.cluster import CommOptions
from support.multinode_checkpoints import save_killed
from support.oracle import batch, mlp, mse_sum


def make_optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def rank_share(tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return torch.tensor_split(tensor, world)[rank]


def train(
    rank: int,
    *,
    steps: int = 3,
    is_async: bool = False,
    optimizer: str = "adam",
    devices: int = 2,
    microbatches: int = 2,
    batch_size: int = 12,
    grad_reduction: str = "sum",
    scale_grads: bool = True,
    dtype: str = "float64",
    width: int = 16,
    depth: int = 6,
    bucket_bytes: int = 32 * 2**20,
    delay_s: float = 0.0,
    die_at_step: int | None = None,
    die_in: str = "call",
    fail_at_step: int | None = None,
    timeout_s: float | None = None,
    clip: float | None = None,
    **_: object,
) -> dict:
    """Train an ``oracle.mlp`` on this rank's share of ``oracle.batch(step)``."""
    world = dist.get_world_size()
    model = mlp(width=width, depth=depth).to(getattr(torch, dtype))
    options = CommOptions(timeout_s=timeout_s, bucket_bytes=bucket_bytes)
    config = RoundPipeRunConfig(num_microbatch=microbatches, scale_grads=scale_grads)
    pipe = RoundPipe(
        model,
        devices=f"emulated:{devices}",
        model_run_config=config,
        grad_reduction=grad_reduction,
        comm_options=options,
    )
    pipe.node.comm.delay_s = delay_s
    opt = make_optimizer(optimizer, pipe.optim_parameters())
    losses, step_times, errors = [], [], []
    for step in range(steps):
        x, y = batch(seed=step, size=batch_size)
        x, y = x.to(model[0].weight.dtype), y.to(model[0].weight.dtype)
        xs, ys = rank_share(x, rank, world), rank_share(y, rank, world)
        dying = die_at_step == step and rank == world - 1
        if dying and die_in == "call":
            os._exit(3)  # a node lost between steps
        if dying and die_in == "hang":
            time.sleep(3600)  # a node that stops answering (killed by the test)
        if fail_at_step == step and rank == world - 1:
            xs = xs[:, :-1]  # a shape error inside the first layer, on this rank only
        start = time.perf_counter()
        try:
            losses.append(float(pipe.forward_backward((xs,), label=ys, loss_fn=mse_sum)))
        except Exception as exc:
            if fail_at_step is None:
                raise
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        die = dying and die_in == "step"
        pipe.step(functools.partial(step_fn, pipe, opt, clip, die), is_async=is_async)
        if not is_async:
            step_times.append(time.perf_counter() - start)
    pipe.synchronize()
    state = {k: v.clone() for k, v in pipe.state_dict().items()}
    master_bytes = sum(p.numel() * p.element_size() for p in pipe.optim_parameters())
    adam_bytes = sum(
        t.numel() * t.element_size()
        for s in opt.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    pipe.close()
    return {
        "losses": losses,
        "errors": errors,
        "state": state,
        "master_bytes": master_bytes,
        "optimizer_bytes": adam_bytes,
        "step_times": step_times,
        "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }


def step_fn(pipe: RoundPipe, opt, clip: float | None, die: bool = False) -> None:
    if die:
        os._exit(3)  # a node lost inside its optimizer step, while the others exchange
    if clip is not None:
        pipe.clip_grad_norm_(clip)
    opt.step()
    opt.zero_grad()


def uneven(rank: int, **_: object) -> dict:
    """Rank r splits its batch into r + 2 microbatches."""
    pipe = RoundPipe(mlp(), devices="emulated:1")
    x, y = batch(size=12)
    config = RoundPipeRunConfig(num_microbatch=rank + 2)
    try:
        pipe.forward_backward((x,), label=y, loss_fn=mse_sum, run_config=config)
    except ValueError as exc:
        error = str(exc)
    else:
        error = None
    pipe.close()
    try:
        scaled = RoundPipe(mlp(), devices="emulated:1", grad_scaler=torch.amp.GradScaler("cpu"))
    except NotImplementedError as exc:
        scaler_error = str(exc)
    else:
        scaled.close()
        scaler_error = None
    return {"error": error, "scaler_error": scaler_error}


def parameters_in_step_fn(rank: int, **_: object) -> dict:
    """``step_fn`` clips over ``pipe.parameters()``: the error it raises."""
    pipe = RoundPipe(mlp(), devices="emulated:1")
    x, y = batch(size=12)
    pipe.forward_backward((rank_share(x, rank, 2),), label=rank_share(y, rank, 2), loss_fn=mse_sum)
    try:
        pipe.step(lambda: torch.nn.utils.clip_grad_norm_(pipe.parameters(), 0.5), is_async=False)
    except RuntimeError as exc:
        error = str(exc)
    else:
        error = None
    pipe.close()
    return {"error": error}


def overlap(rank: int, *, delay_s: float, kernel_s: float, is_async: bool, steps: int = 5):
    """Time steps with each bucket collective delayed by ``delay_s`` and layers taking
    ``kernel_s`` of modelled device time; the last step's timeline."""
    world = dist.get_world_size()
    options = EmulatedOptions(kernel_time=lambda info: kernel_s * max(1, len(info.layers)))
    pipe = RoundPipe(
        mlp(depth=10),
        devices="emulated:2",
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
        emulated_options=options,
        comm_options=CommOptions(bucket_bytes=1),
    )
    pipe.node.comm.delay_s = delay_s
    opt = torch.optim.SGD(pipe.optim_parameters(), lr=0.01)
    x, y = batch(size=8)
    xs, ys = rank_share(x, rank, world), rank_share(y, rank, world)

    def one_step() -> None:
        pipe.forward_backward((xs,), label=ys, loss_fn=mse_sum)
        pipe.step(functools.partial(step_fn, pipe, opt, None), is_async=is_async)

    one_step()  # warm-up
    pipe.synchronize()
    start = time.perf_counter()
    for _ in range(steps - 1):
        one_step()
    pipe.start_timeline()  # waits for the steps so far
    elapsed = time.perf_counter() - start
    one_step()
    timeline = pipe.timeline()
    buckets = len(pipe.node.layout.buckets)
    pipe.close()
    spans = [(s.kind, s.label, s.start, s.end) for s in timeline.spans]
    return {"seconds_per_step": elapsed / (steps - 1), "spans": spans, "buckets": buckets}


def hf_batch(step: int):
    """A global batch of 4 rows; the second half has most labels ignored, so the
    ranks' label-token counts differ."""
    from support.hf_families import VOCAB

    generator = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (4, 8), generator=generator)
    labels = ids.clone()
    labels[2:, :6] = -100
    labels[0, :2] = -100
    return ids, labels


def hf(rank: int, *, steps: int = 2, save_to: str | None = None, **_: object) -> dict:
    """Train the tiny tied-embedding Qwen3 of the HF tests on this rank's rows."""
    from support.hf_families import build

    world = dist.get_world_size()
    pipe = roundpipe.from_hf(
        build("qwen3").double(),
        devices="emulated:2",
        model_run_config=RoundPipeRunConfig(num_microbatch=1),
    )
    opt = torch.optim.AdamW(pipe.optim_parameters(), lr=0.01)
    losses = []
    for step in range(steps):
        ids, labels = hf_batch(step)
        batch = {
            "input_ids": rank_share(ids, rank, world),
            "labels": rank_share(labels, rank, world),
        }
        losses.append(float(pipe.forward_backward(input_kwargs=batch)))
        pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
    state = {k: v.clone() for k, v in pipe.hf_model.state_dict().items()}
    if save_to is not None:
        pipe.save_pretrained(save_to)
        written = os.path.exists(os.path.join(save_to, "config.json"))  # on every rank
    pipe.close()
    return {"losses": losses, "state": state, "written": save_to is not None and written}


def resume(rank: int, *, checkpoint: str, phase: str, **_: object) -> dict:
    """``phase="save"``: 2 steps, a checkpoint, 2 more; ``"load"``: the checkpoint, then
    the same 2 more. Adam, asynchronous steps, fp32."""
    pipe = RoundPipe(
        mlp(), devices="emulated:2", model_run_config=RoundPipeRunConfig(num_microbatch=2)
    )
    opt = torch.optim.Adam(pipe.optim_parameters(), lr=0.01)
    first = 0
    if phase == "broken":  # rank 1's shard lost a file
        try:
            pipe.load_checkpoint(checkpoint, opt)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        pipe.close()
        return {"error": error}
    if phase == "load":
        first = pipe.load_checkpoint(checkpoint, opt)["next_step"]
    resumable_steps(pipe, opt, rank, first, checkpoint, phase, is_async=True)
    state = {k: v.clone() for k, v in pipe.state_dict().items()}
    pipe.close()
    return {"state": state}


def resumable_steps(pipe, opt, rank, first, checkpoint, phase, is_async) -> None:
    """Steps ``first`` to 3 on this rank's share of ``oracle.batch(step)``; with
    ``phase="save"`` a checkpoint before step 2 (its ``extra`` names step 2)."""
    world = dist.get_world_size()
    for step in range(first, 4):
        if step == 2 and phase == "save":
            pipe.save_checkpoint(checkpoint, opt, extra={"next_step": 2})
        x, y = batch(seed=step, size=8)
        pipe.forward_backward(
            (rank_share(x, rank, world),), label=rank_share(y, rank, world), loss_fn=mse_sum
        )
        pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=is_async)


def low_bit_resume(rank: int, *, checkpoint: str, phase: str, **_: object) -> dict:
    """``resume`` with torchao's AdamW8bit on a model with a 64x64 weight (whose owner
    rank keeps 8-bit moments), synchronous steps."""
    from torchao.optim import AdamW8bit

    config = RoundPipeRunConfig(num_microbatch=2)
    pipe = RoundPipe(mlp(width=64, depth=4), devices="emulated:2", model_run_config=config)
    opt = AdamW8bit(pipe.optim_parameters(), lr=0.01)
    first = pipe.load_checkpoint(checkpoint, opt)["next_step"] if phase == "load" else 0
    resumable_steps(pipe, opt, rank, first, checkpoint, phase, is_async=False)
    pipe.synchronize()
    state = {k: v.clone() for k, v in pipe.state_dict().items()}
    kinds = sorted({type(t).__name__ for s in opt.state.values() for t in s.values()})
    pipe.close()
    return {"state": state, "kinds": kinds}


SCENARIOS = {
    "low_bit_resume": low_bit_resume,
    "save_killed": save_killed,
    "resume": resume,
    "hf": hf,
    "train": train,
    "uneven": uneven,
    "overlap": overlap,
    "parameters_in_step_fn": parameters_in_step_fn,
}
