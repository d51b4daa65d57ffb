"""Measured runs as Chrome / Perfetto traces (the JSON the PyTorch profiler writes).

One process, one track (thread) per device, one complete event (``"ph": "X"``) per stage span,
times in microseconds from the run's first start. Open the file at https://ui.perfetto.dev or
chrome://tracing.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torchplace.files import write_json
from torchplace.runtime.spans import StageSpan

__all__ = ["chrome_trace", "write_trace"]


def chrome_trace(spans: Sequence[StageSpan], devices: Sequence[str] = (), name: str = "torchplace") -> dict[str, Any]:
    """The trace of ``spans``: ``{"traceEvents": [...], "displayTimeUnit": "ms"}``.

    Args:
        spans: the executor's spans of one run (``last_spans``).
        devices: the track order (devices not listed follow in order of appearance).
        name: the process name shown above the tracks.
    """
    tracks = list(dict.fromkeys([*devices, *(s.worker for s in spans)]))
    t0 = min((s.start for s in spans), default=0.0)
    events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": name}}]
    for tid, dev in enumerate(tracks):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": dev}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": tid, "args": {"sort_index": tid}})
    for s in sorted(spans, key=lambda s: (s.start, s.worker)):
        pass_name = "forward" if s.kind == "F" else "backward"
        events.append({
            "name": f"{s.kind}{s.microbatch} stage {s.stage}", "cat": pass_name, "ph": "X", "pid": 0,
            "tid": tracks.index(s.worker), "ts": round((s.start - t0) * 1e6, 3),
            "dur": round(max(s.finish - s.start, 0.0) * 1e6, 3),
            "args": {"stage": s.stage, "microbatch": s.microbatch, "device": s.worker, "pass": pass_name},
        })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(path: str | Path, spans: Sequence[StageSpan], devices: Sequence[str] = ()) -> Path:
    """Write :func:`chrome_trace` of ``spans`` to ``path`` (atomically)."""
    write_json(path, chrome_trace(spans, devices))
    return Path(path)
