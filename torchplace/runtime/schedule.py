"""Pipeline schedules as pure data.

The executor in :mod:`torchplace.runtime.pipeline` only executes what these functions return; it
never decides an order itself. This follows torchgpipe (Kim et al., "torchgpipe: On-the-fly
Pipeline Parallelism for Training Giant Models", https://arxiv.org/abs/2004.09910, section 3.2.1),
whose ``clock_cycles`` yields the (micro-batch, partition) pairs of each clock tick of the GPipe
fill-drain forward schedule (Huang et al., "GPipe", https://arxiv.org/abs/1811.06965).
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["Action", "clock_cycles", "gpipe", "one_f_one_b", "per_worker", "segments", "training_schedule",
           "worker_orders"]


def clock_cycles(num_microbatches: int, num_stages: int) -> Iterator[list[tuple[int, int]]]:
    """Yield the (micro-batch, stage) pairs that run in each clock tick of GPipe's forward pass.

    At tick ``k`` every pair ``(i, j)`` with ``i + j == k`` runs; inside a tick the pairs are listed
    by increasing micro-batch (so by decreasing stage).

    Args:
        num_microbatches: number of micro-batches ``m`` (at least 0).
        num_stages: number of stages ``n`` (at least 0).

    Returns:
        An iterator over ``m + n - 1`` ticks (none when ``m`` or ``n`` is 0).

    Raises:
        ValueError: if ``num_microbatches`` or ``num_stages`` is negative.

    Example:
        >>> list(clock_cycles(3, 2))
        [[(0, 0)], [(0, 1), (1, 0)], [(1, 1), (2, 0)], [(2, 1)]]
    """
    if num_microbatches < 0 or num_stages < 0:
        raise ValueError(
            f"clock_cycles needs non-negative sizes (num_microbatches: {num_microbatches}, "
            f"num_stages: {num_stages})"
        )
    m, n = num_microbatches, num_stages
    if m == 0 or n == 0:
        return
    for k in range(m + n - 1):
        yield [(i, k - i) for i in range(max(1 + k - n, 0), min(1 + k, m))]


def segments(stage_workers: Sequence[str]) -> list[tuple[str, tuple[int, ...]]]:
    """Group consecutive stages that run on the same worker into segments.

    A segment is a maximal run of consecutive stages with one worker key; a micro-batch crosses a
    queue only between segments, and a worker runs a segment's stages back to back.

    Args:
        stage_workers: the worker key of each stage, in stage order.

    Returns:
        ``[(worker, (stage, ...)), ...]`` in stage order.

    Example:
        >>> segments(["cpu:0", "cpu:0", "cpu:1", "cpu:0"])
        [('cpu:0', (0, 1)), ('cpu:1', (2,)), ('cpu:0', (3,))]
    """
    result: list[tuple[str, tuple[int, ...]]] = []
    for stage, worker in enumerate(stage_workers):
        if result and result[-1][0] == worker:
            result[-1] = (worker, result[-1][1] + (stage,))
        else:
            result.append((worker, (stage,)))
    return result


def worker_orders(
    num_microbatches: int, segment_workers: Sequence[str]
) -> dict[str, list[tuple[int, int]]]:
    """The order in which each worker processes its (micro-batch, segment) pairs.

    It is :func:`clock_cycles` over segments, restricted to each worker's segments. A worker that
    owns several non-adjacent segments thus interleaves them exactly as the fill-drain clock does,
    which keeps bounded queues between segments free of deadlock: the earliest pending pair is
    always either runnable or waits only on a pair of the same tick further down the pipeline,
    and the last segment writes to an unbounded queue.

    Args:
        num_microbatches: number of micro-batches.
        segment_workers: the worker key of each segment, in segment order.

    Returns:
        ``{worker: [(microbatch, segment), ...]}`` with workers in order of first appearance.

    Example:
        >>> worker_orders(2, ["a", "b", "a"])
        {'a': [(0, 0), (1, 0), (0, 2), (1, 2)], 'b': [(0, 1), (1, 1)]}
    """
    orders: dict[str, list[tuple[int, int]]] = {w: [] for w in segment_workers}
    for tick in clock_cycles(num_microbatches, len(segment_workers)):
        for microbatch, segment in tick:
            orders[segment_workers[segment]].append((microbatch, segment))
    return orders


# -- training schedules ------------------------------------------------------------------------------
@dataclass(frozen=True, order=True)
class Action:
    """One unit of a training schedule: the forward (``"F"``) or backward (``"B"``) pass of one
    stage on one micro-batch."""

    kind: Literal["F", "B"]
    microbatch: int
    stage: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}.{self.stage}"


def gpipe(num_microbatches: int, num_stages: int) -> list[Action]:
    """GPipe's fill-drain schedule (Huang et al. 2019) as one global order: every forward by
    :func:`clock_cycles`, then every backward by the mirrored clock (the last stage first).

    Example:
        >>> gpipe(2, 2)
        [F0.0, F0.1, F1.0, F1.1, B0.1, B0.0, B1.1, B1.0]
    """
    m, n = num_microbatches, num_stages
    forward = [Action("F", i, s) for tick in clock_cycles(m, n) for i, s in tick]
    backward = [Action("B", i, n - 1 - r) for tick in clock_cycles(m, n) for i, r in tick]
    return forward + backward


def _one_f_one_b_stage(m: int, n: int, s: int) -> list[Action]:
    """Stage ``s``'s own order under 1F1B (PipeDream-flush, Narayanan et al. 2021): ``n - s - 1``
    warm-up forwards, then one forward and one backward in turn, then the remaining backwards."""
    warmup = min(n - s - 1, m)
    order = [Action("F", i, s) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Action("F", warmup + i, s), Action("B", i, s)]
    order += [Action("B", i, s) for i in range(m - warmup, m)]
    return order


def one_f_one_b(num_microbatches: int, num_stages: int) -> list[Action]:
    """1F1B as one global order: each stage's :func:`_one_f_one_b_stage` sequence, run in clock
    ticks of unit time (an action starts once the stage is free and its dependency, the forward of
    the stage before or the backward of the stage after, finished in an earlier tick), listed by
    tick and then by stage.

    Example:
        >>> one_f_one_b(3, 2)
        [F0.0, F1.0, F0.1, B0.1, B0.0, F1.1, F2.0, B1.1, B1.0, F2.1, B2.1, B2.0]
    """
    m, n = num_microbatches, num_stages
    pending = {s: _one_f_one_b_stage(m, n, s) for s in range(n)}
    done: dict[Action, int] = {}
    out: list[tuple[int, int, Action]] = []
    tick = 0
    while any(pending.values()):
        for s in range(n):
            if not pending[s]:
                continue
            a = pending[s][0]
            dep = Action("F", a.microbatch, s - 1) if a.kind == "F" else Action("B", a.microbatch, s + 1)
            first, last = (a.kind == "F" and s == 0), (a.kind == "B" and s == n - 1)
            if first or last or done.get(dep, tick) < tick:
                done[a] = tick
                out.append((tick, s, pending[s].pop(0)))
        tick += 1
    return [a for _, _, a in sorted(out)]


def training_schedule(schedule: str, num_microbatches: int, num_stages: int) -> list[Action]:
    """``"gpipe"`` or ``"1f1b"`` as one global order of actions (see :func:`gpipe`, :func:`one_f_one_b`).

    Raises:
        ValueError: for another schedule name or negative sizes.
    """
    if num_microbatches < 0 or num_stages < 0:
        raise ValueError(f"a schedule needs non-negative sizes (micro-batches {num_microbatches}, stages {num_stages})")
    if schedule == "gpipe":
        return gpipe(num_microbatches, num_stages)
    if schedule == "1f1b":
        return one_f_one_b(num_microbatches, num_stages)
    raise ValueError(f"schedule must be 'gpipe' or '1f1b', got {schedule!r}")


def per_worker(actions: Sequence[Action], stage_workers: Sequence[str]) -> dict[str, list[Action]]:
    """Each worker's actions, in the order of the global list.

    A worker that owns several stages runs their actions interleaved as the global order lists
    them. Because that order runs every action after the ones it needs, the earliest pending
    action of all the workers can always run: no worker waits in a cycle.
    """
    out: dict[str, list[Action]] = {w: [] for w in stage_workers}
    for a in actions:
        out[stage_workers[a.stage]].append(a)
    return out
