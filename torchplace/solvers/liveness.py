"""Solving a problem whose working memory is a liveness peak by solvers that sum memory over nodes.

With liveness (:func:`torchplace.costmodel.uses_liveness`) a device's working memory is the most
bytes alive at once while it runs one micro-batch (:func:`torchplace.costmodel.working_memory`), not
a sum over its nodes, which every solver assumes. As :mod:`torchplace.solvers.shared` does for
shared tensors and :mod:`torchplace.solvers.pipelined` for training pipelines, such a problem is
solved through two problems whose node memory is a sum:

1. the *relaxation*: a node needs its parameters only (working memory 0). It never charges more
   than the truth, so its lower bound holds for the true problem; memory does not enter the
   objective, so when its plan also fits the liveness memory that plan keeps its proof (the usual
   case: memory is not what binds);
2. otherwise the *restriction*: a node needs ``param + ceil(temp / m) + sum_{u -> v} ceil(out_u /
   m)`` (in training ``m`` times that, since a training problem divides the sum by ``m``, and each
   ``ceil(out_u / m)`` counted ``m`` times: the gradients sent back for ``u`` that may wait; a
   backward node its ``temp``, rounded up to whole micro-batches, at least its new weight gradient,
   and one more copy of each trainable tensor its forward node reads with other nodes: the
   gradients autograd keeps until the last read's is in), plus, when it makes a model
   output, ``(m - 1) ceil(out_v / m)`` held for the other micro-batches (in training also the
   loss's ``ceil(loss_bytes / m)``, the output's gradient for ``m`` micro-batches and a copy
   recomputed), or when it has readers, which may be on another device, ``queued(m, most_hops)
   ceil(out_v / m)`` (in training ``2m``: the values held until their backward, their gradients that come back,
   and a copy recomputed). That is never less than its share of the liveness memory (costmodel
   docstring), so its plans always fit. ``out_v`` is at least what the node holds
   (``resident``), and where its outputs are several memories (``resident_parts``) both
   ``ceil(temp / m)`` and ``ceil(out_v / m)`` are at least the sum of the memories each rounded
   up, as the liveness rounds them. On a coarsened graph a node needs the sum of its members'
   needs in the original graph, whose memory the coarse problem is charged. Its plan is kept with
   the relaxation's bound, ``"optimal"`` only where that bound proves it.
3. the restriction charges every activation a device runs as if all were alive at once, far above
   the peak of a long stage (a chain of ``n`` layers keeps about two outputs alive, not ``n``), so
   before it the relaxation's plan is made to fit where it can (:mod:`torchplace.solvers.repair`):
   its pieces on each other's devices (the fastest renaming that fits), then work moved off the
   full devices one unit at a time, each step priced with the liveness memory (a third of the time
   left, at most :data:`REPAIR_SECONDS` without a limit); and failing that the relaxation is
   solved again with room reserved on each memory-limited device for the working memory its last
   plan needed there (as accelerate reserves room for the largest layer), the reserve growing
   until a plan fits the liveness memory (at most :data:`RESERVE_ROUNDS` rounds). The fastest plan
   found so is kept with the first relaxation's bound.

Every returned plan is evaluated and validated on the true problem (liveness memory).
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

from torchplace import costmodel
from torchplace.errors import InfeasibleError, InvalidPlanError, SolverLimitError
from torchplace.graph import NodeRecord, saved_producer
from torchplace.plan import Plan
from torchplace.problem import Problem
from torchplace.solvers.limits import in_phases
from torchplace.solvers.repair import least_overflow, repair
from torchplace.solvers.stand_in import on_true_problem

__all__ = ["conservative", "relaxed", "reserved", "solve_live"]

Solve = Callable[..., Plan]


def _summed(problem: Problem, bytes_of: Callable[[str, NodeRecord], int],
            saved_of: Callable[[str, NodeRecord], int] = lambda v, r: r.saved_bytes) -> Problem:
    """``problem`` with memory a sum over nodes: ``temp_bytes = bytes_of(v, record)`` and
    ``saved_bytes = saved_of(v, record)`` (no ``saved_parts``: each node's saved bytes its own)."""
    g = problem.graph
    out = g.with_records(lambda v, r: dataclasses.replace(r, temp_bytes=bytes_of(v, r), peak_bytes=None,
                                                          saved_bytes=saved_of(v, r), saved_parts={}),
                         meta={k: v for k, v in g.meta.items() if k != "liveness"})
    return dataclasses.replace(problem, graph=out)


def relaxed(problem: Problem) -> Problem:
    """Working memory 0, and saved only the tensors a node makes itself: node memory never above
    the truth (module docstring, 1)."""
    return _summed(problem, lambda v, r: 0, _own_saved)


def _own_saved(v: str, r: NodeRecord) -> int:
    """Bytes of the tensors ``v`` saves that ``v`` made (its outputs and temporaries): no other node
    makes them, so a device keeps them for ``v`` alone, however many nodes save them
    (:func:`torchplace.costmodel.saved_union` counts them once, with the others)."""
    if not r.saved_parts:
        return r.saved_bytes
    mine = set(r.fx_nodes)
    return sum(b for k, b in r.saved_parts.items() if saved_producer(k) in mine)


def conservative(problem: Problem) -> Problem:
    """Node memory never below its share of the liveness peak (module docstring, 2).

    A problem on a coarsened graph (``Problem.coarsened``), whose memory is the original graph's,
    charges each coarse node the sum of its members' shares in the original graph: a merged
    record rounds its bytes up once, and may hold less than a member it merges (a slice that
    leaves the group keeps the larger memory it was cut from)."""
    coarse = problem.coarsened
    if coarse is not None and problem.graph is coarse.graph:
        fine = conservative(dataclasses.replace(problem, graph=coarse.original, coarsened=None)).graph
        return _summed(problem, lambda v, r: sum(fine.record(u).temp_bytes for u in coarse.members[v]))
    g, m = problem.graph, costmodel.microbatches(problem)

    outputs = set(g.meta.get("outputs", ()))
    aliases, part_aliases = g.meta.get("aliases") or {}, g.meta.get("part_aliases") or {}
    viewed: set[str] = set()  # nodes whose memory a model output views: held for the other micro-batches too
    for v, r in g.records():
        if not outputs.intersection(r.fx_nodes):
            continue
        bases = [aliases[v]] if v in aliases else list((part_aliases.get(v) or {}).values())
        while bases:
            base = bases.pop()
            if base not in viewed:
                viewed.add(base)
                bases += [aliases[base]] if base in aliases else list((part_aliases.get(base) or {}).values())

    training = problem.mode == "training"
    loss = -(-costmodel.loss_bytes(g) // m)  # training: where the outputs are, the loss runs

    # a trainable tensor read by several nodes: autograd keeps each read's gradient until the last
    # read's arrives and sums them out of place (costmodel.backward_peak): one more copy per read
    tied = [t for t in g.shared_tensors() if t.trainable and len(t.readers) > 1]

    def share(v: str, r: NodeRecord) -> int:
        if r.backward:  # training: its own peak (the sum is divided by m, and covers the largest), at
            # least the new gradient of its weights (costmodel._backward_own_peak), and what a tied
            # weight's reads keep
            reads = {u for u in g.predecessors(v) if not g.record(u).backward}
            kept = sum(t.nbytes for t in tied for u in reads if u in t.readers)
            return m * (max(-(-r.temp_bytes // m), costmodel.weight_gradient_bytes(g, v)) + kept)
        received = sum(-(-g.record(u).output_bytes // m) for u in g.predecessors(v))
        if training:  # the gradients sent back for it, this micro-batch's and the others' that wait
            received *= m
        # the liveness holds what its outputs were made in, each of its memories rounded up (one
        # memory of ``resident`` bytes where the node has no parts: costmodel._parts)
        parts = sum(-(-b // m) for b in (r.resident_parts or {"": r.resident}).values())
        out = max(-(-max(r.output_bytes, r.resident) // m), parts)
        # a view keeps what it views: received, a copy of the viewed node's output
        viewing = [aliases[v]] if v in aliases else list((part_aliases.get(v) or {}).values())
        out += sum(-(-g.record(b).output_bytes // m) for b in viewing if b in g)
        if outputs.intersection(r.fx_nodes):  # training: the loss and the outputs' gradient here
            # (in training also its gradient, the loss's, for every micro-batch until its backward,
            # and a second copy while a recomputing device runs its forward again)
            held = (m - 1) * out + (loss + m * -(-r.output_bytes // m) + out if training else 0)
        else:  # its readers may be on another device: it holds what it sent on (in training until their
            # backward, and through its own the gradient that comes back: one more, those that came
            # back for the other micro-batches, costmodel.waiting_gradients, and the copy a
            # recomputing device makes again)
            sent = 2 * m if training else costmodel.queued(m, costmodel.most_hops(problem))
            held = sent * out if g.nx.out_degree(v) else 0
            if v in viewed:
                held += (m - 1) * out
        # a training problem's working memory is the sum over m (costmodel.memory_parts)
        return (m if training else 1) * (max(-(-r.temp_bytes // m), parts) + received + held)

    return _summed(problem, share)


REPAIR_SECONDS = 10.0
"""The most seconds :func:`~torchplace.solvers.repair.repair` walks without a time limit (with one:
a third of what is left)."""

RESERVE_ROUNDS = 4
"""Re-solves of the relaxation with room reserved for working memory (module docstring, 3)."""


def reserved(problem: Problem, nbytes: Mapping[str, int]) -> Problem:
    """The relaxation with ``nbytes[d]`` less memory on each memory-limited device ``d``."""
    devices = tuple(d if d.memory_bytes is None else
                    dataclasses.replace(d, memory_bytes=max(d.memory_bytes - nbytes.get(d.name, 0), 0))
                    for d in problem.cluster.devices)
    return dataclasses.replace(relaxed(problem), cluster=dataclasses.replace(problem.cluster, devices=devices))


def _working(problem: Problem, plan: Plan) -> dict[str, int]:
    """The working memory each device of ``plan`` needs (liveness memory minus parameters)."""
    truth, params = costmodel.device_memory(problem, plan.stages), costmodel.device_memory(relaxed(problem), plan.stages)
    return {d: truth[d] - params[d] for d in truth}


def _on_truth(problem: Problem, plan: Plan, bound: float, how: str) -> Plan:
    return on_true_problem(problem, plan, bound, how, key="working_memory", kept=how == "relaxed")


def solve_live(problem: Problem, solve: Solve, time_limit: float | None, **opts: Any) -> Plan:
    """Solve ``problem`` by ``solve(problem, time_limit=..., **opts)`` as the module docstring says.

    Raises:
        InfeasibleError: if neither the relaxation's plan nor the restriction's fits. Its
            ``min_memory_bytes`` is then the restriction's: a per-device memory at which a plan
            surely fits (the liveness optimum may need less; the message gives the relaxation's
            smallest memory too, below which nothing fits).
        SolverLimitError: a phase stopped at its share of ``time_limit`` without a plan (the
            message names ``time_limit``).
    """
    try:
        return _solve_live(problem, solve, time_limit, **opts)
    except SolverLimitError as e:
        raise in_phases(e, time_limit, "liveness memory solves a relaxed problem, then reserved or restricted ones, "
                        "in turn") from e


def _solve_live(problem: Problem, solve: Solve, time_limit: float | None, **opts: Any) -> Plan:
    start = time.perf_counter()
    share = None if time_limit is None else time_limit / 2
    try:
        first = solve(relaxed(problem), time_limit=share, **opts)
    except InfeasibleError as e:
        raise _infeasible(problem, solve, time_limit, opts, e) from e
    fit = _fitting(problem, first, first.lower_bound, "relaxed")
    if fit is not None and fit.objective <= first.objective * (1 + 1e-9):
        return fit  # the relaxation's plan fits, on its devices or on others as fast
    found = [] if fit is None else [fit]
    if first.meta.get("interrupted"):  # Ctrl-C: what fits now is the answer, no phase goes on
        return _stop(found)
    left = REPAIR_SECONDS if time_limit is None else max(time_limit - (time.perf_counter() - start), 0.0) / 3
    stages = repair(problem, first, deadline=time.perf_counter() + left)
    if stages is not None:
        moved = dataclasses.replace(first, stages=stages, solver=f"{first.solver}+repair",
                                    seconds=time.perf_counter() - start)
        try:
            found.append(_on_truth(problem, moved, first.lower_bound, "relaxed; work moved off full devices"))
        except InvalidPlanError:
            pass
    reserve: dict[str, int] = {}
    plan = first
    for round_ in range(RESERVE_ROUNDS):
        if found and round_:  # one round beside a plan found (it may do better), more while none is
            break
        for d, need in _working(problem, plan).items():  # grows on each device its plans used
            reserve[d] = max(reserve.get(d, 0) + 1, need)
        left = None if time_limit is None else max(time_limit - (time.perf_counter() - start), 0.0) / 2
        try:
            plan = solve(reserved(problem, reserve), time_limit=left, **opts)
        except InfeasibleError:
            break  # a larger reserve has no plan either: the restriction states the memory that fits
        fit = _fitting(problem, plan, first.lower_bound,
                       "reserved " + ", ".join(f"{d}: {n} bytes" for d, n in sorted(reserve.items())))
        if fit is not None:
            found.append(fit)
        if plan.meta.get("interrupted"):
            return _stop(found)
    if found:
        return min(found, key=lambda p: p.objective)
    left = None if time_limit is None else max(time_limit - (time.perf_counter() - start), 0.0)
    try:
        second = solve(conservative(problem), time_limit=left, **opts)
    except InfeasibleError as e:
        raise _infeasible(problem, solve, None, opts, None, e) from e
    return _on_truth(problem, second, first.lower_bound, "conservative")


def _fitting(problem: Problem, plan: Plan, bound: float, how: str) -> Plan | None:
    """``plan`` on the true problem if it fits; else its renaming that fits
    (:func:`torchplace.solvers.repair.least_overflow`: the relaxation sees devices that differ only
    in their memory as alike, and may put the larger piece on the smaller one), or ``None``."""
    try:
        return _on_truth(problem, plan, bound, how)
    except InvalidPlanError:
        pass
    best = least_overflow(problem, plan.stages)
    if best.overflow:
        return None
    try:
        return _on_truth(problem, dataclasses.replace(plan, stages=best.stages), bound, f"{how}; devices renamed")
    except InvalidPlanError:
        return None


def _stop(found: list[Plan]) -> Plan:
    """After a search stopped by Ctrl-C: the fastest plan found that fits, or ``KeyboardInterrupt``."""
    if not found:
        raise KeyboardInterrupt
    return min(found, key=lambda p: p.objective)


def _infeasible(problem: Problem, solve: Solve, time_limit: float | None, opts: dict[str, Any],
                low: InfeasibleError | None, high: InfeasibleError | None = None) -> InfeasibleError:
    """The error to raise: the restriction's smallest memory (a memory that surely fits) and,
    when known, the relaxation's (below which nothing fits)."""
    if high is None:
        try:
            solve(conservative(problem), time_limit=time_limit, **opts)
        except InfeasibleError as e:
            high = e
        else:  # unreachable: the restriction never charges less than the relaxation
            return low or InfeasibleError("no split fits the devices' memory")
    need = high.min_memory_bytes
    if need is None:
        return high
    alive = "one micro-batch's activations alive"
    if low is not None:  # the relaxation (parameters alone) fits nowhere: a proof
        floor = f"; no split fits below {low.min_memory_bytes} bytes (parameters alone)" \
            if low.min_memory_bytes is not None else ""
        said = f"no split fits the devices' memory with {alive}: {need} bytes per device surely fit (activations " \
               f"counted from above){floor}"
    else:  # the solvers' plans did not fit, and the restriction counts activations from above
        said = (f"no split found that fits the devices' memory with {alive}: {need} bytes per device surely fit, "
                "and a split may fit with less (activations alive at once are counted from above here; a plan of "
                "your own that fits runs with place(..., plan=))")
    return InfeasibleError(f"{said}; raise max_memory to {need}, add devices or use more micro-batches",
                           min_memory_bytes=need)
