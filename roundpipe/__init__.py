"""roundpipe: fine-tune large models on a few consumer GPUs with round-robin pipelines.

All training state lives in host memory; stage jobs are dispatched round-robin to
a pool of stateless devices (docs/design.md#stateless-devices). This is the public
face; importing it starts no thread and touches no device.
"""

from .cluster import CommOptions, PeerFailure
from .core.config import RoundPipeRunConfig
from .core.plan import Plan, PlanError
from .core.schedule import Job, JobKind, Schedule, lower
from .devices import DevicePool, EmulatedDevicePool, EmulatedOptions, OpInfo, make_pool
from .errors import MixedPoolDropoutError, RoundPipeError
from .hf.loading import from_pretrained
from .hf.pipe import HFRoundPipe, from_hf
from .model import RoundPipe

__all__ = [
    "CommOptions",
    "DevicePool",
    "EmulatedDevicePool",
    "EmulatedOptions",
    "HFRoundPipe",
    "Job",
    "JobKind",
    "MixedPoolDropoutError",
    "OpInfo",
    "PeerFailure",
    "Plan",
    "PlanError",
    "RoundPipe",
    "RoundPipeError",
    "RoundPipeRunConfig",
    "Schedule",
    "from_hf",
    "from_pretrained",
    "lower",
    "make_pool",
]
__version__ = "0.1.0"
