"""The latency-mode executor: concurrency across workers, order within one, errors, outputs."""
from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

from torchplace.errors import StageError
from torchplace.runtime import LatencyExecutor
from torchplace.runtime.workers import WorkerThreads


class _IO:
    """A GraphIO stand-in: input ``x``, output the value named ``out``."""

    output_names = ("out",)

    def bind_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        return {"x": args[0]}

    def __call__(self, env: dict[str, Any]) -> Any:
        return env["out"]


class _Stage(nn.Module):
    def __init__(self, inputs: tuple[str, ...], outputs: tuple[str, ...], fn) -> None:
        super().__init__()
        self.inputs, self.outputs, self.fn = inputs, outputs, fn
        self.waits_for: tuple[int, ...] = ()
        self.writes: tuple[str, ...] = ()

    def forward(self, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (self.fn(*values),)


def test_independent_stages_on_two_workers_run_at_the_same_time() -> None:
    # Each branch waits until the other has started: run one after the other, they time out.
    barrier = threading.Barrier(2, timeout=5)

    def branch(scale: float):
        def fn(x: torch.Tensor) -> torch.Tensor:
            barrier.wait()
            return x * scale
        return fn

    stages = [
        _Stage(("x",), ("a",), branch(2.0)),
        _Stage(("x",), ("b",), branch(3.0)),
        _Stage(("a", "b"), ("out",), torch.add),
    ]
    ex = LatencyExecutor(stages, ["cpu", "cpu", "cpu"], ["w0", "w1", "w0"], _IO())
    x = torch.arange(4.0)
    assert torch.equal(ex.run((x,), {}), x * 5)
    spans = {s.stage: s for s in ex.last_spans}
    assert spans[0].start < spans[1].finish and spans[1].start < spans[0].finish  # overlapped
    assert spans[2].start >= max(spans[0].finish, spans[1].finish)


def test_a_worker_runs_its_stages_in_plan_order() -> None:
    stages = [_Stage(("x",), (f"v{i}",), lambda x, i=i: x + i) for i in range(4)]
    stages.append(_Stage(tuple(f"v{i}" for i in range(4)), ("out",), lambda *v: sum(v)))
    ex = LatencyExecutor(stages, ["cpu"] * 5, ["w0", "w1", "w0", "w1", "w0"], _IO())
    assert torch.equal(ex.run((torch.zeros(2),), {}), torch.full((2,), 6.0))
    by_worker: dict[str, list[int]] = {}
    for s in sorted(ex.last_spans, key=lambda s: s.start):
        by_worker.setdefault(s.worker, []).append(s.stage)
    assert by_worker == {"w0": [0, 2, 4], "w1": [1, 3]}


def test_a_failing_stage_raises_stage_error_and_nothing_hangs() -> None:
    def boom(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("kaboom")

    stages = [_Stage(("x",), ("a",), boom), _Stage(("x",), ("b",), lambda x: x),
              _Stage(("a", "b"), ("out",), torch.add)]
    ex = LatencyExecutor(stages, ["cpu"] * 3, ["w0", "w1", "w1"], _IO())
    with pytest.raises(StageError, match="stage 0 on w0 failed: RuntimeError: kaboom") as info:
        ex.run((torch.ones(1),), {})
    assert isinstance(info.value.__cause__, RuntimeError)


def test_mismatched_lengths_are_rejected() -> None:
    with pytest.raises(ValueError, match="one entry per stage"):
        LatencyExecutor([_Stage(("x",), ("out",), lambda x: x)], ["cpu", "cpu"], ["w0"], _IO())


def _recording_stages(seen: list[tuple[int, int]]) -> list[_Stage]:
    def record(i: int):
        def fn(x: torch.Tensor) -> torch.Tensor:
            seen.append((i, threading.get_ident()))
            return x + i
        return fn
    return [_Stage(("x",), ("a",), record(0)), _Stage(("x",), ("b",), record(1)),
            _Stage(("a", "b"), ("out",), torch.add)]


def test_workers_are_kept_across_runs_and_end_with_the_executor() -> None:
    import gc

    seen: list[tuple[int, int]] = []
    ex = LatencyExecutor(_recording_stages(seen), ["cpu"] * 3, ["w0", "w1", "w0"], _IO())
    for _ in range(20):
        assert torch.equal(ex.run((torch.zeros(2),), {}), torch.ones(2))
    threads = {i: {ident for j, ident in seen if j == i} for i in (0, 1)}
    assert threads[0] == {threading.get_ident()}  # the first worker runs in the caller
    assert len(threads[1]) == 1 and threads[1] != threads[0]  # w1: one pool thread, made once
    (pool,) = [t for t in threading.enumerate() if t.ident in threads[1]]
    assert pool.name == "torchplace-latency-w1"
    del ex
    gc.collect()
    pool.join(timeout=5)
    assert not pool.is_alive()


def test_a_failed_or_interrupted_run_leaves_the_executor_usable() -> None:
    fail: list[BaseException] = []

    def first(x: torch.Tensor) -> torch.Tensor:
        if fail:
            raise fail.pop()
        return x

    stages = [_Stage(("x",), ("a",), first), _Stage(("x",), ("b",), lambda x: x + 1),
              _Stage(("a", "b"), ("out",), torch.add)]
    ex = LatencyExecutor(stages, ["cpu"] * 3, ["w0", "w1", "w1"], _IO())
    fail.append(ValueError("bad input"))
    with pytest.raises(StageError, match="ValueError: bad input"):
        ex.run((torch.zeros(1),), {})
    fail.append(KeyboardInterrupt())  # Ctrl-C while the caller runs its own stage
    with pytest.raises(KeyboardInterrupt):
        ex.run((torch.zeros(1),), {})
    assert torch.equal(ex.run((torch.zeros(1),), {}), torch.ones(1))


def test_a_worker_that_cannot_start_stops_the_run_and_leaves_the_executor_usable(monkeypatch) -> None:
    stages = [_Stage(("x",), ("a",), lambda x: x), _Stage(("a",), ("b",), lambda x: x + 1),
              _Stage(("b",), ("out",), lambda x: x * 2)]
    ex = LatencyExecutor(stages, ["cpu"] * 3, ["w0", "w1", "w2"], _IO())
    submit = WorkerThreads.submit

    def refuse_w2(self, worker, *args):
        if worker == "w2":
            raise RuntimeError("can't start new thread")
        return submit(self, worker, *args)

    monkeypatch.setattr(WorkerThreads, "submit", refuse_w2)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        ex.run((torch.zeros(1),), {})  # w1's job was queued and waits for w0's value: it must stop
    monkeypatch.undo()
    assert torch.equal(ex.run((torch.zeros(1),), {}), torch.full((1,), 2.0))
