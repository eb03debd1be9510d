"""A failure inside a checkpointed piece (the head's chunked loss, a tiled layer's piece)
leaves the worker's thread as it found it. torch.utils.checkpoint before torch 2.13
leaves its saved-tensor hooks pushed on the thread when the checkpointed function
raises, and every later backward of that thread then routes its saved tensors through
the dead frame (a spurious failure, or a wrong gradient): the next call must equal a
fresh pipe's, bit for bit, whatever the torch version."""

from __future__ import annotations

import pytest
import torch
from support.hf_families import build, padded_batch

import roundpipe
from roundpipe.core.config import RoundPipeRunConfig
from roundpipe.hf import long_context


def run(pipe) -> tuple[float, dict[str, torch.Tensor]]:
    loss = pipe.forward_backward(input_kwargs=padded_batch(seed=1))
    pipe.synchronize()
    grads = {name: p.grad.clone() for name, p in pipe.optim_named_parameters()}
    pipe.zero_grad()
    return float(loss), grads


def failing_once(monkeypatch, name: str) -> list[int]:
    original, calls = getattr(long_context, name), []

    def fails_first(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected failure inside the checkpoint")
        return original(*args, **kwargs)

    monkeypatch.setattr(long_context, name, fails_first)
    return calls


@pytest.mark.parametrize(
    ("piece", "config"),
    [
        ("_piece_loss", None),
        ("_run_piece", RoundPipeRunConfig(seq_chunk_tokens=4)),
    ],
    ids=["chunked-loss", "tiled-layer"],
)
def test_a_failure_inside_a_checkpoint_leaves_the_next_call_as_a_fresh_pipes(
    monkeypatch, piece, config
):
    # one device: the failed call and the next run on the same worker threads
    options = dict(devices="emulated:1", model_run_config=config)
    with roundpipe.from_hf(build("llama"), **options) as fresh:
        want = run(fresh)
    with roundpipe.from_hf(build("llama"), **options) as pipe:
        calls = failing_once(monkeypatch, piece)
        with pytest.raises(RuntimeError, match="injected failure"):
            pipe.forward_backward(input_kwargs=padded_batch(seed=0))
        assert calls, "the injected failure never ran"
        pipe.zero_grad()
        got = run(pipe)
    assert got[0] == want[0]
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        assert torch.equal(got[1][name], want[1][name]), name
