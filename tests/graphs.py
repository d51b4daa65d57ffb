"""Small random problems for property tests, and a brute-force optimum to check solvers against."""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

from hypothesis import strategies as st

from torchplace import costmodel
from torchplace.devices import Cluster, Device
from torchplace.graph import NodeRecord, OpGraph
from torchplace.plan import Stage
from torchplace.problem import Pipeline, Problem


def diamond(branch: float, transfer: float, **problem: object) -> Problem:
    """a -> (b, c) -> d on two accelerators of 10 bytes: a and d take 1 s, b and c ``branch`` s,
    each output ``transfer`` s to move, 1 byte of parameters per node; ``problem``: the Problem's
    other fields (objective, contiguous)."""
    g = OpGraph()
    for v, t in zip("abcd", (1.0, branch, branch, 1.0)):
        g.add_node(v, NodeRecord(v, times={"accel": t}, transfer_time=transfer, param_bytes=1))
    for u, v in ("ab", "ac", "bd", "cd"):
        g.add_edge(u, v)
    devices = tuple(Device(f"acc{i}", "meta", "accel", 10) for i in range(2))
    return Problem(g, Cluster(devices), **problem)


def scaled_chain(scale: float, **problem: object) -> Problem:
    """0 -> 1 -> 2 on two accelerators and a CPU, times a multiple of ``scale`` (node i: (i+1) on
    the CPU, (3-i) on an accelerator, ``scale`` to move its output): a solver that does not scale
    times breaks at nanosecond counts (1e9) and beyond; ``problem``: the Problem's other fields."""
    g = OpGraph()
    for i in range(3):
        g.add_node(str(i), NodeRecord(str(i), times={"cpu": (i + 1) * scale, "accel": (3 - i) * scale},
                                      transfer_time=scale))
    g.add_edge("0", "1")
    g.add_edge("1", "2")
    devices = (Device("acc0", "meta", "accel"), Device("acc1", "meta", "accel"), Device("cpu0", "cpu", "cpu"))
    return Problem(g, Cluster(devices), **problem)


@st.composite
def problems(draw, max_nodes: int = 7) -> Problem:
    """A random DAG with accelerator/CPU times, transfer times, memory, colocation and CPU-only nodes."""
    n = draw(st.integers(1, max_nodes))
    g = OpGraph()
    n_classes = draw(st.integers(0, 2))
    for i in range(n):
        color = draw(st.integers(0, n_classes)) if n_classes else 0
        g.add_node(str(i), _record(draw, str(i), colocation=f"k{color}" if color else None))
    for u, v in itertools.combinations(range(n), 2):
        if draw(st.booleans()):
            g.add_edge(str(u), str(v))
    return Problem(g, _cluster(draw))


def _cluster(draw) -> Cluster:
    """0-2 accelerators of one memory size and 0-2 CPUs, at least one device."""
    k, l_ = draw(st.integers(0, 2)), draw(st.integers(0, 2))
    if k + l_ == 0:
        l_ = 1
    mem = draw(st.integers(2, 12))
    devices = [Device(f"acc{i}", "meta", "accel", mem) for i in range(k)]
    devices += [Device(f"cpu{i}", "cpu", "cpu", None) for i in range(l_)]
    return Cluster(tuple(devices))


def _record(draw, name: str, *, colocation: str | None, backward: bool = False) -> NodeRecord:
    """A node that always runs on a CPU and usually on an accelerator."""
    times = {"cpu": float(draw(st.integers(1, 20)))}
    if draw(st.integers(0, 5)) > 0:
        times["accel"] = float(draw(st.integers(0, 10)))
    return NodeRecord(name, param_bytes=draw(st.integers(0, 4)), times=times, backward=backward,
                      transfer_time=float(draw(st.integers(0, 6))), colocation=colocation)


@st.composite
def training_problems(draw, max_forward: int = 3, max_backward: int = 4, cpus: int | None = None) -> Problem:
    """A random training graph (Tarnawski Sec. 5.3): forward nodes ``f_i`` on a random DAG and
    backward nodes ``b_j``, each colocated with a forward node's class or orphaned (no forward
    sibling, Tarnawski App. E.1). Edges: forward -> forward, forward -> backward (stashed
    activations), and backward -> backward along a random order of the backward nodes, so a
    backward node may feed one of any other class, in the forward direction, against it, or
    between unrelated classes. The cluster is drawn as for :func:`problems`; or it is ``cpus``
    CPUs, there are ``max_forward`` forward nodes in a chain and ``b_i`` is ``f_i``'s sibling for
    each ``i``, so that with three CPUs or more the backward edges often order the classes neither
    in the forward order nor in its reverse."""
    n_fw = draw(st.integers(1 if cpus is None else max_forward, max_forward))
    n_bw = draw(st.integers(1 if cpus is None else n_fw, max_backward))
    g = OpGraph()
    for i in range(n_fw):
        g.add_node(f"f{i}", _record(draw, f"f{i}", colocation=f"k{i}"))
    for j in range(n_bw):
        owner = j if j < n_fw and cpus is not None else draw(st.integers(-1, n_fw - 1))  # -1: orphaned
        g.add_node(f"b{j}", _record(draw, f"b{j}", colocation=f"k{owner}" if owner >= 0 else None, backward=True))
    for u, v in itertools.combinations(range(n_fw), 2):
        if (cpus is not None and v == u + 1) or draw(st.booleans()):
            g.add_edge(f"f{u}", f"f{v}")
    for i, j in itertools.product(range(n_fw), range(n_bw)):
        if draw(st.integers(0, 3)) == 0:
            g.add_edge(f"f{i}", f"b{j}")
    order = draw(st.permutations(range(n_bw)))
    for a, b in itertools.combinations(order, 2):
        if draw(st.booleans()):
            g.add_edge(f"b{a}", f"b{b}")
    cluster = _cluster(draw) if cpus is None else Cluster(tuple(Device(f"cpu{i}", "cpu", "cpu") for i in range(cpus)))
    return Problem(g, cluster, mode="training")


def _units(problem: Problem) -> list[list[str]]:
    """The colocation groups (and single nodes without one), in node order."""
    groups: dict[str, list[str]] = {}
    for v, r in problem.graph.records():
        groups.setdefault(r.colocation if r.colocation is not None else f"node {v}", []).append(v)
    return list(groups.values())


def has_pipeline_order(problem: Problem, assign: dict[str, str]) -> bool:
    """Whether some order of the devices sends every forward -> forward edge forward and every
    backward -> backward edge either all forward or all backward (the contiguous splits: Tarnawski
    Fact 5.2, Sec. 5.3; see ``torchplace.plan._check_contiguity``), tried over every order."""
    g = problem.graph
    pairs: dict[bool, set[tuple[str, str]]] = {False: set(), True: set()}
    for u, v in g.edges:
        if assign[u] != assign[v] and g.record(u).backward == g.record(v).backward:
            pairs[g.record(u).backward].add((assign[u], assign[v]))
    for order in itertools.permutations(sorted(set(assign.values()))):
        pos = {d: i for i, d in enumerate(order)}
        if all(pos[a] < pos[b] for a, b in pairs[False]) and (
            all(pos[a] < pos[b] for a, b in pairs[True]) or all(pos[a] > pos[b] for a, b in pairs[True])
        ):
            return True
    return False


def brute_force_contiguous(problem: Problem) -> float:
    """Min max-load over every assignment whose devices can run as a pipeline of stages.

    Such assignments are exactly the chains of ideal differences the DP searches: colocation kept,
    every node on a device that can run it, memory respected, and an order of the devices in which
    forward data flows forward and backward data all forward or all backward
    (:func:`has_pipeline_order`).
    """
    names = problem.cluster.names
    units = _units(problem)
    best = math.inf
    for choice in itertools.product(names, repeat=len(units)):
        assign = {v: d for unit, d in zip(units, choice) for v in unit}
        if not has_pipeline_order(problem, assign):
            continue
        stages = [Stage(d, tuple(v for v in problem.graph if assign[v] == d)) for d in names]
        stages = [s for s in stages if s.nodes]
        if any(
            (cap := problem.cluster.device(s.device).memory_bytes) is not None
            and costmodel.memory(problem, s.nodes) > cap
            for s in stages
        ):
            continue
        best = min(best, costmodel.evaluate_stages(problem, stages)[0])
    return best


def _pipelined_record(draw, name: str, *, colocation: str | None, backward: bool) -> NodeRecord:
    """A node with bytes of every kind: parameters, working memory, output and, on forward nodes,
    activations saved for backward (usually more than its output, as in real layers)."""
    r = _record(draw, name, colocation=colocation, backward=backward)
    return dataclasses.replace(r, temp_bytes=draw(st.integers(0, 4)), output_bytes=draw(st.integers(0, 4)),
                               saved_bytes=0 if backward else draw(st.integers(0, 24)))


@st.composite
def pipelined_problems(draw, max_forward: int = 3, max_backward: int = 3) -> Problem:
    """A random training graph (:func:`training_problems`' shapes) with saved activations and a
    :class:`~torchplace.problem.Pipeline` (1-6 micro-batches, GPipe or 1F1B, recomputation allowed
    three times in four) on 1-3 accelerators and at most one CPU. The accelerators' memory limit
    is drawn from a quarter of the graph's bytes to half or all of them, where it often binds."""
    base = draw(training_problems(max_forward, max_backward))
    g = OpGraph()
    for v, r in base.graph.records():
        g.add_node(v, _pipelined_record(draw, v, colocation=r.colocation, backward=r.backward))
    for u, v in base.graph.edges:
        g.add_edge(u, v)
    total = sum(r.param_bytes + r.temp_bytes + r.saved_bytes for _, r in g.records())
    cap = draw(st.integers(max(1, total // 4), max(1, total // 2 if draw(st.booleans()) else total)))
    k, cpus = draw(st.integers(1, 3)), draw(st.integers(0, 1))
    devices = [Device(f"acc{i}", "meta", "accel", cap) for i in range(min(k, 3 - cpus))]
    devices += [Device(f"cpu{i}", "cpu", "cpu") for i in range(cpus)]
    schedule, recompute = draw(st.sampled_from(["gpipe", "1f1b"])), draw(st.integers(0, 3)) > 0
    pipeline = Pipeline(draw(st.integers(1, 6)), schedule, recompute)
    return Problem(g, Cluster(tuple(devices)), mode="training", pipeline=pipeline)


def _pipeline_stages(problem: Problem, assign: dict[str, str], order: Sequence[str]) -> list[Stage] | None:
    """The stages of ``assign`` run in device ``order``: forward pieces in it, backward pieces in it
    or in its reverse (whichever the backward edges allow); None if neither runs (see
    :func:`has_pipeline_order`)."""
    g, pos = problem.graph, {d: i for i, d in enumerate(order)}
    pairs: dict[bool, set[tuple[str, str]]] = {False: set(), True: set()}
    for u, v in g.edges:
        if assign[u] != assign[v] and g.record(u).backward == g.record(v).backward:
            pairs[g.record(u).backward].add((assign[u], assign[v]))
    if not all(pos[a] < pos[b] for a, b in pairs[False]):
        return None
    if all(pos[a] > pos[b] for a, b in pairs[True]):
        back = list(reversed(order))
    elif all(pos[a] < pos[b] for a, b in pairs[True]):
        back = list(order)
    else:
        return None
    side = {bw: {d: tuple(v for v in g if assign[v] == d and g.record(v).backward == bw) for d in order}
            for bw in (False, True)}
    stages = [Stage(d, side[False][d]) for d in order] + [Stage(d, side[True][d]) for d in back]
    return [s for s in stages if s.nodes]


def brute_force_pipelined(problem: Problem) -> float:
    """Min max-load over every contiguous assignment, every order of its devices that runs as a
    pipeline, and every recomputation choice per device (when the pipeline allows it), each device
    costed by :func:`costmodel.device_cost` with the micro-batches :func:`costmodel.in_flight`
    gives it in that order, and kept only if every device fits its memory."""
    cluster, units = problem.cluster, _units(problem)
    choices = (False, True) if problem.pipeline.recompute else (False,)
    cost: dict[tuple, costmodel.StageCost] = {}

    def device(nodes: tuple[str, ...], d: str, k: int, rc: bool) -> costmodel.StageCost:
        key = (nodes, d, k, rc)
        if key not in cost:
            cost[key] = costmodel.device_cost(problem, set(nodes), cluster.device(d), in_flight=k, recompute=rc)
        return cost[key]

    best = math.inf
    for choice in itertools.product(cluster.names, repeat=len(units)):
        assign = {v: d for unit, d in zip(units, choice) for v in unit}
        used = sorted(set(choice))
        held = {d: tuple(v for v in problem.graph if assign[v] == d) for d in used}
        for order in itertools.permutations(used):
            stages = _pipeline_stages(problem, assign, order)
            if stages is None:
                continue
            holds = costmodel.in_flight(problem, stages)
            for rc in itertools.product(choices, repeat=len(used)):
                costs = [device(held[d], d, holds[d], r) for d, r in zip(used, rc)]
                if all((cap := cluster.device(c.device).memory_bytes) is None or c.memory <= cap for c in costs):
                    best = min(best, max(c.load for c in costs))
    return best


@st.composite
def zero_rich_problems(draw, max_nodes: int = 7) -> Problem:
    """:func:`problems` or :func:`training_problems` where about half the nodes cost nothing
    (zero time on the kinds they run on, often no bytes, often a free output), some of them
    CPU-only, and the accelerators' memory is often tight: the structure the safe contractions
    of :mod:`torchplace.solvers.reduce` act on, and the cases where a careless rule goes wrong."""
    base = draw(st.one_of(problems(max_nodes), training_problems()))
    g = OpGraph()
    for v, r in base.graph.records():
        if draw(st.booleans()):
            times = {k: 0.0 for k in r.times}
            if draw(st.integers(0, 4)) == 0:
                times = {"cpu": 0.0}  # an unsupported (CPU-only) free node
            r = dataclasses.replace(r, times=times, param_bytes=draw(st.sampled_from([0, 0, 0, 3])),
                                    transfer_time=float(draw(st.sampled_from([0, 0, 1, 5]))))
        g.add_node(v, r)
    for u, v in base.graph.edges:
        g.add_edge(u, v)
    return dataclasses.replace(base, graph=g)
