"""The neutral timeline format: Chrome trace and Gantt export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from roundpipe.core.timeline import HOST, Span, Timeline


def _timeline() -> Timeline:
    return Timeline(
        [
            Span(0, "compute", "forward", "F0 mb0", 0.0, 0.001),
            Span(0, "h2d", "upload", "upload F1", 0.0, 0.0005),
            Span(1, "compute", "backward", "B1 mb0", 0.002, 0.004),
            Span(HOST, "optimizer", "optimizer", "step 0", 0.004, 0.005),
        ]
    )


def test_span_rejects_an_end_before_its_start() -> None:
    with pytest.raises(ValueError, match="ends"):
        Span(0, "compute", "forward", "bad", 2.0, 1.0)


def test_chrome_trace_has_one_process_per_device_and_one_thread_per_stream() -> None:
    events = _timeline().to_chrome_trace()["traceEvents"]
    processes = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    threads = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert processes == {"device 0", "device 1", "host"}
    assert len(threads) == 4
    (backward,) = [e for e in events if e["ph"] == "X" and e["name"] == "B1 mb0"]
    assert backward["ts"] == pytest.approx(2000.0) and backward["dur"] == pytest.approx(2000.0)
    assert backward["cat"] == "backward"


def test_spans_of_one_stream_share_a_thread_id() -> None:
    timeline = _timeline()
    timeline.add(Span(0, "compute", "forward", "F0 mb1", 0.001, 0.002))
    events = [e for e in timeline.to_chrome_trace()["traceEvents"] if e["ph"] == "X"]
    tids = {e["tid"] for e in events if e["name"].startswith("F0")}
    assert len(tids) == 1


def test_save_chrome_trace_writes_loadable_json(tmp_path: Path) -> None:
    path = tmp_path / "run.trace.json"
    _timeline().save_chrome_trace(path)
    assert len(json.loads(path.read_text())["traceEvents"]) > 4


def test_save_gantt_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "run.png"
    _timeline().save_gantt(path, title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rows_list_devices_in_order_and_the_host_last() -> None:
    assert _timeline().rows() == [
        (0, "compute"),
        (0, "h2d"),
        (1, "compute"),
        (HOST, "optimizer"),
    ]
