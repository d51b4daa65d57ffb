"""Plan: where every node runs, in which stage order, what it costs and how far from optimal.

Solvers build plans with :meth:`Plan.build`, which evaluates the stages with the one cost model
(:mod:`torchplace.costmodel`) and validates them, so a plan's objective is always the cost model's
value and a plan that breaks a constraint never leaves a solver.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import networkx as nx

from torchplace import costmodel
from torchplace.callmodel import describe as describe_call
from torchplace.checks import brief
from torchplace.costmodel import StageCost
from torchplace.errors import InvalidPlanError, UsageError
from torchplace.files import read_json, write_json
from torchplace.problem import Problem
from torchplace.units import format_bytes

__all__ = ["Plan", "Stage", "check_contiguity", "is_contiguous", "stages_from_order"]

_FORMAT = "torchplace.plan/1"


@dataclass(frozen=True)
class Stage:
    """A piece of the graph run by one device; stages run in plan order.

    ``recompute`` (training with a :class:`~torchplace.problem.Pipeline` that allows it): the
    stage's device keeps only its inputs in the forward pass and recomputes its activations in the
    backward pass (a device recomputes if any of its stages says so).

    Piper plans (a problem with :class:`~torchplace.problem.Parallel`): ``device`` names the
    stage's group of ``data_parallel * tensor_parallel`` devices, and ``tmpcs`` gives the TMPC id
    chosen for each node (recomputation is per node, in its TMPC).
    """

    device: str
    nodes: tuple[str, ...]
    recompute: bool = False
    data_parallel: int = 1
    tensor_parallel: int = 1
    tmpcs: Mapping[str, str] = field(default_factory=dict, hash=False)


DEFAULT_MICROBATCHES = 4
"""Micro-batches per call where neither ``place(microbatches=)`` nor a given plan says."""


@dataclass
class Plan:
    """A placement and its certificate.

    Attributes:
        stages: ordered stages; every node's inputs come from its own or an earlier stage.
        objective: cost-model value (max device load, seconds per sample, for throughput).
        lower_bound: a proven lower bound on the optimal objective.
        solver: name of the algorithm that produced the plan.
        seconds: wall time the solver took.
        status: ``"optimal"`` (proven), ``"feasible"`` (no proof) or ``"time_limit"``.
        costs: per-device cost breakdown from the cost model.
    """

    stages: list[Stage]
    objective: float
    lower_bound: float
    solver: str
    seconds: float
    status: str = "optimal"
    costs: list[StageCost] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        problem: Problem,
        stages: Sequence[Stage],
        *,
        solver: str,
        seconds: float,
        lower_bound: float,
        status: str = "optimal",
        meta: Mapping[str, Any] | None = None,
    ) -> Plan:
        """Evaluate ``stages`` with the cost model, validate them, and wrap them in a Plan.

        Raises:
            InvalidPlanError: if the stages break a constraint (see :meth:`validate`).
            AssertionError: if ``lower_bound`` exceeds the objective of the (valid) plan: a bound
                that a feasible plan beats is no bound, and the solver that claimed it has a bug.
                An invalid plan raises InvalidPlanError whatever its bound: a plan on a device
                too small for it may well beat a true bound.
        """
        names = [d.name for d in problem.cluster.devices]
        unknown = sorted({s.device for s in stages} - set(names)) if problem.parallel is None else []
        if unknown:  # before the cost model, which looks each device up (Piper's stages name device ranges)
            raise InvalidPlanError(f"the plan places stages on {', '.join(map(repr, unknown))}, which is not among the "
                                   f"devices {names}: place on the plan's devices, or solve anew without the plan")
        objective, costs = costmodel.evaluate_stages(problem, stages)
        plan = cls(list(stages), objective, lower_bound, solver, seconds, status, costs,
                   {"objective": problem.objective, "mode": "training" if problem.parallel is not None else problem.mode,
                    **_schedule_of(problem), **(meta or {})})  # what a plan file is for (Piper plans training)
        plan.validate(problem)  # first: a bound holds for feasible plans only (an infeasible one may beat it)
        if lower_bound > objective * (1 + 1e-9) + 1e-12:
            raise AssertionError(f"{solver}: lower bound {lower_bound} exceeds the objective {objective} of its own plan")
        return plan

    # -- views -----------------------------------------------------------------------------------
    @property
    def assignment(self) -> dict[str, str]:
        """node id -> device name."""
        return {v: s.device for s in self.stages for v in s.nodes}

    @property
    def gap(self) -> float:
        """Relative gap ``(objective - lower_bound) / objective`` (0 when proven optimal)."""
        if self.objective == 0:
            return 0.0
        return max(0.0, (self.objective - self.lower_bound) / self.objective)

    @property
    def microbatches(self) -> int:
        """Micro-batches per call this plan runs with: the ``m`` ``place()`` predicted its call for
        (which ``microbatches="auto"`` or the one-device fallback may have chosen), else
        :data:`DEFAULT_MICROBATCHES` (a solver's plan, a hand-made one)."""
        recorded = self.meta.get("call", {}).get("microbatches") if isinstance(self.meta.get("call"), dict) else None
        return recorded if isinstance(recorded, int) and not isinstance(recorded, bool) and recorded > 0 \
            else DEFAULT_MICROBATCHES

    def device_map(self, problem: Problem) -> dict[str, str]:
        """Where each module's weights live, in accelerate's ``device_map`` form
        (:func:`torchplace.devicemap.device_map`): every module with parameters or buffers.

        Raises:
            UsageError: for a Piper plan, whose stages run on ``d x t`` devices each (a device map
                puts each module on one device).
        """
        from torchplace.devicemap import device_map

        if problem.parallel is not None:
            raise UsageError("a Piper plan's stages each run on d x t devices (data and tensor parallel), and a "
                             "device_map puts each module on one device: read the layers of each stage from "
                             "print(plan) instead, or plan with parallelism='pipeline' for a device_map")

        return device_map(problem, self.assignment, self.stages[0].device if self.stages else None)

    # -- pictures and report (torchplace.report; matplotlib is imported on first use) ---------------
    def plot_schedule(self, problem: Problem | None = None, microbatches: int | None = None) -> Any:
        """A Gantt chart per device of the predicted run (:func:`torchplace.report.plot_schedule`):
        fill-drain for inference, GPipe / 1F1B with backward for training, the latency simulation
        for latency plans (these two need ``problem``)."""
        from torchplace.report import plot_schedule

        return plot_schedule(self, problem, microbatches)

    def plot_memory(self, problem: Problem | None = None) -> Any:
        """Per-device memory stacked by kind against the cap (:func:`torchplace.report.plot_memory`)."""
        from torchplace.report import plot_memory

        return plot_memory(self, problem)

    def plot_graph(self, problem: Problem, level: str = "module") -> Any:
        """The graph coloured by device (:func:`torchplace.report.plot_graph`)."""
        from torchplace.report import plot_graph

        if not isinstance(problem, Problem):
            raise UsageError(f"plot_graph needs the Problem the plan was solved for (placed.problem), got "
                             f"{brief(problem)}")
        return plot_graph(self, problem, level)

    def report(self, path: str | Path, problem: Problem | None = None, **options: Any) -> Path:
        """Write a self-contained HTML report of this plan (:func:`torchplace.report.html.render`)."""
        from torchplace.report.html import write_report

        return write_report(path, self, problem, **options)

    # -- checking --------------------------------------------------------------------------------
    def validate(self, problem: Problem) -> None:
        """Reject a plan that misses or repeats a node, uses an unknown device, runs a node where it
        cannot run, breaks a memory limit or colocation, breaks contiguity when the problem asks for
        it (see :func:`check_contiguity`: one piece per device and side, the devices' pieces in an
        order where data only flows forward), or whose stage order is not a topological order of
        the stage graph.

        Raises:
            InvalidPlanError: naming the first broken constraint and the values involved.
        """
        g = problem.graph
        assignment = _check_coverage(self.stages, g)
        if problem.parallel is not None:
            _check_parallel(problem, self.stages)
            _check_stage_order(self.stages, g)
            return
        devices = {d.name: d for d in problem.cluster.devices}
        per_device: dict[str, list[str]] = defaultdict(list)
        for v, dev in assignment.items():
            if dev not in devices:
                raise InvalidPlanError(f"node {v!r} is placed on unknown device {dev!r}; devices: {sorted(devices)}")
            if math.isinf(problem.node_time(v, devices[dev])):
                raise InvalidPlanError(
                    f"node {v!r} cannot run on {dev!r} (kind {devices[dev].kind!r}); "
                    f"it has times for {sorted(g.record(v).times)}"
                )
            per_device[dev].append(v)
        needs = costmodel.device_memory(problem, self.stages)
        for dev in per_device:
            cap = devices[dev].memory_bytes
            used = needs[dev]
            if cap is not None and used > cap:
                raise InvalidPlanError(f"device {dev!r} needs {used} bytes but has {cap}: give it more memory "
                                       "(max_memory), or a plan that puts less on it")
        _check_colocation(g, assignment)
        if any(s.recompute for s in self.stages) and not (problem.pipeline and problem.pipeline.recompute):
            raise InvalidPlanError("a stage recomputes its activations, but the problem has no training pipeline "
                                   "that allows recomputation (Problem.pipeline.recompute)")
        if problem.contiguous:
            check_contiguity(problem, per_device)
        _check_stage_order(self.stages, g)

    # -- text and JSON -------------------------------------------------------------------------
    def __str__(self) -> str:
        status = self.status
        if status == "optimal" and self.meta.get("contiguous"):
            status = "proven optimal among contiguous splits"
        elif self.meta.get("optimal_among"):
            status = f"{status}; proven optimal among {self.meta['optimal_among']}"
        head = (
            f"Plan by {self.solver} ({status}) in {self.seconds:.3g} s: objective {self.objective:.6g}; "
            f"lower bound for any split {self.lower_bound:.6g}, gap {100 * self.gap:.2f}%"
        )
        if any(s.tmpcs for s in self.stages):
            return "\n".join([head, *_parallel_rows(self)])
        rows = [("stage", "device", "#ops", "compute", "xfer in", "xfer out", "memory", "load")]
        cost_of = {c.device: c for c in self.costs}
        for i, s in enumerate(self.stages):
            c = cost_of.get(s.device)  # none in a plan file written without them: the stage still shows
            costs = ("-",) * 5 if c is None else (f"{c.compute:.6g}", f"{c.transfer_in:.6g}", f"{c.transfer_out:.6g}",
                                                  format_bytes(c.memory), f"{c.load:.6g}")
            rows.append((str(i), s.device, str(len(s.nodes)), *costs))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(x.rjust(w) for x, w in zip(r, widths)) for r in rows]
        if len({s.device for s in self.stages}) < len(self.stages):
            lines.append("(a device with several stages shows its whole load on each of its stages)")
        degrees = sorted({(s.data_parallel, s.tensor_parallel) for s in self.stages})
        if degrees != [(1, 1)]:  # a plan given degrees by hand: torchplace.distributed runs them
            lines.append(f"(data_parallel, tensor_parallel) of the stages: {', '.join(map(str, degrees))}; the numbers "
                         "above are one pipeline's on the whole batch (degrees are priced on Piper problems only)")
        return "\n".join([head, *lines, *describe_call(self.meta)])  # the predicted call, when place() made one

    def to_json(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "objective": self.objective,
            "lower_bound": self.lower_bound,
            "gap": self.gap,
            "solver": self.solver,
            "seconds": self.seconds,
            "status": self.status,
            "assignment": self.assignment,
            "stages": [{"device": s.device, "nodes": list(s.nodes), **({"recompute": True} if s.recompute else {}),
                        **({"data_parallel": s.data_parallel, "tensor_parallel": s.tensor_parallel}
                           if s.tmpcs or s.data_parallel > 1 or s.tensor_parallel > 1 else {}),
                        **({"tmpcs": dict(s.tmpcs)} if s.tmpcs else {})}
                       for s in self.stages],
            "costs": [asdict(c) for c in self.costs],
            "meta": self.meta,
        }

    @classmethod
    def from_json(cls, data: Any, source: str = "plan") -> Plan:
        """The plan a plan-file dict describes, every field checked (:func:`torchplace.planfile.plan_from_json`).

        Raises:
            WorkloadFormatError: naming ``source`` and the missing or malformed field.
        """
        from torchplace.planfile import plan_from_json

        return plan_from_json(data, source)

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON, atomically (:func:`torchplace.files.write_json`): an interrupted
        save leaves the old file or the new one, never half of one."""
        write_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read and check a plan file (:meth:`from_json`).

        Raises:
            WorkloadFormatError: naming the file, for an unreadable file, bad JSON or a bad field.
        """
        return cls.from_json(read_json(path, "plan"), str(path))


def stages_from_order(problem: Problem, order: Sequence[str], assignment: Mapping[str, str]) -> list[Stage]:
    """The fewest stages whose plan order (:mod:`torchplace.costmodel`) is ``order``.

    ``order`` must be a topological order. A plan lists its nodes stage by stage, topologically
    inside a stage, so a new stage starts whenever the device changes or the next node comes
    earlier in the graph's topological order than the previous node of the current stage. Every
    edge then goes to the same or a later stage.
    """
    topo = {v: i for i, v in enumerate(problem.graph.topological_order())}
    stages: list[tuple[str, list[str]]] = []
    for v in order:
        dev = assignment[v]
        if stages and stages[-1][0] == dev and topo[v] > topo[stages[-1][1][-1]]:
            stages[-1][1].append(v)
        else:
            stages.append((dev, [v]))
    return [Stage(dev, tuple(nodes)) for dev, nodes in stages]


def _schedule_of(problem: Problem) -> dict[str, str]:
    """What a plan file records of how its training step runs (its pictures draw it)."""
    if problem.mode == "training" and problem.pipeline is not None and problem.parallel is None:
        return {"schedule": problem.pipeline.schedule}
    return {}


def recomputed_nodes(stage: Stage) -> int:
    """How many of a Piper stage's nodes recompute their activations (their TMPC is a recomputing one)."""
    return sum("recomp" in x for x in stage.tmpcs.values())


def _parallel_rows(plan: Plan) -> list[str]:
    """The table of a Piper plan: one row per stage with its degrees and TMPC choices."""
    rows = [("stage", "devices", "d", "t", "#nodes", "recompute", "compute", "edges", "allreduce", "memory", "TPS")]
    for i, (s, c) in enumerate(zip(plan.stages, plan.costs)):
        rows.append((str(i), s.device, str(s.data_parallel), str(s.tensor_parallel), str(len(s.nodes)),
                     f"{recomputed_nodes(s)}/{len(s.nodes)}", f"{c.compute:.4g}", f"{c.transfer_in + c.transfer_out:.4g}",
                     f"{c.allreduce:.4g}", format_bytes(c.memory), f"{c.load:.6g}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(x.rjust(w) for x, w in zip(r, widths)) for r in rows]


def _check_parallel(problem: Problem, stages: Sequence[Stage]) -> None:
    """Piper's constraints: degrees, device and batch budgets, a TMPC per node, memory per device."""
    par = problem.parallel
    assert par is not None
    used = sum(s.data_parallel * s.tensor_parallel for s in stages)
    in_flight = sum(s.data_parallel for s in stages)
    if used > par.devices:
        raise InvalidPlanError(f"the stages use {used} devices but the problem has {par.devices}")
    if in_flight > par.microbatches:
        raise InvalidPlanError(f"the data-parallel degrees sum to {in_flight}, more than the {par.microbatches} "
                               "micro-batches of a batch")
    for i, s in enumerate(stages):
        if s.data_parallel < 1 or s.tensor_parallel < 1 or par.microbatches % s.data_parallel:
            raise InvalidPlanError(f"stage {i}: data-parallel degree {s.data_parallel} must divide the "
                                   f"{par.microbatches} micro-batches, tensor-parallel degree must be >= 1")
        missing = [v for v in s.nodes if v not in s.tmpcs]
        if missing:
            raise InvalidPlanError(f"stage {i}: no TMPC chosen for node(s) {missing[:5]}")
        if s.recompute:
            raise InvalidPlanError(f"stage {i}: a Piper stage recomputes per node, through its TMPCs, not recompute=True")
    _, costs = costmodel.evaluate_stages(problem, stages)
    for i, c in enumerate(costs):
        if c.memory > par.memory_limit:
            raise InvalidPlanError(f"stage {i} ({stages[i].device}) needs {c.memory} bytes per device but a device "
                                   f"has {par.memory_limit:.0f}")
    if problem.contiguous:
        for i, s in enumerate(stages):
            if not is_contiguous(problem.graph, set(s.nodes)):
                raise InvalidPlanError(f"stage {i} is not contiguous (Piper Def. 3.1)")


def _check_coverage(stages: Sequence[Stage], g: Any) -> dict[str, str]:
    assignment: dict[str, str] = {}
    for s in stages:
        for v in s.nodes:
            if v in assignment:
                raise InvalidPlanError(f"node {v!r} is in two stages (devices {assignment[v]!r} and {s.device!r})")
            if v not in g:
                raise InvalidPlanError(f"plan places {v!r}, which is not a node of the graph")
            assignment[v] = s.device
    missing = [v for v in g if v not in assignment]
    if missing:
        raise InvalidPlanError(f"{len(missing)} node(s) are not placed, e.g. {missing[:5]}")
    return assignment


_UNSENDABLE = ("; torch.distributed.pipelining sends only tensors between stages, so a node that makes a tuple or "
               "list, or an fx graph's Python number (x.shape[0]), shares a device with the nodes that read it "
               "(torchplace.api.keep_unsendable_together): put them on one device, or place with "
               "trace_method='export', whose numbers the reading stage computes from the sizes it receives")


def _check_colocation(g: Any, assignment: Mapping[str, str]) -> None:
    seen: dict[str, tuple[str, str]] = {}
    for v, r in g.records():
        if r.colocation is None:
            continue
        if r.colocation in seen and seen[r.colocation][1] != assignment[v]:
            other, dev = seen[r.colocation]
            why = _UNSENDABLE if r.colocation.split(":")[0] in ("items", "number", "unsent") else ""
            raise InvalidPlanError(
                f"colocation group {r.colocation!r} is split: {other!r} on {dev!r}, {v!r} on {assignment[v]!r}{why}"
            )
        seen.setdefault(r.colocation, (v, assignment[v]))


def is_contiguous(g: Any, nodes: set[str]) -> bool:
    """Tarnawski Def. 3.1: no path leaves ``nodes`` and comes back."""
    frontier = [w for v in nodes for w in g.successors(v) if w not in nodes]
    seen = set(frontier)
    while frontier:
        x = frontier.pop()
        for w in g.successors(x):
            if w in nodes:
                return False
            if w not in seen:
                seen.add(w)
                frontier.append(w)
    return True


def check_contiguity(problem: Problem, per_device: Mapping[str, list[str]]) -> None:
    """Contiguous means what the ideals DP searches (Tarnawski Sec. 5.1.1, Fact 5.2): one piece of
    the forward graph per device and, for training (Sec. 5.3), one of the backward graph; the
    forward pieces in a device order in which data only flows forward (prefix unions are ideals),
    and the backward pieces in that order or in its reverse.

    Sec. 5.3 asks each device's forward part and backward part to be contiguous (Def. 3.1); the
    DP's chains of ideals moreover order the pieces (Archer et al. 2024, Sec. 2.2: the device
    quotient graph is acyclic). Per-device contiguity alone is weaker: with edges ``1 -> 4`` and
    ``2 -> 5``, ``{1, 5}`` and ``{2, 4}`` are both contiguous yet feed each other. The backward
    order: App. E.1 builds the backward graph as the mirror image of the forward one, so the
    backward pieces run in the reverse order (the OperatorGraphs workloads); the LayerGraphs
    training workloads draw their backward edges in the forward direction, so there they run in
    the same order. Any other backward order is not contiguous: with ``f1 -> f2 -> f3`` and
    ``b2 -> b1``, ``b2 -> b3`` on three devices the backward pieces would start in the middle. The
    DP searches exactly these splits (one contraction per orientation,
    :mod:`torchplace.solvers.contract`), and so does the max-load IP
    (:mod:`torchplace.solvers.milp.contiguity`).

    Checks, each naming what it found: each device's forward and backward part is contiguous;
    the device quotient graph of forward -> forward edges, and that of backward -> backward
    edges, is acyclic; and that of both together is acyclic with the backward edges taken as
    they are or reversed (forward -> backward edges never constrain: every forward piece runs
    before every backward piece).
    """
    g = problem.graph
    for dev, nodes in per_device.items():
        for backward in (False, True):
            part = {v for v in nodes if g.record(v).backward == backward}
            if part and not is_contiguous(g, part):
                side = "backward" if backward else "forward"
                raise InvalidPlanError(f"the {side} nodes on {dev!r} are not contiguous (Tarnawski Def. 3.1)")
    device_of = {v: dev for dev, nodes in per_device.items() for v in nodes}
    edges: dict[bool, list[tuple[str, str]]] = {False: [], True: []}  # backward? -> device pairs
    for u, v in g.edges:
        if device_of[u] != device_of[v] and g.record(u).backward == g.record(v).backward:
            edges[g.record(u).backward].append((device_of[u], device_of[v]))
    for backward in (False, True):
        cycle = _device_cycle(edges[backward])
        if cycle:
            side = "backward" if backward else "forward"
            raise InvalidPlanError(
                f"the {side} pieces feed each other in a cycle of devices {cycle}: a contiguous split needs an "
                "order of the devices in which data only flows forward (Tarnawski Fact 5.2); "
                "solve with contiguous=False to allow it"
            )
    same = _device_cycle(edges[False] + edges[True])
    reverse = _device_cycle(edges[False] + [(b, a) for a, b in edges[True]])
    if same and reverse:
        raise InvalidPlanError(
            "the backward pieces run neither in the forward pieces' device order nor in its reverse (forward "
            f"and backward data together go round {same}, forward data and reversed backward data round "
            f"{reverse}): a contiguous training split runs its backward pieces in one of the two (Tarnawski "
            "Sec. 5.3, App. E.1); solve with contiguous=False to allow it"
        )


def _device_cycle(edges: Sequence[tuple[str, str]]) -> str:
    """A cycle of the device graph with ``edges`` as ``"a -> b -> a"``, or ``""`` if it is acyclic."""
    try:
        cycle = nx.find_cycle(nx.DiGraph(edges))
    except nx.NetworkXNoCycle:
        return ""
    return " -> ".join([*(a for a, _ in cycle), cycle[0][0]])


def _check_stage_order(stages: Sequence[Stage], g: Any) -> None:
    """Every edge goes to the same or a later stage (so the stage graph is acyclic and the order runs)."""
    stage_of = {v: i for i, s in enumerate(stages) for v in s.nodes}
    for u, v in g.edges:
        if stage_of[u] > stage_of[v]:
            raise InvalidPlanError(
                f"edge {u!r} -> {v!r} goes from stage {stage_of[u]} back to stage {stage_of[v]}: stages must be "
                "ordered so inputs come from the same or an earlier stage (stages feeding each other form a cycle)"
            )
