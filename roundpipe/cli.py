"""The ``roundpipe`` command line: ``roundpipe simulate ...`` and ``roundpipe train ...``
(the latter in :mod:`roundpipe.train.command`).

Two modes of ``simulate``:

- synthetic: ``--layers L --fwd-ms F --bwd-ms B --head-fwd-ms HF --head-bwd-ms HB
  --comm-ms C`` describe L identical transformer layers plus an LM head, and every
  chosen schedule is simulated for ``--gpus N`` and ``--microbatches M``;
- model-level: ``--model Qwen3-8B`` (or ``--config config.json``) with ``--gpu
  rtx4090 --seq-len 4096 --batch 16`` predicts tokens/s, per-GPU memory and host RAM.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from .partition import auto_plan
from .plan import Plan, PlanError
from .predict import MODEL_PRESETS, ModelSpec, Prediction, Workload, model_preset, predict
from .sim.baselines import BASELINES, simulate_baseline
from .sim.costs import HARDWARE_PRESETS, CostModel, LayerCosts, hardware
from .sim.result import SimResult
from .sim.roundpipe_schedule import simulate_roundpipe
from .train.command import add_train_parser

SCHEDULES = ("roundpipe", *BASELINES)
_MS = 1e-3


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, PlanError) as error:
        parser.exit(2, f"roundpipe: error: {error}\n")
    return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="roundpipe", description="RoundPipe tools.")
    commands = parser.add_subparsers(dest="command", required=True)
    sim = commands.add_parser(
        "simulate",
        help="simulate RoundPipe and weight-bound baselines",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sim.add_argument("--schedule", choices=(*SCHEDULES, "all"), default="all")
    sim.add_argument("--gpus", type=int, default=8, help="number of devices N")
    sim.add_argument("--microbatches", type=int, help="microbatches per iteration M")
    sim.add_argument("--layers", type=int, default=32, help="transformer layers L")
    sim.add_argument("--fwd-ms", type=float, default=1.0, help="layer forward, per microbatch")
    sim.add_argument("--bwd-ms", type=float, default=2.0, help="layer backward (no recompute)")
    sim.add_argument("--head-fwd-ms", type=float, default=3.0, help="LM head + loss forward")
    sim.add_argument("--head-bwd-ms", type=float, default=6.0, help="LM head + loss backward")
    sim.add_argument("--comm-ms", type=float, default=0.0, help="transfer per stage boundary")
    sim.add_argument("--round-size", type=int, help="RoundPipe microbatches per round (N)")
    sim.add_argument(
        "--partition",
        help="RoundPipe: 'fwd,...|bwd,...' (first bwd entry = layers fused with the head, "
        "may be 0); baselines: layers per (virtual) stage, the head joins the last one. "
        "Applied to the schedules it fits; the others get their best partition",
    )
    sim.add_argument("--json", action="store_true", help="one JSON object per schedule")
    sim.add_argument("--trace", type=Path, help="Chrome trace JSON (per schedule if several)")
    sim.add_argument("--gantt", type=Path, help="Gantt chart PNG (per schedule if several)")
    sim.add_argument("--no-recompute", action="store_true", help="baselines stash activations")
    sim.add_argument("--chunks", type=int, default=2, help="virtual stages per GPU (interleaved)")
    model = sim.add_argument_group("model-level mode (predict tokens/s and memory)")
    model.add_argument(
        "--model", help=f"preset: {', '.join(s.name for s in MODEL_PRESETS.values())}"
    )
    model.add_argument("--config", type=Path, help="a Hugging Face config.json")
    model.add_argument("--gpu", default="rtx4090", help=f"preset: {', '.join(HARDWARE_PRESETS)}")
    model.add_argument("--seq-len", type=int, default=4096)
    model.add_argument("--batch", type=int, default=16, help="sequences per iteration")
    model.add_argument("--mfu", type=float, default=0.6, help="fraction of peak FLOP/s reached")
    sim.set_defaults(run=_simulate)
    add_train_parser(commands)
    return parser


def _simulate(args: argparse.Namespace) -> int:
    if args.model or args.config:
        return _predict(args)
    names = SCHEDULES if args.schedule == "all" else (args.schedule,)
    costs = CostModel(
        LayerCosts.uniform(
            args.layers,
            args.fwd_ms * _MS,
            args.bwd_ms * _MS,
            args.head_fwd_ms * _MS,
            args.head_bwd_ms * _MS,
        ),
        comm=args.comm_ms * _MS,
    )
    microbatches = args.microbatches or args.gpus
    for name in names:
        try:
            result = _run_schedule(name, costs, args, microbatches)
        except ValueError as unsupported:
            if len(names) == 1:
                raise
            _print_skip(name, str(unsupported), args.json)
            continue
        _print_result(result, args.json)
        _export(result, args, several=len(names) > 1)
    return 0


def _run_schedule(name: str, costs: CostModel, args, microbatches: int) -> SimResult:
    partition = args.partition
    if name == "roundpipe":
        if partition and "|" in partition:
            plan = _roundpipe_plan(partition)
        else:
            plan = auto_plan(costs, args.gpus, microbatches, round_size=args.round_size)
        result = simulate_roundpipe(
            plan, costs, args.gpus, microbatches, round_size=args.round_size
        )
        return replace(result, detail=f"partition {_cli_partition(plan)}, {result.detail}")
    sizes = None
    chunks = args.chunks if name in ("interleaved-1f1b", "looped-bfs") else 1
    if partition and "|" not in partition:
        layer_sizes = [int(n) for n in partition.split(",")]
        if len(layer_sizes) == args.gpus * chunks:
            sizes = [*layer_sizes[:-1], layer_sizes[-1] + 1]  # the head joins the last stage
    return simulate_baseline(
        name,
        costs,
        args.gpus,
        microbatches,
        stage_sizes=sizes,
        chunks=args.chunks,
        recompute=not args.no_recompute,
    )


def _roundpipe_plan(text: str) -> Plan:
    """``--partition`` counts transformer layers; the simulator's head is one more unit."""
    plan = Plan.parse(text)
    if not plan.backward:
        raise PlanError(f"the partition {text!r} has no backward stages")
    return Plan(plan.forward, (plan.backward[0] + 1, *plan.backward[1:]))


def _cli_partition(plan: Plan) -> str:
    """The inverse of :func:`_roundpipe_plan`: how ``--partition`` would spell ``plan``."""
    return str(Plan(plan.forward, (plan.backward[0] - 1, *plan.backward[1:])))


def _predict(args: argparse.Namespace) -> int:
    if args.config:
        spec = ModelSpec.from_config(json.loads(args.config.read_text()), args.config.stem)
    else:
        spec = model_preset(args.model)
    names = SCHEDULES if args.schedule == "all" else (args.schedule,)
    work = Workload(seq_len=args.seq_len, batch=args.batch, mfu=args.mfu)
    gpu = hardware(args.gpu)
    predictions = predict(spec, gpu, work, args.gpus, schedules=names)
    if not args.json:
        print(
            f"{spec.name} ({spec.num_params / 1e9:.2f}B params) on {args.gpus}x {gpu.name}, "
            f"seq {args.seq_len}, batch {args.batch}, mfu {args.mfu}"
        )
    for prediction in predictions:
        _print_prediction(prediction, args.json)
    return 0


def _print_result(result: SimResult, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result.to_dict()))
        return
    b = result.bubbles
    steady = result.steady_bubble_ratio
    print(
        f"{result.schedule:17s} makespan {result.makespan / _MS:9.2f} ms  "
        f"iteration {(result.iteration_time or result.makespan) / _MS:9.2f} ms  "
        f"bubble {b.total:6.1%} (fill {b.fill:5.1%} switch {b.switch:5.1%} "
        f"drain {b.drain:5.1%} steady {b.steady:5.1%})  "
        f"steady-state bubble {steady if steady is None else format(steady, '6.1%')}  "
        f"exposed comm {result.exposed_comm / _MS:.2f} ms  [{result.detail}]"
    )


def _print_prediction(p: Prediction, as_json: bool) -> None:
    if as_json:
        print(json.dumps(p.to_dict()))
        return
    host = "-" if p.host_ram is None else f"{p.host_ram / 2**30:.1f} GiB"
    print(
        f"{p.schedule:17s} {p.tokens_per_s:10.0f} tokens/s  GPU {p.gpu_memory / 2**30:6.1f} GiB "
        f"{'fits' if p.fits else 'DOES NOT FIT'}  host RAM {host}  [{p.detail}]"
    )


def _print_skip(name: str, reason: str, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"schedule": name, "skipped": reason}))
    else:
        print(f"{name:17s} skipped: {reason}")


def _export(result: SimResult, args: argparse.Namespace, several: bool) -> None:
    title = f"{result.schedule}: {result.detail}"
    if args.trace:
        result.timeline.save_chrome_trace(_per_schedule(args.trace, result.schedule, several))
    if args.gantt:
        result.timeline.save_gantt(_per_schedule(args.gantt, result.schedule, several), title)


def _per_schedule(path: Path, schedule: str, several: bool) -> Path:
    return path.with_name(f"{path.stem}.{schedule}{path.suffix}") if several else path


if __name__ == "__main__":
    sys.exit(main())
