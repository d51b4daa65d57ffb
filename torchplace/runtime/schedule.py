"""Pipeline schedules as pure data.

The executor in :mod:`torchplace.runtime.pipeline` only executes what these functions return; it
never decides an order itself. This follows torchgpipe (Kim et al., "torchgpipe: On-the-fly
Pipeline Parallelism for Training Giant Models", https://arxiv.org/abs/2004.09910, section 3.2.1),
whose ``clock_cycles`` yields the (micro-batch, partition) pairs of each clock tick of the GPipe
fill-drain forward schedule (Huang et al., "GPipe", https://arxiv.org/abs/1811.06965).
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

__all__ = ["clock_cycles", "segments", "worker_orders"]


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
