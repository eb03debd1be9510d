"""``roundpipe env``: what a bug report needs to say about the machine — the versions of
roundpipe, Python, torch (and its CUDA) and the libraries ``roundpipe train`` uses, the
GPUs torch sees and the host RAM — as aligned text or, with ``--json``, one JSON object
(``null`` where the text says "none" or "not installed").

Libraries are looked up, not imported (only torch is, for its GPUs), so a missing or
broken optional package is reported rather than failing the command.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import platform
from typing import Any

from ..predict.host_memory import installed_ram, usable_ram

DISTRIBUTION = "roundpipe-ft"
"""The name roundpipe is installed under (pyproject.toml's ``[project] name``)."""
LIBRARIES = ("transformers", "peft", "safetensors", "accelerate", "bitsandbytes", "torchao")
"""The libraries reported after torch: what ``train`` needs, then its optional backends."""
GIB = 2**30


def add_env_parser(commands: Any) -> argparse.ArgumentParser:
    """Register ``env`` on the ``roundpipe`` command's subparsers."""
    parser = commands.add_parser(
        "env",
        help="versions, GPUs and host RAM of this machine, for bug reports",
        description="Print the versions of roundpipe, Python, torch, CUDA and the libraries "
        "roundpipe uses, the GPUs torch sees and the host RAM: paste it into a bug report.",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object instead of text")
    parser.set_defaults(run=run_env)
    return parser


def run_env(args: argparse.Namespace) -> int:
    """The ``env`` subcommand: prints the report, returns 0."""
    report = environment()
    print(json.dumps(report, indent=2) if args.json else environment_text(report))
    return 0


def roundpipe_version() -> str:
    """The installed distribution's version, else the package's ``__version__``."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        from roundpipe import __version__

        return __version__


def environment() -> dict[str, Any]:
    """The report as plain values: versions (``None``: not installed), ``gpus`` (a list
    of ``{"index", "name", "memory_gib"}``) and ``host_ram_gib``."""
    torch_version, cuda_version, gpus = _torch_and_gpus()
    return {
        "roundpipe": roundpipe_version(),
        "python": f"{platform.python_version()} ({platform.python_implementation()})",
        "platform": platform.platform(),
        "torch": torch_version,
        "cuda": cuda_version,
        **{name: library_version(name) for name in LIBRARIES},
        "gpus": gpus,
        "host_ram_gib": host_ram_gib(),
    }


def environment_text(report: dict[str, Any]) -> str:
    """``report`` as two aligned columns."""
    rows: list[tuple[str, str]] = []
    for key, value in report.items():
        if key == "gpus":
            rows.append(("gpus", str(len(value)) if value else "no CUDA GPU"))
            rows += [
                (f"gpu {gpu['index']}", f"{gpu['name']}, {gpu['memory_gib']:.1f} GiB")
                for gpu in value
            ]
        elif key == "host_ram_gib":
            rows.append(("host RAM", _ram_text(value)))
        elif value is None:
            rows.append((key, "none" if key == "cuda" else "not installed"))
        else:
            rows.append((key, value))
    width = max(len(label) for label, _ in rows) + 2
    return "\n".join(f"{label:<{width}}{value}" for label, value in rows)


def library_version(name: str) -> str | None:
    """The installed version of the importable package ``name`` (its distribution of the
    same name), "unknown" where it has no metadata, ``None`` where it is not installed."""
    try:
        if importlib.util.find_spec(name) is None:
            return None
    except ValueError:  # imported already, by a loader that left no __spec__
        pass
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def host_ram_gib() -> dict[str, Any]:
    """``installed`` host RAM and the ``usable`` RAM this process may still allocate
    (the least of MemAvailable, cgroup limits and ``RLIMIT_AS``, which ``bound`` names),
    in GiB; ``None`` for what this system does not say
    (:mod:`roundpipe.predict.host_memory`)."""
    installed, room = installed_ram(), usable_ram()
    return {
        "installed": None if installed is None else round(installed / GIB, 2),
        "usable": None if room is None else round(room.bytes / GIB, 2),
        "bound": None if room is None else room.bound,
    }


def _ram_text(ram: dict[str, float | None]) -> str:
    parts = [f"{ram[kind]:.1f} GiB {kind}" for kind in ("installed", "usable") if ram[kind]]
    if ram["usable"] is not None:
        parts[-1] += f" (bounded by {ram['bound']})"
    return ", ".join(parts) or "unknown"


def _torch_and_gpus() -> tuple[str | None, str | None, list[dict[str, Any]]]:
    """torch's version, its CUDA version and the GPUs it sees (``None``, ``None``, ``[]``
    without torch)."""
    if library_version("torch") is None:
        return None, None, []
    import torch

    gpus = []
    for index in range(torch.cuda.device_count()):
        properties = torch.cuda.get_device_properties(index)
        gpus.append(
            {
                "index": index,
                "name": properties.name,
                "memory_gib": round(properties.total_memory / GIB, 2),
            }
        )
    return torch.__version__, torch.version.cuda, gpus
