"""Activation uploads are not stuck behind weight prefetch, on FIFO copy engines.

The emulated host-to-device link is one copy engine serving ready copies in issue
order (0.25 GB/s here); stream priorities do not exist. While device 0 runs stage 1
it prefetches stage 2's 64 MB of weights; stage 1's 2 MB activation uploads get
ahead only because the runtime issues weight chunks one at a time, each behind the
activation uploads pending when it is issued. Stage 1's forward is given a modelled
kernel time, so its uploads (each issued once the compute two microbatches back has
run) are spread over the prefetch whatever the load on the machine.

What the gating guarantees is counted, not timed: a copy engine runs one copy at a
time, so the weight chunks an activation upload waited for are the chunk spans that
overlap its own span. A busy machine stretches spans (an op ends no earlier than its
closure ran), never the count. It may delay the prefetch thread until stage 1's
uploads are over, though: then nothing was contended, and the run is repeated.
"""

from __future__ import annotations

import torch
from torch import nn

from roundpipe import EmulatedOptions, RoundPipe, RoundPipeRunConfig

GBPS = 0.25
ACT_BYTES = 512 * 1024 * 4  # one microbatch: 512 rows of 1024 floats
OWN_TIME = ACT_BYTES / (GBPS * 1e9)
STAGE_1_FORWARD_S = 0.03  # per microbatch: 6 of them span most of the 268 ms prefetch


def kernel_time(info) -> float:
    return STAGE_1_FORWARD_S if info.kind == "forward" and info.layers == (1,) else 0.0


class Table(nn.Module):
    """``rows`` x 1024 weights but almost no compute, so only transfers are measured
    (real compute would compete with the transfer threads for the 2 CPU cores)."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(rows, 1024))

    def forward(self, x):
        return x + self.table[0]


def model():
    torch.manual_seed(0)
    return nn.Sequential(Table(1), Table(1), Table(16384))  # the last one holds 64 MB


def upload_spans(gate: bool, chunk_bytes: int | None, tries: int = 4) -> tuple[list, list]:
    """The activation uploads of stage 1 and the chunk uploads of stage 2's weights, as
    timeline spans, of a run where one of each were on the link at once."""
    for _ in range(tries):
        activations, chunks = _upload_spans(gate, chunk_bytes)
        if any(chunks_waited_for(a, chunks) for a in activations):
            return activations, chunks
    raise AssertionError(f"in {tries} runs the prefetch never overlapped stage 1's uploads")


def _upload_spans(gate: bool, chunk_bytes: int | None) -> tuple[list, list]:
    config = RoundPipeRunConfig(
        num_microbatch=6,
        execute_plan="1,1|1,1,1",
        weight_chunk_bytes=chunk_bytes,
        gate_weight_chunks=gate,
    )
    options = EmulatedOptions(h2d_gbps=GBPS, kernel_time=kernel_time)
    x = torch.randn(6 * 512, 1024)
    with RoundPipe(
        model(), devices="emulated:1", model_run_config=config, emulated_options=options
    ) as pipe:
        pipe.start_timeline()
        with torch.no_grad():
            out = pipe(x)
        spans = pipe.timeline().spans
    torch.testing.assert_close(out, model()(x), rtol=0, atol=0)
    uploads = [s for s in spans if s.kind == "upload"]
    activations = [s for s in uploads if s.label.startswith("act 1 ")]
    chunks = [s for s in uploads if s.label.startswith("weights ") and "(layers 2-2)" in s.label]
    return activations, chunks


def activation_upload_latencies(gate: bool, chunk_bytes: int | None) -> list[float]:
    return [span.duration for span in upload_spans(gate, chunk_bytes)[0]]


def chunks_waited_for(activation, chunks) -> int:
    return sum(c.start < activation.end and activation.start < c.end for c in chunks)


def test_an_activation_upload_waits_for_at_most_one_weight_chunk():
    activations, chunks = upload_spans(gate=True, chunk_bytes=ACT_BYTES)
    assert len(activations) == 6 and len(chunks) > 30
    assert max(chunks_waited_for(a, chunks) for a in activations) <= 1


def test_without_gating_an_activation_waits_for_the_chunks_issued_before_it():
    latencies = activation_upload_latencies(gate=False, chunk_bytes=ACT_BYTES)
    assert max(latencies) > 10 * OWN_TIME


def test_without_chunking_an_activation_waits_for_the_whole_prefetch():
    latencies = activation_upload_latencies(gate=True, chunk_bytes=None)
    assert max(latencies) > 10 * OWN_TIME
