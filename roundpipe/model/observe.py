"""What a RoundPipe model lets you watch: the ops it ran (timelines) and the device
memory it holds (the figures ``torch.cuda`` reports for one GPU, for every device)."""

from __future__ import annotations

import time

from ..core.timeline import HOST, Span, Timeline
from .parts import PipeParts


class Observation(PipeParts):
    """Timelines and device memory of a :class:`~roundpipe.RoundPipe` (a mixin: it
    reads the model's ``pool``, ``node`` and ``synchronize``)."""

    # -- timelines ------------------------------------------------------------------------

    def start_timeline(self) -> None:
        """Record every executed device op from now on (see :meth:`timeline`)."""
        self.synchronize()
        self.pool.start_recording()
        if self.node is not None:
            self.node.comm.spans = []
        self._timeline_origin = time.perf_counter()

    def timeline(self) -> Timeline:
        """Wait for queued work; the ops run since :meth:`start_timeline`, as a Timeline.

        Export it with ``save_chrome_trace(path)`` (Perfetto) or ``save_gantt(path)``.
        On several nodes, the gradient and weight collectives appear as host spans of
        kind ``"comm"`` on stream ``"network"``.
        """
        self.synchronize()
        origin = getattr(self, "_timeline_origin", 0.0)
        timeline = Timeline.from_records(self.pool.spans(), origin)
        if self.node is not None:
            for what, start, end in list(self.node.comm.spans or ()):
                timeline.add(Span(HOST, "network", "comm", what, start - origin, end - origin))
        return timeline

    # -- device memory --------------------------------------------------------------------

    def device_memory(self) -> list[dict]:
        """One dict per device of the pool: ``device`` (``"cuda:0"``, ``"emulated:0"``),
        ``allocated`` (bytes held by tensors now, as ``torch.cuda.memory_allocated``)
        and ``peak`` (the most held since the pool was made or
        :meth:`reset_peak_memory`, as ``torch.cuda.max_memory_allocated``); what the
        allocator holds besides, which is what runs out on a GPU (its caching allocator
        keeps freed blocks, per stream, rounded and split): ``reserved``,
        ``peak_reserved`` and ``alloc_retries`` (allocations that had to free its cache
        and retry: near capacity, a sign of fragmentation), as ``torch.cuda`` reports
        them (the emulator reserves what its tensors hold). Workers sharing a GPU
        (``cuda:0,0``) each report the whole GPU's figures.

        Like those functions it does not wait for queued work: call
        :meth:`synchronize` first for the figures of everything issued. The emulated
        devices count what layers compute only with a ``capacity_bytes`` (or
        ``count_compute_memory=True``): docs/design.md#emulator-kindnesses."""
        figures = []
        for device in self.pool:
            reserved, peak_reserved, retries = device.reserved_memory()
            figures.append(
                {
                    "device": repr(device),
                    "allocated": device.memory_allocated(),
                    "peak": device.max_memory_allocated(),
                    "reserved": reserved,
                    "peak_reserved": peak_reserved,
                    "alloc_retries": retries,
                }
            )
        return figures

    def reset_peak_memory(self) -> None:
        """Start every device's ``peak`` again from what it holds now (as
        ``torch.cuda.reset_peak_memory_stats``)."""
        for device in self.pool:
            device.reset_peak_memory()
