"""The lean setting that fits the host's RAM, when the run's own settings do not.

RoundPipe keeps all training state in host RAM, and three settings trade that RAM for
precision (:mod:`.host_settings`): ``--optimizer-states``, ``--master-weights`` and,
under LoRA, ``--quantize``. When the host RAM does not fit, every combination at least as
lean as the run's in each setting is judged by :func:`.models.memory_fit` (the
prediction's own accounting, with its own plan), and the answer is the one that fits
with the *most* host RAM: the smallest saving that is enough, so the run keeps all the
precision the RAM allows (a tie goes to fewer changed options). When none fits, the
answer is the leanest combination and the RAM it still needs
(docs/design.md#nearest-fit).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import product

from .breakdown import MemoryFit
from .gpus import GIB, Gpu
from .host_settings import MASTER_WEIGHTS, OPTIMIZER_STATES, QUANTIZE, LeanSettings
from .model_specs import ModelSpec
from .models import Workload, memory_fit


@dataclass(frozen=True)
class HostFit:
    """The lean settings to give for the host RAM, and what the run needs with them."""

    settings: LeanSettings
    """The settings that fit; when none does, the leanest there is."""
    host_ram: int
    """Host RAM bytes the run needs with ``settings``."""
    needed: int
    """Host RAM bytes the run needs with its own settings."""
    available: int
    """The host's usable RAM in bytes (the share of it a run may use)."""
    fits: bool
    changed: bool = True
    """``False`` when the run's own settings are already the leanest."""

    @property
    def text(self) -> str:
        head = f"host RAM: {_gib(self.needed)} GiB needed, {_gib(self.available)} GiB usable; "
        if not self.changed:
            return head + "no leaner --optimizer-states, --master-weights or --quantize is left"
        if self.fits:
            return head + f"fits with {self.settings.flags} ({_gib(self.host_ram)} GiB)"
        return head + f"even {self.settings.flags} needs {_gib(self.host_ram)} GiB"

    def to_dict(self) -> dict:
        return {
            "fits": self.fits,
            "flags": self.settings.flags if self.changed else None,
            **self.settings.to_dict(),
            "host_ram": self.host_ram,
            "needed": self.needed,
            "available": self.available,
            "text": self.text,
        }


def lean_fit(
    spec: ModelSpec,
    gpu: Gpu,
    work: Workload,
    num_gpus: int,
    host_ram: int | None,
    memory: MemoryFit,
    adapter_optimizer: bool = True,
) -> HostFit | None:
    """The lean settings that fit the host RAM (the module's rule); ``None`` when
    ``memory`` (the run's own) already fits it, or the RAM is unknown. Without
    ``adapter_optimizer``, a LoRA run's optimizer keeps its settings (``roundpipe
    train`` has none for an adapter's): only its base's quantization moves."""
    if memory.host_fits is not False or memory.host_budget is None:
        return None
    available, needed = memory.host_budget.available, memory.host.total
    candidates = leaner_settings(work.settings, work.precision, work.lora_rank)
    if work.lora_rank and not adapter_optimizer:
        optimizer = (work.settings.optimizer_states, work.settings.master_weights)
        candidates = [c for c in candidates if (c.optimizer_states, c.master_weights) == optimizer]
    if not candidates:
        return HostFit(work.settings, needed, needed, available, fits=False, changed=False)
    judged = []
    for settings in candidates:
        fit = memory_fit(spec, gpu, replace(work, settings=settings), num_gpus, host_ram)
        judged.append((settings, fit.host.total))
    fitting = [(s, total) for s, total in judged if total <= available]
    if fitting:
        settings, total = max(fitting, key=lambda c: (c[1], -_changes(work.settings, c[0])))
        return HostFit(settings, total, needed, available, fits=True)
    settings, total = min(judged, key=lambda c: (c[1], _changes(work.settings, c[0])))
    return HostFit(settings, total, needed, available, fits=False)


def leaner_settings(settings: LeanSettings, precision: str, lora_rank: int) -> list[LeanSettings]:
    """Every combination at least as lean as ``settings`` in each setting, ``settings``
    itself left out: bf16 masters only for a bf16 model, a quantized base only under
    LoRA (what :meth:`LeanSettings.check` allows)."""
    states = OPTIMIZER_STATES[OPTIMIZER_STATES.index(settings.optimizer_states) :]
    masters = MASTER_WEIGHTS[MASTER_WEIGHTS.index(settings.master_weights) :]
    if precision != "bf16":
        masters = (settings.master_weights,)
    quantize = QUANTIZE[QUANTIZE.index(settings.quantize) :] if lora_rank else (settings.quantize,)
    combos = (LeanSettings(*combo) for combo in product(states, masters, quantize))
    return [combo for combo in combos if combo != settings]


def _changes(given: LeanSettings, other: LeanSettings) -> int:
    pairs = zip(given.to_dict().values(), other.to_dict().values(), strict=True)
    return sum(a != b for a, b in pairs)


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.1f}"
