"""``roundpipe simulate --model`` / ``--config``: predict a real model on a GPU preset and
explain it: each schedule's tokens/s and fit, RoundPipe's host RAM and per-GPU memory
term by term (:mod:`.breakdown`), and, when it does not fit, the nearest configuration
that does (:mod:`.nearest`) and the lean host setting that fits the host RAM
(:mod:`.lean_fit`); with ``--quantize nf4``, what the quantized uploads save
(:mod:`.nf4_uploads`); with ``--method dpo|kto``, a preference step's passes
(:mod:`.preference_costs`). Host RAM is judged against ``--host-ram``, else against this
machine's RAM, and the output says which.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from fractions import Fraction

from .breakdown import MemoryFit
from .gpus import GIB, Gpu, gpu_preset
from .host_memory import installed_ram
from .host_settings import MASTER_COPY_BYTES, MASTER_GRADIENT_BYTES, MOMENT_BYTES, LeanSettings
from .lean_fit import HostFit, lean_fit
from .model_costs import adapted_spec
from .model_specs import ModelSpec, model_preset
from .models import Prediction, Workload, max_seq_len, predict
from .nearest import Suggestion, nearest_fit
from .nf4_uploads import UploadSavings, upload_savings
from .nodes import Network, NodesPrediction, predict_nodes, scaling_table
from .preference_costs import PreferenceStep, batch_text, policy_workload, predict_preference
from .unit_costs import HALF

THIS_MACHINE = "this machine"
HOST_RAM_FLAG = "--host-ram"
_ROWS = (
    ("weights", "weights"),
    ("spare", "spare"),
    ("prefetched_weights", "prefetched weights"),
    ("masters", "masters"),
    ("gradients", "gradients"),
    ("optimizer_state", "optimizer state"),
    ("saved_activations", "saved activations"),
    ("pinned_buffers", "pinned buffers"),
    ("total", "total"),
)


def run_model_mode(args: argparse.Namespace, schedules: tuple[str, ...]) -> int:
    spec = model_spec_of(args)
    work = workload_of(args)
    gpu = gpu_preset(args.gpu)
    if args.max_seq_len:
        return _print_longest(args, spec, gpu, work)
    host_ram, source = _host_ram(args)
    if args.nodes is not None or args.scaling:
        return _predict_nodes(args, spec, gpu, work, host_ram, source)
    step = None
    if args.method == "sft":
        predictions = predict(spec, gpu, work, args.gpus, schedules=schedules, host_ram=host_ram)
    else:
        step = predict_preference(spec, gpu, work, args.gpus, args.method, host_ram)
        predictions = [step.prediction()]
    if not args.json:
        print(header_line(spec, args, f"{args.gpus}x {gpu.name}"))
        print(_source_line(host_ram, source, args.host_ram))
        print(settings_line(work.settings))
    for prediction in predictions:
        extras = None
        if prediction.memory is not None:
            extras = _extras(spec, gpu, work, args.gpus, host_ram, prediction.memory, step)
        _print_prediction(prediction, extras, source, args.json, args.step)
    for name in schedules if step is not None else ():
        if name != "roundpipe":
            print_skip(name, f"--method {args.method} is priced for roundpipe only", args.json)
    return 0


def header_line(spec: ModelSpec, args: argparse.Namespace, box: str) -> str:
    """What is predicted: the model, the ``box`` of GPUs it runs on and the workload."""
    active = f", {spec.active_params / 1e9:.2f}B active" if spec.is_moe else ""
    lora = ""
    if args.lora:
        adapted = adapted_spec(spec, workload_of(args))
        experts = ", the routed experts' too" if adapted.expert_adapters else ""
        trained = adapted.lora_params(args.lora) / 1e6
        lora = f", LoRA rank {args.lora}: {trained:.1f}M trained{experts}"
    return (
        f"{spec.name} ({spec.num_params / 1e9:.2f}B params{active}{lora}) on {box} "
        f"({args.precision}), seq {args.seq_len}, batch {batch_text(args.method, args.batch)}"
    )


def _extras(
    spec: ModelSpec,
    gpu: Gpu,
    work: Workload,
    num_gpus: int,
    host_ram: int | None,
    memory: MemoryFit,
    step: PreferenceStep | None,
) -> _Extras:
    """What RoundPipe's row says beside its prediction. A preference step's host fit is
    judged on the policy's rows; its nearest fit and NF4 upload savings are left out (they
    speak of SFT's microbatches and passes)."""
    if step is not None:
        rows = policy_workload(step.method, work)
        host_fit = lean_fit(spec, gpu, rows, num_gpus, host_ram, memory)
        return _Extras(work.settings, None, host_fit, None, step)
    return _Extras(
        work.settings,
        nearest_fit(spec, gpu, work, num_gpus, host_ram, memory),
        lean_fit(spec, gpu, work, num_gpus, host_ram, memory),
        None if memory.plan is None else upload_savings(spec, gpu, work, num_gpus, memory.plan),
    )


@dataclass(frozen=True)
class _Extras:
    """What RoundPipe's row says beside its prediction."""

    settings: LeanSettings
    suggestion: Suggestion | None
    host_fit: HostFit | None
    uploads: UploadSavings | None
    preference: PreferenceStep | None = None

    def to_dict(self) -> dict:
        uploads = self.uploads.to_dict() if self.uploads else dict.fromkeys(_UPLOAD_KEYS)
        return {
            **self.settings.to_dict(),
            "suggestion": None if self.suggestion is None else self.suggestion.to_dict(),
            "host_fit": None if self.host_fit is None else self.host_fit.to_dict(),
            **uploads,
            **({} if self.preference is None else self.preference.to_dict()),
        }

    def lines(self) -> list[str]:
        lines = [] if self.suggestion is None else [f"suggestion: {self.suggestion.text}"]
        if self.host_fit is not None:
            lines.append(self.host_fit.text)
        if self.uploads is not None:
            u = self.uploads
            lines.append(
                f"nf4 uploads: {_gib(u.upload_saved_bytes, 2)} GiB less over PCIe per iteration, "
                f"{u.upload_saved_s:.2f} s less upload (summed over the links), "
                f"{u.dequantize_s:.2f} s of dequantizing on the GPUs"
            )
        return lines


_UPLOAD_KEYS = ("upload_saved_bytes", "upload_saved_s", "dequantize_s")


def lean_settings(args: argparse.Namespace) -> LeanSettings:
    """The host settings the options ask for (``LeanSettings.check`` judges them)."""
    return LeanSettings(args.optimizer_states, args.master_weights, args.quantize)


def settings_line(settings: LeanSettings) -> str:
    """The settings and the host bytes each trained parameter costs with them."""
    terms: dict[str, int | Fraction] = {
        "weights": HALF,
        "spare": HALF,
        "masters": MASTER_COPY_BYTES[settings.master_weights],
        "gradients": MASTER_GRADIENT_BYTES[settings.master_weights],
        "optimizer state": MOMENT_BYTES[settings.optimizer_states],
    }
    sum_text = " + ".join(f"{name} {float(value):g}" for name, value in terms.items())
    base = "nf4 (0.5625 B a linear weight)" if settings.quantize else "model dtype"
    return (
        f"settings: --optimizer-states {settings.optimizer_states} --master-weights "
        f"{settings.master_weights}, frozen base in {base}; host bytes per trained parameter: "
        f"{sum_text} = {float(sum(terms.values())):g}"
    )


def model_spec_of(args: argparse.Namespace) -> ModelSpec:
    if not args.config:
        return model_preset(args.model)
    try:
        config = json.loads(args.config.read_text())
    except OSError as error:
        raise ValueError(f"cannot read the model config {args.config}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"the model config {args.config} is not JSON: {error}") from None
    return ModelSpec.from_config(config)


def workload_of(args: argparse.Namespace) -> Workload:
    """``--microbatches M`` splits the batch into M microbatches (default: one sequence
    each)."""
    count = args.microbatches or args.batch
    if count > args.batch or args.batch % count:
        divisors = [d for d in range(1, args.batch + 1) if args.batch % d == 0]
        raise ValueError(
            f"--microbatches {count} does not split --batch {args.batch} evenly; "
            f"give one of {', '.join(map(str, divisors))}"
        )
    return Workload(
        seq_len=args.seq_len,
        batch=args.batch,
        microbatch_size=args.batch // count,
        mfu=args.mfu,
        precision=args.precision,
        lora_rank=args.lora or 0,
        lora_experts=args.lora_experts,
        host_bandwidth=args.host_bandwidth * 1e9,
        pcie=args.pcie,
        round_size=args.round_size,
        settings=lean_settings(args),
        step=args.step,
    )


def _print_longest(args: argparse.Namespace, spec: ModelSpec, gpu: Gpu, work: Workload) -> int:
    """``--max-seq-len``: the longest sequence and what bounds it; the host RAM is judged
    only against ``--host-ram`` (this machine is rarely the server asked about)."""
    host_ram = int(args.host_ram * GIB) if args.host_ram else None
    longest = max_seq_len(spec, gpu, work, host_ram)
    if args.json:
        print(json.dumps({"model": spec.name, "gpu": gpu.name, **longest.to_dict()}))
        return 0
    print(f"{spec.name} on {gpu.name}: {longest.text()}")
    if host_ram is None:
        print(f"host RAM not judged (give {HOST_RAM_FLAG} for the target server)")
    return 0


def _host_ram(args: argparse.Namespace) -> tuple[int | None, str]:
    """The host RAM to judge against, and where it came from."""
    if args.host_ram:
        return int(args.host_ram * GIB), HOST_RAM_FLAG
    return installed_ram(), THIS_MACHINE


def _source_line(host_ram: int | None, source: str, flag_gib: float | None) -> str:
    if source == HOST_RAM_FLAG:
        return f"host RAM: {_gib_short(host_ram)} GiB ({HOST_RAM_FLAG} {flag_gib:g})"
    if host_ram is None:
        return f"host RAM: unknown on this machine (give {HOST_RAM_FLAG} to judge it)"
    return (
        f"host RAM: this machine's {_gib_short(host_ram)} GiB "
        f"(give {HOST_RAM_FLAG} for the target server)"
    )


def _predict_nodes(
    args, spec: ModelSpec, gpu: Gpu, work: Workload, host_ram: int | None, source: str
) -> int:
    nodes = 1 if args.nodes is None else args.nodes
    network = Network(nodes, args.network_gbps, args.grad_reduce_dtype)
    if args.scaling:
        rows = scaling_table(spec, gpu, work, args.gpus, network, host_ram)
    else:
        rows = [predict_nodes(spec, gpu, work, args.gpus, network, host_ram)]
    if not args.json:
        print(
            f"{spec.name} on nodes of {args.gpus}x {gpu.name} ({args.precision}), "
            f"{args.network_gbps:g} Gb/s, {args.grad_reduce_dtype} gradient reduction, "
            f"seq {args.seq_len}, global batch {args.batch}"
        )
        print(_source_line(host_ram, source, args.host_ram))
        print(settings_line(work.settings))
    for row in rows:
        _print_nodes(row, source, work.settings, args.json)
    return 0


def _print_nodes(p: NodesPrediction, source: str, settings: LeanSettings, as_json: bool) -> None:
    if as_json:
        row = p.to_dict()
        if isinstance(row.get("host_ram"), dict):
            row["host_ram"]["source"] = source
        row.update(settings.to_dict())
        print(json.dumps(row))
        return
    host = (
        "" if p.host_ram_per_node is None else f"  host RAM/node {_gib(p.host_ram_per_node, 1)} GiB"
    )
    print(
        f"{p.nodes:3d} nodes {p.tokens_per_s:9.0f} tokens/s  efficiency {p.scaling_efficiency:6.1%}"
        f"  iteration {p.iteration_time:6.2f} s  comm {p.comm_time:6.2f} s"
        f" ({p.exposed_comm:.2f} s exposed){host}"
    )


def _print_prediction(
    p: Prediction, extras: _Extras | None, source: str, as_json: bool, step: str
) -> None:
    if as_json:
        row = p.to_dict()
        if p.memory is not None:
            row["host_ram"]["source"] = source
        if extras is not None:
            row.update(extras.to_dict())
        row["step"] = step
        print(json.dumps(row))
        return
    longest = "" if p.max_seq_len is None else f"  max seq {p.max_seq_len}"
    if p.memory is not None and p.memory.plan is None:
        print(f"{p.schedule:17s} does not fit the GPUs: {p.detail}{longest}")
    else:
        gpu = fit_text(p.fits, p.gpu_memory, p.gpu_budget)
        host = (
            ""
            if p.host_ram is None or p.host_ram_budget is None
            else f"  host RAM {fit_text(p.host_ram_fits, p.host_ram, p.host_ram_budget)}"
        )
        print(
            f"{p.schedule:17s} {p.tokens_per_s:10.0f} tokens/s  GPU {gpu}{host}{longest}  "
            f"[{p.detail}]"
        )
    if extras is not None and extras.preference is not None:
        for line in extras.preference.lines():
            print(f"  {line}")
    if p.memory is not None:
        for line in memory_table(p.memory):
            print(f"  {line}")
    for line in [] if extras is None else extras.lines():
        print(f"  {line}")


def memory_table(memory: MemoryFit) -> list[str]:
    """RoundPipe's host RAM and fullest GPU term by term, in GiB."""
    host, device = memory.host.to_dict(None), memory.device.to_dict(None)
    title = "memory, GiB" if memory.plan is not None else "memory, GiB (finest plan)"
    lines = [f"{title:26s}{'host RAM':>10s}{'per GPU':>10s}"]
    for key, label in _ROWS:
        cells = [_gib(terms[key], 2) if key in terms else "-" for terms in (host, device)]
        lines.append(f"{label:26s}{cells[0]:>10s}{cells[1]:>10s}")
    budgets = [memory.host_budget, memory.gpu]
    usable = [_gib(b.available, 2) if b else "-" for b in budgets]
    shares = ", ".join(
        f"{b.usable_fraction:.0%} of {_gib_short(b.capacity)} GiB" for b in budgets if b
    )
    lines.append(f"{'usable':26s}{usable[0]:>10s}{usable[1]:>10s}  ({shares})")
    return lines


def print_skip(name: str, reason: str, as_json: bool) -> None:
    """A schedule left out, and why (its own JSON object under ``--json``)."""
    if as_json:
        print(json.dumps({"schedule": name, "skipped": reason}))
    else:
        print(f"{name:17s} skipped: {reason}")


def fit_text(fits: bool | None, need: int, budget: int | None) -> str:
    if budget is None:
        return f"needs {_gib(need, 1)} GiB"
    verdict = "fits" if fits else "does not fit"
    return f"{verdict}: needs {_gib(need, 1)} GiB of {_gib(budget, 1)} GiB"


def _gib(num_bytes: int, digits: int) -> str:
    return f"{num_bytes / GIB:.{digits}f}"


def _gib_short(num_bytes: int | None) -> str:
    return f"{round((num_bytes or 0) / GIB, 1):g}"
