"""Building RoundPipe models for tests: :func:`pipe_on`, a model on emulated devices."""

from __future__ import annotations

from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig


def pipe_on(model: nn.Module, devices: int, **config) -> RoundPipe:
    """``model`` wrapped on ``devices`` emulated devices with the given run config."""
    return RoundPipe(
        model, devices=f"emulated:{devices}", model_run_config=RoundPipeRunConfig(**config)
    )
