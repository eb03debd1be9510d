"""``roundpipe simulate --gpus rtx4090x4,rtx3090x4``: a box of unequal GPUs.

``--gpus`` takes a count or a pool of GPU presets (:class:`GpuPool`); a pool of one kind
is today's ``--gpu NAME --gpus K``. A mixed pool is predicted for a model: each kind of
card prices the model's layers from its own FLOP/s and memory bandwidth, the planner
sizes every stage for the device that runs it (job j on device j mod N,
docs/design.md#mixed-pools), and the prediction stands beside two references: the same
pool planned as if every card were the slowest, and the sum of each card alone.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace

from ..core.plan import Plan, PlanError
from ..planning.partition import auto_plan, step_objective
from .breakdown import Budget, device_peaks
from .gpus import GPU_PRESETS, Gpu, gpu_preset
from .model_mode import fit_text, header_line, model_spec_of, workload_of
from .model_specs import ModelSpec
from .models import Prediction, PricedModel, Workload, cost_model, predict, roundpipe_speed

DEFAULT_GPU = "rtx4090"
POOL_EXAMPLE = "rtx4090x4,rtx3090x4"


@dataclass(frozen=True)
class GpuPool:
    """GPUs of one box, kind by kind as ``--gpus`` lists them: devices 0..N-1 are the
    first kind's cards, then the next kind's."""

    kinds: tuple[tuple[Gpu, int], ...]
    """Each preset and how many of it, in the spec's order."""
    spec: str
    """The ``--gpus`` text it was read from."""

    @classmethod
    def parse(cls, text: str) -> GpuPool:
        """``rtx4090x4,rtx3090x4``: preset names, each with ``x`` and a count (a name
        alone counts one), separated by commas."""
        kinds = []
        for entry in (part.strip() for part in text.split(",")):
            if not entry:
                raise ValueError(
                    f"{text!r} has an empty entry: give a count N or a pool of presets NAMExCOUNT "
                    f"separated by commas, e.g. {POOL_EXAMPLE}"
                )
            name, count = _name_and_count(entry)
            if name not in GPU_PRESETS:
                where = "" if name == text.lower() else f" in {text!r}"
                raise ValueError(
                    f"unknown GPU preset {name!r}{where}; known presets: "
                    f"{', '.join(GPU_PRESETS)} (write a count N or NAMExCOUNT, e.g. "
                    f"{POOL_EXAMPLE})"
                )
            if count < 1:
                raise ValueError(
                    f"{entry} in {text!r} counts no GPU: each kind needs at least one card "
                    "(leave the kind out instead)"
                )
            kinds.append((gpu_preset(name), count))
        return cls(tuple(kinds), text)

    @property
    def size(self) -> int:
        return sum(count for _, count in self.kinds)

    @property
    def devices(self) -> list[Gpu]:
        """The card of each device, in device order."""
        return [gpu for gpu, count in self.kinds for _ in range(count)]

    @property
    def gpus(self) -> list[Gpu]:
        """Each kind of card once, in the spec's order."""
        return list(dict.fromkeys(gpu for gpu, _ in self.kinds))

    @property
    def mixed(self) -> bool:
        return len(self.gpus) > 1

    def __str__(self) -> str:
        return " + ".join(f"{count}x {gpu.name}" for gpu, count in self.kinds)

    def to_dict(self) -> list[dict]:
        return [{"gpu": gpu.name, "count": count} for gpu, count in self.kinds]


def _name_and_count(entry: str) -> tuple[str, int]:
    """``rtx4090x4`` -> ``("rtx4090", 4)``; a name alone counts one."""
    entry = entry.lower()
    name, x, count = entry.rpartition("x")
    if entry in GPU_PRESETS or not (x and name and count.isdigit()):
        return entry, 1
    return name, int(count)


def gpus_option(text: str) -> int | GpuPool:
    """``--gpus``: a device count, or a :class:`GpuPool` spec."""
    try:
        return int(text)
    except ValueError:
        pass
    if not any(character.isalpha() for character in text):
        raise argparse.ArgumentTypeError(
            f"expected a whole number of devices or a pool of presets such as "
            f"{POOL_EXAMPLE}, got {text!r}"
        )
    try:
        return GpuPool.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def resolve_pool(args: argparse.Namespace) -> tuple[argparse.Namespace, GpuPool | None]:
    """The options with ``--gpus`` a count and ``--gpu`` a preset name, and the pool
    when it is mixed (``None`` otherwise: a pool of one kind is ``--gpu NAME --gpus K``)."""
    pool = args.gpus if isinstance(args.gpus, GpuPool) else None
    if pool is None:
        return _with(args, gpu=args.gpu or DEFAULT_GPU), None
    if pool.mixed:
        if args.gpu is not None:
            raise ValueError(
                f"--gpu {args.gpu} and the mixed pool --gpus {pool.spec} both name cards: "
                "drop --gpu (the pool says which cards the box has)"
            )
        return _with(args, gpus=pool.size), pool
    (gpu,) = pool.gpus
    if args.gpu is not None and gpu_preset(args.gpu) != gpu:
        raise ValueError(
            f"--gpu {args.gpu} and --gpus {pool.spec} name different cards: drop --gpu, "
            f"or give --gpu {args.gpu} --gpus {pool.size}"
        )
    return _with(args, gpu=gpu.name, gpus=pool.size), None


def _with(args: argparse.Namespace, **values) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **values})


def check_mixed_options(args: argparse.Namespace, pool: GpuPool) -> None:
    """Exit 2 on what a mixed pool is not predicted for."""
    if not (args.model or args.config):
        raise ValueError(
            f"a mixed pool (--gpus {pool.spec}) needs a model: give --model or --config "
            "(synthetic layers have one time per layer, not one per kind of card)"
        )
    if args.schedule not in ("roundpipe", "all"):
        raise ValueError(
            f"--schedule {args.schedule} is a weight-bound pipeline of equal GPUs; a mixed "
            "pool is predicted for roundpipe only: give --schedule roundpipe"
        )
    refused = {
        "--max-seq-len": args.max_seq_len,
        "--nodes": args.nodes is not None,
        "--scaling": args.scaling,
        f"--method {args.method}": args.method != "sft",
    }
    for flag, given in refused.items():
        if given:
            raise ValueError(
                f"{flag} is not predicted for a mixed pool (--gpus {pool.spec}): drop it, "
                "or ask it of one kind of card (--gpu NAME --gpus N)"
            )


@dataclass(frozen=True)
class MixedPoolPrediction:
    """RoundPipe on a mixed pool, beside the same pool as if every card were the slowest
    and beside the sum of each card alone."""

    pool: GpuPool
    plan: Plan | None
    """The mixed-aware plan; ``None`` when none fits the cards (``detail`` says why)."""
    tokens_per_s: float
    detail: str
    peak_memory: tuple[int, ...]
    """Each device's peak bytes under ``plan`` (empty without a plan)."""
    budgets: tuple[int, ...]
    """Each device's usable bytes."""
    slowest: Gpu
    as_slowest: Prediction
    """RoundPipe on ``pool.size`` of the slowest card, its own plan."""
    card_alone: tuple[tuple[Gpu, Prediction], ...]
    """Each kind of card by itself, its own plan."""

    @property
    def cards_alone_tokens_per_s(self) -> float:
        alone = dict(self.card_alone)
        return sum(count * alone[gpu].tokens_per_s for gpu, count in self.pool.kinds)

    @property
    def fraction_of_cards_alone(self) -> float:
        total = self.cards_alone_tokens_per_s
        return self.tokens_per_s / total if total else 0.0

    def to_dict(self) -> dict:
        return {
            "pool": self.pool.to_dict(),
            "mixed": {
                "plan": None if self.plan is None else str(self.plan),
                "tokens_per_s": self.tokens_per_s,
                "peak_memory_bytes": list(self.peak_memory),
                "memory_budget_bytes": list(self.budgets),
                "detail": self.detail,
            },
            "as_slowest": {
                "gpu": self.slowest.name,
                "plan": _plan_of(self.as_slowest),
                "tokens_per_s": self.as_slowest.tokens_per_s,
            },
            "cards_alone": [
                {"gpu": gpu.name, "plan": _plan_of(alone), "tokens_per_s": alone.tokens_per_s}
                for gpu, alone in self.card_alone
            ],
            "cards_alone_tokens_per_s": self.cards_alone_tokens_per_s,
            "fraction_of_cards_alone": self.fraction_of_cards_alone,
        }


def predict_mixed_pool(spec: ModelSpec, pool: GpuPool, work: Workload) -> MixedPoolPrediction:
    """RoundPipe's tokens/s and per-device memory on ``pool``: each kind's layer times
    priced from its own card, bytes and the link from the slowest link's card (the
    stage boundaries cross it), memory budgets per device."""
    num_gpus, round_size = pool.size, work.round_microbatches(pool.size)
    priced = {
        gpu: PricedModel.build(spec, gpu, work, work.tokens_per_microbatch) for gpu in pool.gpus
    }
    per_kind = {gpu: cost_model(priced[gpu], gpu, work, num_gpus, round_size) for gpu in priced}
    link = min(pool.gpus, key=lambda gpu: gpu.pcie_bandwidth)
    costs = replace(
        per_kind[link], device_layers=tuple(per_kind[gpu].layers for gpu in pool.devices)
    )
    budgets = tuple(Budget(gpu.memory_bytes).available for gpu in pool.devices)
    slowest = max(pool.gpus, key=lambda gpu: _compute_seconds(priced[gpu]))
    result = MixedPoolPrediction(
        pool=pool,
        plan=None,
        tokens_per_s=0.0,
        detail="",
        peak_memory=(),
        budgets=budgets,
        slowest=slowest,
        as_slowest=_roundpipe_alone(spec, slowest, work, num_gpus),
        card_alone=tuple((gpu, _roundpipe_alone(spec, gpu, work, 1)) for gpu in pool.gpus),
    )
    try:
        plan = auto_plan(
            costs,
            num_gpus,
            round_size,
            list(budgets),
            round_size=round_size,
            refine=False,
            objective=step_objective(work.step != "sync"),
        )
    except PlanError as error:
        return replace(result, detail=str(error))
    tokens_per_s, detail = roundpipe_speed(plan, priced[link], costs, work, num_gpus)
    peaks = tuple(peak.total for peak in device_peaks(costs, plan, num_gpus))
    return replace(result, plan=plan, tokens_per_s=tokens_per_s, detail=detail, peak_memory=peaks)


def _compute_seconds(model: PricedModel) -> float:
    """A microbatch's forward and backward through every unit: which card is slowest."""
    return sum(unit.forward + unit.backward for unit in model.units)


def _roundpipe_alone(spec: ModelSpec, gpu: Gpu, work: Workload, num_gpus: int) -> Prediction:
    (prediction,) = predict(spec, gpu, work, num_gpus, ("roundpipe",))
    return prediction


def _plan_of(prediction: Prediction) -> str | None:
    memory = prediction.memory
    return None if memory is None or memory.plan is None else str(memory.plan)


def run_mixed_pool(args: argparse.Namespace, pool: GpuPool) -> int:
    """Print the mixed pool's prediction and its two references (one JSON object under
    ``--json``)."""
    spec = model_spec_of(args)
    result = predict_mixed_pool(spec, pool, workload_of(args))
    if args.json:
        print(json.dumps({"model": spec.name, **result.to_dict(), "step": args.step}))
        return 0
    print(header_line(spec, args, str(pool)))
    if result.plan is None:
        print(f"{'roundpipe (mixed)':17s} does not fit the cards: {result.detail}")
    else:
        print(f"{'roundpipe (mixed)':17s} {result.tokens_per_s:10.0f} tokens/s  [{result.detail}]")
        for device, (gpu, peak, budget) in enumerate(
            zip(pool.devices, result.peak_memory, result.budgets, strict=True)
        ):
            print(f"  device {device} {gpu.name:8s} GPU {fit_text(peak <= budget, peak, budget)}")
    slowest = result.as_slowest
    print(
        f"{'as if all ' + result.slowest.name:17s} {slowest.tokens_per_s:10.0f} tokens/s  "
        f"[{pool.size}x {result.slowest.name}: {slowest.detail}]"
    )
    alone = dict(result.card_alone)
    terms = " + ".join(
        f"{count}x {alone[gpu].tokens_per_s:.0f} ({gpu.name})" for gpu, count in pool.kinds
    )
    print(
        f"{'cards alone':17s} {result.cards_alone_tokens_per_s:10.0f} tokens/s  [{terms}]; "
        f"the mixed pool makes {result.fraction_of_cards_alone:.1%} of it"
    )
    return 0
