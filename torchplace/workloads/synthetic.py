"""Synthetic layer graphs with real branch parallelism, for the DP's benchmarks and tests.

An Inception-like network (Szegedy et al., InceptionV3) is a chain of blocks; each block fans out
from one layer into parallel branches of layers that join again (a concatenation). A block with
branches of lengths ``l_1..l_b`` has ``prod(l_i + 1)`` ideals between its joins, so a few such
blocks give the tens of thousands of ideals, and hundreds of millions of ideal pairs, of the
published InceptionV3 layer graph (36,596 ideals, 5.8e8 pairs), which nobody solved exactly.
"""
from __future__ import annotations

import random
from collections.abc import Sequence

from torchplace.devices import Cluster, Device
from torchplace.graph import NodeRecord, OpGraph
from torchplace.problem import Problem

__all__ = ["inception_like"]


def inception_like(blocks: int, branches: Sequence[int], *, accelerators: int = 4, cpus: int = 1,
                   free_leaves: bool = False, seed: int = 0) -> Problem:
    """A throughput problem on a chain of ``blocks`` blocks, each with parallel ``branches``
    (their lengths, in layers) between two join layers.

    Layers take 1-4 time units on an accelerator and 10-30 on a CPU, outputs 0.2-1.5 units to move,
    and 1-8 MB of parameters; the accelerators hold half the graph's bytes each, so memory is
    real but not binding for a split over all of them. With ``free_leaves`` every layer also
    feeds a leaf that costs nothing (a shape query, an unused ``getitem``): each multiplies the
    ideals, and the safe contractions (:mod:`torchplace.solvers.reduce`) remove them all. Seeded:
    the same arguments give the same problem.

    Example:
        >>> p = inception_like(2, [1, 2])  # 2 blocks: in -> (a | b1 -> b2) -> out
        >>> len(p.graph)
        9
    """
    rng = random.Random(seed)
    g = OpGraph()

    def layer(name: str) -> str:
        g.add_node(name, NodeRecord(name, times={"accel": rng.uniform(1, 4), "cpu": rng.uniform(10, 30)},
                                    transfer_time=rng.uniform(0.2, 1.5), param_bytes=rng.randint(1, 8) * 2**20))
        if free_leaves:
            g.add_node(f"{name}.shape", NodeRecord(f"{name}.shape", times={"accel": 0.0, "cpu": 0.0}, transfer_time=0.0))
            g.add_edge(name, f"{name}.shape")
        return name

    join = layer("stem")
    for b in range(blocks):
        ends = []
        for i, length in enumerate(branches):
            prev = join
            for j in range(length):
                cur = layer(f"block{b}.branch{i}.{j}")
                g.add_edge(prev, cur)
                prev = cur
            ends.append(prev)
        out = layer(f"block{b}.concat")
        for e in ends:
            g.add_edge(e, out)
        join = out
    total = sum(r.param_bytes for _, r in g.records())
    devices = [Device(f"acc{i}", "meta", "accel", total // 2) for i in range(accelerators)]
    devices += [Device(f"cpu{i}", "cpu", "cpu") for i in range(cpus)]
    return Problem(g, Cluster(tuple(devices)))
