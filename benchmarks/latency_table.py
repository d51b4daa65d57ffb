"""Latency placement of real models on heterogeneous clusters: every latency method, with and without fusion.

Run:  HF_HUB_OFFLINE=1 python benchmarks/latency_table.py [--models inception resnet gpt2 bert]
                                                          [--time-limit 60] [--ip-time-limit 30] [--quick]

Each model (:func:`torchplace.models.build`) is traced at operator granularity and profiled once
on this machine's CPU. Device kinds that are not attached are made from those measured times,
scaled per kind (:func:`scaled`): a fast accelerator runs every operator 8x faster than the CPU, a
slow one 2x, and so on. Two clusters (plan only, ``torch_device="meta"``):

* ``A`` -- ``examples/clusters/two-gpus-and-cpu.json``: fast GPU (kind ``cuda``, cpu/8) and slow
  GPU (kind ``cuda-t4``, cpu/2) with asymmetric host links, plus the host CPU (kind ``cpu``, x1).
  Each GPU holds half of the model's memory (parameters + working memory), so neither GPU alone
  fits it; the host is unlimited.
* ``B`` -- ``examples/clusters/edge-devices.json``: four edge devices in a line (multi-hop
  widest-path routes): edge-server (``cuda``, cpu/8), jetson-orin (cpu/4), jetson-nano (cpu/2),
  camera-pi (``arm``, cpu x2). Each holds 40% of the model's memory: no single device fits.

Methods, all on ``Problem(objective="latency", contiguous=False)``: the MOIRAI MILP (graphs of at
most ``MILP_NODES`` nodes; started from the better of m-SCT's and m-ETF's plans, as ``auto`` runs
it), Tarnawski's latency IP, Baechi's m-SCT / m-ETF / m-TOPO, and two
baselines evaluated with the same cost model: everything on the fastest device that fits, and an
accelerate-style sequential fill (devices fastest first, nodes in topological order, next device
when the current one is full). Each method runs on the operator graph and on the coarsened graph
(:func:`torchplace.fusion.coarsen`; MOIRAI Sec. IV-B, RQ2) whose plan is expanded back.

Columns: predicted latency (the cost model's simulated makespan, ms); ``LB`` the plan's proven
lower bound for the operator-level problem (:func:`latency_lower_bound`; for unfused MOIRAI also
its MILP bound); ``MILP bound`` MOIRAI's own bound (``c`` = on the coarse graph: it holds only for
plans that keep every fused group together); ``gap`` against the plan's LB and against the best
LB proven for that (model, cluster); the solver's status (fused rows: its status on the coarse
graph); wall seconds of the placement (coarsening included). HiGHS's time limit covers its own
search only: building a MILP and loading it into HiGHS come on top (seconds for 10^5 rows).

A second table measures real latency on two logical CPUs of this machine
(``torchplace.place(model, ["cpu:0", "cpu:1"], objective="latency")``) against the model itself
and a one-device placement, median of ``--repeats`` calls, and checks outputs with ``torch.equal``.
Models are built with batch 1, the single-request case latency mode is for (the tracer exports a
batch of one as two copies, since ``torch.export`` specialises a dimension of size 1).

Threads: torch runs with ``--threads`` intra-op threads (default 1). On a 2-core machine shared
with other processes, two OpenMP threads per op can stall for a scheduler tick at every parallel
region (the eager Inception model took ~470 ms per call with 2 threads and ~5 ms with 1 while the
machine was loaded), which would swamp both profiling and the measurements.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

import torchplace
from torchplace import costmodel, models
from torchplace.clusterfile import load_cluster
from torchplace.devices import Cluster, Device
from torchplace.errors import InfeasibleError, SolverLimitError
from torchplace.fusion import coarsen
from torchplace.graph import OpGraph
from torchplace.plan import Plan, Stage
from torchplace.problem import Problem
from torchplace.profiling import profile, trace
from torchplace.solvers import solve
from torchplace.solvers.auto import (
    MILP_NODES,  # MOIRAI runs on graphs of at most this many nodes
)
from torchplace.solvers.bounds import latency_lower_bound

CLUSTER_DIR = Path(__file__).resolve().parents[1] / "examples" / "clusters"
QUICK_MILP_NODES = 30  # --quick: HiGHS's time limit does not cover building and loading the model
BATCH = 1  # one request: see the module docstring
SOLVER_METHODS = ("moirai", "latency-ip", "m-sct", "m-etf", "m-topo")
BASELINES = ("single device", "sequential")


# -- scaled device kinds --------------------------------------------------------------------------
def scaled(graph: OpGraph, factors: Mapping[str, float], base: str = "cpu") -> OpGraph:
    """A copy of ``graph`` whose nodes' times are ``{kind: times[base] * factor}`` for each kind.

    Stands in for profiling devices that are not attached: a kind ``"fast"`` with factor 1/8 runs
    every operator 8x faster than the measured ``base`` kind. Only the listed kinds are kept.

    Raises:
        KeyError: naming a node that has no time for ``base``.
    """
    out = OpGraph(meta=graph.meta)
    for v, r in graph.records():
        if base not in r.times:
            raise KeyError(f"node {v!r} has no {base!r} time to scale; it has {sorted(r.times)}")
        out.add_node(v, dataclasses.replace(r, times={k: r.times[base] * f for k, f in factors.items()}))
    for u, v in graph.edges:
        out.add_edge(u, v)
    return out


@dataclass(frozen=True)
class ClusterSpec:
    """A cluster file, the time factor of each of its kinds, and each device's share of the model."""

    name: str
    file: str
    factors: Mapping[str, float]
    memory_share: Mapping[str, float | None]  # device -> fraction of the model's memory; None = unlimited

    def build(self, model_bytes: int) -> Cluster:
        """The cluster with memory caps for a model needing ``model_bytes``, accelerators on 'meta'."""
        base = load_cluster(CLUSTER_DIR / self.file)
        devices = []
        for d in base.devices:
            share = self.memory_share[d.name]
            cap = None if share is None else int(share * model_bytes)
            devices.append(Device(d.name, "cpu" if d.kind == "cpu" else "meta", d.kind, cap))
        return dataclasses.replace(base, devices=tuple(devices))


CLUSTERS = (
    ClusterSpec("A: fast+slow GPU+host", "two-gpus-and-cpu.json",
                {"cuda": 1 / 8, "cuda-t4": 1 / 2, "cpu": 1.0},
                {"cuda:0": 0.5, "cuda:1": 0.5, "cpu": None}),
    ClusterSpec("B: 4 edge devices, line", "edge-devices.json",
                {"cuda": 1 / 8, "jetson-orin": 1 / 4, "jetson-nano": 1 / 2, "arm": 2.0},
                {"edge-server": 0.4, "jetson-orin": 0.4, "jetson-nano": 0.4, "camera-pi": 0.4}),
)


# -- baselines ------------------------------------------------------------------------------------
def fastest_first(problem: Problem) -> list[Device]:
    """Devices by the time the whole graph takes on each (devices that cannot run a node last)."""
    def total(d: Device) -> float:
        return math.fsum(problem.node_time(v, d) for v in problem.graph)

    return sorted(problem.cluster.devices, key=total)


def single_device(problem: Problem) -> Plan:
    """Everything on the fastest device whose memory holds the whole graph.

    Raises:
        InfeasibleError: if no device holds it.
    """
    t0 = time.perf_counter()
    order, need = problem.graph.topological_order(), costmodel.memory(problem, problem.graph)
    for d in fastest_first(problem):
        if (d.memory_bytes is None or need <= d.memory_bytes) and all(
                math.isfinite(problem.node_time(v, d)) for v in order):
            return Plan.build(problem, [Stage(d.name, tuple(order))], solver="single-device",
                              seconds=time.perf_counter() - t0, lower_bound=latency_lower_bound(problem),
                              status="feasible")
    raise InfeasibleError(f"no single device holds the {need} bytes the graph needs", min_memory_bytes=need)


def sequential(problem: Problem) -> Plan:
    """accelerate's ``device_map="auto"`` in spirit: fill devices fastest first, nodes in topological order.

    Each node goes to the current device until the next one would break its memory cap; then the
    fill moves on to the next device and never comes back. One stage per device used.

    Raises:
        InfeasibleError: if the nodes do not fit on the devices this way.
    """
    t0 = time.perf_counter()
    devices = fastest_first(problem)
    caps = [math.inf if d.memory_bytes is None else d.memory_bytes for d in devices]
    runs: list[tuple[str, list[str]]] = []
    i, used = 0, 0
    for v in problem.graph.topological_order():
        need = costmodel.memory(problem, [v])
        while i < len(devices) and used + need > caps[i]:
            i, used = i + 1, 0
        if i == len(devices):
            raise InfeasibleError(f"sequential fill: node {v!r} ({need} bytes) fits on no remaining device")
        if not runs or runs[-1][0] != devices[i].name:
            runs.append((devices[i].name, []))
        runs[-1][1].append(v)
        used += need
    stages = [Stage(d, tuple(nodes)) for d, nodes in runs]
    return Plan.build(problem, stages, solver="sequential", seconds=time.perf_counter() - t0,
                      lower_bound=latency_lower_bound(problem), status="feasible")


# -- one placement ----------------------------------------------------------------------------------
@dataclass
class Row:
    model: str
    cluster: str
    fused: bool
    nodes: int
    method: str
    plan: Plan | None = None
    seconds: float = 0.0
    note: str = ""
    milp_bound: str = "-"


def _method(name: str, time_limit: float, ip_time_limit: float) -> Callable[[Problem], Plan]:
    if name == "single device":
        return single_device
    if name == "sequential":
        return sequential
    if name == "moirai":
        return lambda p: solve(p, method=name, time_limit=time_limit, warm_start=_best_scheduler(p))
    limit = {"latency-ip": ip_time_limit}.get(name)
    return lambda p: solve(p, method=name, time_limit=limit)


def _best_scheduler(problem: Problem) -> Plan | None:
    """The better of m-SCT's and m-ETF's plans: the MOIRAI MILP's start, as ``auto`` runs it."""
    plans = []
    for name in ("m-sct", "m-etf"):
        try:
            plans.append(solve(problem, method=name))
        except InfeasibleError:
            pass
    return min(plans, key=lambda p: p.objective, default=None)


def place_one(problem: Problem, name: str, fused: bool, time_limit: float, ip_time_limit: float,
              label: tuple[str, str], milp_nodes: int = MILP_NODES) -> Row:
    """Run method ``name`` on ``problem`` (on its coarsened graph if ``fused``) and describe the result."""
    t0 = time.perf_counter()
    target, c = problem, None
    if fused:
        c = coarsen(problem.graph, devices=len(problem.cluster))
        target = c.coarse_problem(problem)
    row = Row(*label, fused, len(target.graph), name)
    if name == "moirai" and len(target.graph) > milp_nodes:
        row.note = f"skipped ({len(target.graph)} nodes)"
        return row
    try:
        plan = _method(name, time_limit, ip_time_limit)(target)
        if name == "moirai":
            row.milp_bound = f"{1e3 * plan.meta['milp_bound']:.4g}" + (" c" if fused else "")
        if c is not None:
            plan = c.expand_plan(plan, problem, lower_bound=latency_lower_bound(problem))
    except InfeasibleError:
        row.note = "does not fit" if name in BASELINES else "infeasible"
    except SolverLimitError:
        row.note = "no incumbent within the limit"
    except Exception as e:  # noqa: BLE001 - keep the table going; the row says what broke
        row.note = f"error: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
    else:
        assert plan.objective == costmodel.evaluate(problem, plan)
        row.plan = plan
    row.seconds = time.perf_counter() - t0
    return row


# -- tables -----------------------------------------------------------------------------------------
def _ms(x: float) -> str:
    return f"{1e3 * x:.4g}"


def print_rows(rows: Sequence[Row], best_lb: Mapping[tuple[str, str], float]) -> None:
    print("| model | cluster | fusion | nodes | method | predicted ms | LB ms | MILP bound ms | gap (own LB) "
          "| gap (best LB) | status | seconds |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        fusion = "fused" if r.fused else "-"
        head = f"| {r.model} | {r.cluster} | {fusion} | {r.nodes} | {r.method} |"
        if r.plan is None:
            print(f"{head} {r.note} | | | | | | {r.seconds:.2f} |")
            continue
        p, lb = r.plan, best_lb[r.model, r.cluster]
        gap_best = max(0.0, (p.objective - lb) / p.objective) if p.objective else 0.0
        status = p.meta.get("coarse_status", p.status) if r.fused else p.status
        print(f"{head} {_ms(p.objective)} | {_ms(p.lower_bound)} | {r.milp_bound} | {100 * p.gap:.1f}% "
              f"| {100 * gap_best:.1f}% | {status} | {r.seconds:.2f} |")


def print_summary(rows: Sequence[Row], best_lb: Mapping[tuple[str, str], float]) -> None:
    """One line per (model, cluster, fusion): each method's predicted ms, the best in bold.

    MOIRAI cells add ``opt`` (proven optimal; on the coarse graph for fused rows) or ``TL`` (time
    limit) and the placement seconds.
    """
    methods = (*SOLVER_METHODS, *BASELINES)
    print(f"| model | cluster | fusion | nodes | {' | '.join(methods)} | best LB |")
    print("|---" * (5 + len(methods)) + "|")
    groups: dict[tuple[str, str, bool], dict[str, Row]] = {}
    for r in rows:
        groups.setdefault((r.model, r.cluster, r.fused), {})[r.method] = r
    for (model, cluster, fused), by_method in groups.items():
        done = [r.plan.objective for r in by_method.values() if r.plan is not None]
        best = min(done, default=math.inf)
        cells = []
        for m in methods:
            r = by_method[m]
            if r.plan is None:
                cells.append(r.note)
                continue
            cell = _ms(r.plan.objective)
            cell = f"**{cell}**" if r.plan.objective <= best * (1 + 1e-9) else cell
            if m == "moirai":
                status = r.plan.meta.get("coarse_status", r.plan.status)
                tag = {"optimal": "opt", "time_limit": "TL"}.get(status, status)
                cell += f" ({tag}, {r.seconds:.0f} s)"
            cells.append(cell)
        nodes = next(iter(by_method.values())).nodes
        print(f"| {model} | {cluster} | {'fused' if fused else '-'} | {nodes} | {' | '.join(cells)} "
              f"| {_ms(best_lb[model, cluster])} |")


# -- real measurement on logical CPUs ---------------------------------------------------------------
def _tensors(out: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _equal(a: Any, b: Any) -> bool:
    xs, ys = _tensors(a), _tensors(b)
    return len(xs) == len(ys) > 0 and all(torch.equal(x, y) for x, y in zip(xs, ys))


def _timed_ms(fn: Callable[[], Any], repeats: int, warmup: int = 3) -> str:
    """``"median (min)"`` milliseconds of ``repeats`` calls after ``warmup`` calls."""
    with torch.no_grad():
        for _ in range(warmup):
            fn()
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples.append(1e3 * (time.perf_counter() - t0))
    return f"{statistics.median(samples):.3g} ({min(samples):.3g})"


def measure(name: str, repeats: int, time_limit: float) -> str:
    """One markdown row: real latency of the model, a one-device and a two-logical-CPU placement."""
    model, inputs = models.build(name, batch=BATCH)
    opts: dict[str, Any] = {"objective": "latency", "time_limit": time_limit, "progress": False}
    t0 = time.perf_counter()
    two = torchplace.place(model, ["cpu:0", "cpu:1"], inputs, allow_single_device=False, **opts)
    seconds = time.perf_counter() - t0
    one = torchplace.place(model, ["cpu:0"], inputs, **opts)
    with torch.no_grad():
        ref = model(*inputs)
        equal = _equal(two(*inputs), ref) and _equal(one(*inputs), ref)
    eager = _timed_ms(lambda: model(*inputs), repeats)
    t_one = _timed_ms(lambda: one(*inputs), repeats)
    t_two = _timed_ms(lambda: two(*inputs), repeats)
    plan = two.plan
    split = ", ".join(f"{d}: {n}" for d, n in sorted(_nodes_per_device(plan).items()))
    return (f"| {name} | {len(two.problem.graph)} | {plan.solver} | {split} | {_ms(plan.objective)} "
            f"| {_ms(plan.lower_bound)} | {seconds:.1f} | {eager} | {t_one} | {t_two} | {'yes' if equal else 'NO'} |")


def _nodes_per_device(plan: Plan) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in plan.stages:
        out[s.device] = out.get(s.device, 0) + len(s.nodes)
    return out


# -- main -------------------------------------------------------------------------------------------
def profiled(name: str, repeats: int) -> OpGraph:
    """The operator graph of example model ``name`` with median CPU times (``kinds=["cpu"]``)."""
    model, inputs = models.build(name, batch=BATCH)
    with torch.no_grad():
        traced = trace(model, inputs, granularity="operator")
        return profile(traced, inputs, kinds=["cpu"], warmup=3, repeats=repeats, progress=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", choices=["inception", "resnet", "gpt2", "bert"], default=None)
    ap.add_argument("--time-limit", type=float, default=None, help="MOIRAI MILP seconds (default 60; quick 5)")
    ap.add_argument("--ip-time-limit", type=float, default=None, help="latency IP seconds (default 30; quick 5)")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls per real measurement (default 20)")
    ap.add_argument("--quick", action="store_true", help="inception and resnet, 5 s limits, 10 repeats")
    ap.add_argument("--milp-nodes", type=int, default=None,
                    help=f"largest graph MOIRAI runs on (default {MILP_NODES}; quick {QUICK_MILP_NODES})")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1, see docstring)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    names = args.models or (["inception", "resnet"] if args.quick else ["inception", "resnet", "gpt2", "bert"])
    time_limit = args.time_limit or (5.0 if args.quick else 60.0)
    ip_time_limit = args.ip_time_limit or (5.0 if args.quick else min(30.0, time_limit))
    repeats = args.repeats or (10 if args.quick else 20)
    milp_nodes = args.milp_nodes or (QUICK_MILP_NODES if args.quick else MILP_NODES)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    print(f"Run {date.today()}, {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} intra-op threads; MOIRAI limit {time_limit:g} s, latency IP {ip_time_limit:g} s, "
          f"MOIRAI on graphs of <= {milp_nodes} nodes\n")

    rows: list[Row] = []
    best_lb: dict[tuple[str, str], float] = {}
    coarsening: list[str] = []
    for name in names:
        graph = profiled(name, repeats=5 if args.quick else 11)
        for spec in CLUSTERS:
            g = scaled(graph, spec.factors)
            cluster = spec.build(sum(r.param_bytes + r.temp_bytes for _, r in g.records()))
            problem = Problem(g, cluster, objective="latency", contiguous=False)
            key = (name, spec.name)
            best_lb[key] = latency_lower_bound(problem)
            for fused in (False, True):
                for method in (*SOLVER_METHODS, *BASELINES):
                    row = place_one(problem, method, fused, time_limit, ip_time_limit, key, milp_nodes)
                    rows.append(row)
                    if row.plan is not None and not fused:
                        best_lb[key] = max(best_lb[key], row.plan.lower_bound)
                    result = row.note if row.plan is None else f"{_ms(row.plan.objective)} ms"
                    print(f"<!-- {name} / {spec.name} / {'fused' if fused else 'ops'} / {method}: "
                          f"{result} in {row.seconds:.1f} s -->", flush=True)
            coarsening.append(f"| {name} | {spec.name} | {coarsen(g, devices=len(cluster)).report()} |")

    print("\n### Predicted latency (ms) per method, best in bold\n")
    print_summary(rows, best_lb)
    print("\n### Predicted latency on heterogeneous clusters, every run (times scaled from measured CPU times)\n")
    print_rows(rows, best_lb)
    print("\n### Coarsening (fusion.coarsen, devices = cluster size)\n")
    print("| model | cluster | report |\n|---|---|---|")
    print("\n".join(coarsening))
    print("\n### Measured latency on two logical CPUs of this machine (ms: median (min) of "
          f"{repeats} calls)\n")
    print("| model | nodes | solver (auto) | split | predicted ms | LB ms | place() s | model() "
          "| placed, cpu:0 only | placed, cpu:0+cpu:1 | outputs equal |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        print(measure(name, repeats, min(time_limit, 30.0)), flush=True)
    print(f"\nTotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
