"""``roundpipe simulate``: the subcommand's parser and its run, from options to printed
results (exit code 0; bad values raise ``ValueError``, which the command line turns into
exit code 2). Synthetic mode simulates uniform layers (:mod:`roundpipe.planning.sim`);
model-level mode predicts a real model on a GPU preset and explains it (:mod:`.model_mode`)."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..core.plan import Plan, PlanError
from ..errors import install_hint, one_line_usage_errors
from ..planning.partition import auto_plan, step_objective
from ..planning.sim.baselines import BASELINES, simulate_baseline
from ..planning.sim.costs import CostModel, LayerCosts
from ..planning.sim.result import SimResult
from ..planning.sim.roundpipe_schedule import simulate_roundpipe
from .gpus import GPU_PRESETS, PCIE_BANDWIDTH, PRECISIONS
from .host_settings import MASTER_WEIGHTS, OPTIMIZER_STATES, QUANTIZE
from .mixed_pool import (
    DEFAULT_GPU,
    check_mixed_options,
    gpus_option,
    resolve_pool,
    run_mixed_pool,
)
from .model_mode import lean_settings, print_skip, run_model_mode
from .model_specs import MODEL_PRESETS
from .models import DEFAULT_HOST_BANDWIDTH
from .nodes import GRAD_BYTES
from .preference_costs import METHODS

SCHEDULES = ("roundpipe", *BASELINES)
STEPS = ("async", "sync")
_MS = 1e-3

DESCRIPTION = """\
Simulate RoundPipe and weight-bound pipeline baselines, in one of two modes.

Synthetic: --layers L --fwd-ms F --bwd-ms B --head-fwd-ms HF --head-bwd-ms HB
  --comm-ms C describe L identical transformer layers plus an LM head, and every
  chosen schedule is simulated for --gpus N and --microbatches M.

Model-level: --model Qwen3-8B (or --config config.json) with --gpu rtx4090
  --seq-len 4096 --batch 16 predicts tokens/s, per-GPU memory and host RAM, and
  whether each fits (--lora R, --precision, --pcie, --host-ram, --host-bandwidth;
  the host's lean settings --optimizer-states, --master-weights, --quantize nf4,
  and which of them fits when the host RAM does not);
  --max-seq-len answers only the longest sequence that fits (tiled layers where
  roundpipe tiles the model's) and what bounds it; --nodes K
  --network-gbps G predicts RoundPipe on K such boxes (data parallel), --scaling for
  K = 1, 2, 4, ... 64. --method dpo|kto prices a preference step (RoundPipe only):
  the policy's forward+backward plus its forward-only reference (and KTO's KL) passes.

Mixed pool: --model ... --gpus rtx4090x4,rtx3090x4 prices each kind of card's layers
  from its own FLOP/s and memory bandwidth, plans every stage for the card that runs it
  and prints RoundPipe's plan, tokens/s and each device's memory, beside the same pool as
  if every card were the slowest and beside the sum of each card alone (links at the
  slowest card's PCIe unless --pcie; no baselines, --nodes, --max-seq-len or --method).
"""


def add_simulate_parser(commands: Any) -> argparse.ArgumentParser:
    """Register ``simulate`` on the ``roundpipe`` command's subparsers."""
    sim = commands.add_parser(
        "simulate",
        help="simulate RoundPipe and weight-bound baselines",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    one_line_usage_errors(sim)
    sim.add_argument("--schedule", choices=(*SCHEDULES, "all"), default="all")
    sim.add_argument(
        "--gpus",
        type=gpus_option,
        default=8,
        help="number of devices N, or a box of GPU presets NAMExCOUNT (rtx4090x4,rtx3090x4; "
        "devices 0.. are the first kind's): one kind is --gpu NAME --gpus COUNT; a mixed "
        "pool needs a model and predicts roundpipe beside the pool as if every card were "
        "the slowest and beside the sum of each card alone",
    )
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
    sim.add_argument(
        "--step",
        choices=STEPS,
        default="async",
        help="optimizer steps: async (iterations overlap; the automatic plan minimises, "
        "and RoundPipe reports, the steady state) or sync (each iteration stands alone: "
        "one isolated iteration until its step is done)",
    )
    sim.add_argument("--json", action="store_true", help="one JSON object per schedule")
    sim.add_argument("--trace", type=Path, help="Chrome trace JSON (per schedule if several)")
    sim.add_argument("--gantt", type=Path, help="Gantt chart PNG (per schedule if several)")
    sim.add_argument("--no-recompute", action="store_true", help="baselines stash activations")
    sim.add_argument("--chunks", type=int, default=2, help="virtual stages per GPU (interleaved)")
    model = sim.add_argument_group(
        "model-level mode (will it fit, how fast, against what)",
        "Calibrated against the published RoundPipe measurements (bench/README.md).",
    )
    model.add_argument(
        "--model", help=f"preset: {', '.join(s.name for s in MODEL_PRESETS.values())}"
    )
    model.add_argument(
        "--config",
        type=Path,
        help="a Hugging Face config.json (dense, MoE, MLA, hybrid; a VLM's text model)",
    )
    model.add_argument("--gpu", help=f"preset: {', '.join(GPU_PRESETS)} (default {DEFAULT_GPU})")
    model.add_argument("--precision", choices=PRECISIONS, default="bf16")
    model.add_argument("--pcie", type=int, choices=sorted(PCIE_BANDWIDTH), help="PCIe generation")
    model.add_argument(
        "--host-bandwidth",
        type=float,
        default=DEFAULT_HOST_BANDWIDTH / 1e9,
        help="host memory GB/s shared by all copies and the CPU optimizer",
    )
    model.add_argument(
        "--host-ram", type=float, help="host RAM in GiB (default: this machine's installed RAM)"
    )
    model.add_argument("--seq-len", type=int, default=4096)
    model.add_argument("--batch", type=int, default=16, help="sequences per iteration")
    model.add_argument("--lora", type=int, metavar="R", help="train rank-R LoRA adapters only")
    model.add_argument(
        "--no-lora-experts",
        dest="lora_experts",
        action="store_false",
        help="with --lora: no adapters on the routed experts and router (peft 0.22's "
        "all-linear adds them to the mixtures of experts transformers v5 stacks, e.g. "
        "Qwen3-MoE, DeepSeek, GLM; roundpipe train --lora-targets without gate_proj, "
        "up_proj and down_proj leaves them)",
    )
    model.add_argument(
        "--optimizer-states",
        choices=OPTIMIZER_STATES,
        default="fp32",
        help="AdamW's moments on the host: 8, 4 or ~2 bytes per trained parameter",
    )
    model.add_argument(
        "--master-weights",
        choices=MASTER_WEIGHTS,
        default="fp32",
        help="fp32 masters, or the bf16 model's own weights as masters (--precision bf16)",
    )
    model.add_argument(
        "--quantize",
        choices=[q for q in QUANTIZE if q],
        help="with --lora: the frozen base's linear weights in NF4 (~0.56 bytes each)",
    )
    model.add_argument(
        "--mfu", type=float, help="override the calibrated matmul efficiency, in (0, 1]"
    )
    model.add_argument(
        "--method",
        choices=METHODS,
        default="sft",
        help="what a step trains: sft; dpo (--batch pairs: the policy over both sequences of "
        "each, and a forward-only reference pass); kto (--batch examples: the policy, a "
        "forward-only KL pass and a reference pass over the examples and their KL rows)",
    )
    model.add_argument(
        "--max-seq-len",
        action="store_true",
        help="only the longest sequence that fits at batch 1 (every layer's input saved, "
        "MLPs and norms tiled for the families roundpipe tiles), what bounds it and the "
        "host RAM it needs (judged against --host-ram when given)",
    )
    nodes = sim.add_argument_group(
        "across nodes (model-level, RoundPipe only)",
        "Data parallelism over K boxes of --gpus GPUs; --batch is the global batch and "
        "must be a multiple of K.",
    )
    nodes.add_argument("--nodes", type=int, metavar="K", help="boxes joined by a network")
    nodes.add_argument(
        "--network-gbps", type=float, default=100.0, help="Gb/s per node, full duplex"
    )
    nodes.add_argument(
        "--grad-reduce-dtype", choices=tuple(GRAD_BYTES), default="fp32", help="gradient wire dtype"
    )
    nodes.add_argument("--scaling", action="store_true", help="table for K = 1, 2, 4, ... 64")
    sim.set_defaults(run=run_simulate)
    return sim


def run_simulate(args: argparse.Namespace) -> int:
    """The ``simulate`` subcommand: print every chosen schedule's simulation or prediction."""
    args, pool = resolve_pool(args)
    _validate(args)
    if pool is not None:
        check_mixed_options(args, pool)
        return run_mixed_pool(args, pool)
    names = SCHEDULES if args.schedule == "all" else (args.schedule,)
    if args.model or args.config:
        return run_model_mode(args, names)
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
            print_skip(name, str(unsupported), args.json)
            continue
        _print_result(result, args.json, args.step)
        _export(result, args, several=len(names) > 1)
    return 0


def _run_schedule(name: str, costs: CostModel, args, microbatches: int) -> SimResult:
    partition = args.partition
    if name == "roundpipe":
        if partition and "|" in partition:
            plan = _roundpipe_plan(partition)
        else:
            plan = auto_plan(
                costs,
                args.gpus,
                microbatches,
                round_size=args.round_size,
                objective=step_objective(args.step == "async"),
            )
        result = simulate_roundpipe(
            plan,
            costs,
            args.gpus,
            microbatches,
            round_size=args.round_size,
            is_async=args.step == "async",
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
    return plan.with_sizes(plan.forward, (plan.backward[0] + 1, *plan.backward[1:]))


def _cli_partition(plan: Plan) -> str:
    """The inverse of :func:`_roundpipe_plan`: how ``--partition`` would spell ``plan``."""
    return str(plan.with_sizes(plan.forward, (plan.backward[0] - 1, *plan.backward[1:])))


LIMITS = {"--gpus": 512, "--layers": 512, "--microbatches": 4096, "--round-size": 4096,
          "--chunks": 64, "--nodes": 1024}  # fmt: skip
"""The largest counts ``simulate`` takes: beyond them a simulation runs for minutes or
exhausts memory (``--layers 2000`` takes about two minutes)."""


def _validate(args: argparse.Namespace) -> None:
    """Exit 2 with a message on values no simulation can use."""
    positive = {
        "--gpus": args.gpus,
        "--microbatches": args.microbatches,
        "--layers": args.layers,
        "--round-size": args.round_size,
        "--chunks": args.chunks,
        "--seq-len": args.seq_len,
        "--batch": args.batch,
        "--lora": args.lora,
        "--host-ram": args.host_ram,
        "--host-bandwidth": args.host_bandwidth,
        "--nodes": args.nodes,
        "--network-gbps": args.network_gbps,
    }
    costs = {"--fwd-ms": args.fwd_ms, "--bwd-ms": args.bwd_ms, "--head-fwd-ms": args.head_fwd_ms,
             "--head-bwd-ms": args.head_bwd_ms, "--comm-ms": args.comm_ms}  # fmt: skip
    for flag, value in {**positive, **costs, "--mfu": args.mfu}.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{flag} must be a finite number, got {value}")
    for flag, value in positive.items():
        if value is not None and value <= 0:
            raise ValueError(f"{flag} must be positive, got {value}")
    for flag, value in costs.items():
        if value < 0:
            raise ValueError(f"{flag} must be zero or more, got {value}")
    for flag, most in LIMITS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and value > most:
            raise ValueError(
                f"{flag} {value} is more than the simulator steps through in reasonable time "
                f"(at most {most}: every op of every microbatch is simulated)"
            )
    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise ValueError(f"--mfu is a fraction of peak FLOP/s in (0, 1], got {args.mfu}")
    if args.model and args.config:
        raise ValueError("give --model or --config, not both")
    if args.step != "async" and (args.nodes is not None or args.scaling):
        raise ValueError(
            "--step sync is not modelled across nodes (--nodes, --scaling): their "
            "predictions are of asynchronous steps"
        )
    lean_settings(args).check(args.precision, args.lora or 0)
    if args.method != "sft":
        _check_method(args)
    if args.gantt:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError(f"--gantt needs matplotlib: {install_hint('plot')}") from None


def _check_method(args: argparse.Namespace) -> None:
    """A preference step is priced for a model on one box at the given sequence length."""
    if not (args.model or args.config):
        raise ValueError(
            f"--method {args.method} needs a model: give --model or --config (synthetic "
            "layers have no sequences to pair)"
        )
    for flag, given in (
        ("--max-seq-len", args.max_seq_len),
        ("--nodes", args.nodes is not None),
        ("--scaling", args.scaling),
    ):
        if given:
            raise ValueError(
                f"--method {args.method} is priced on one box at --seq-len: drop {flag} "
                "(or use --method sft)"
            )


def _print_result(result: SimResult, as_json: bool, step: str) -> None:
    if as_json:
        print(json.dumps({**result.to_dict(), "step": step}))
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


def _export(result: SimResult, args: argparse.Namespace, several: bool) -> None:
    title = f"{result.schedule}: {result.detail}"
    if args.trace:
        result.timeline.save_chrome_trace(_per_schedule(args.trace, result.schedule, several))
    if args.gantt:
        result.timeline.save_gantt(_per_schedule(args.gantt, result.schedule, several), title)


def _per_schedule(path: Path, schedule: str, several: bool) -> Path:
    return path.with_name(f"{path.stem}.{schedule}{path.suffix}") if several else path
