"""Solvers on large synthetic layered DAGs: SliceGraph, BRKGA, DPL and (where ideals are few) the DP.

Run:  python benchmarks/scale.py [--sizes 1000 5000 20000] [--k 8] [--cpu] [--seed 0]

Graphs are REGAL-style layered branching DAGs like the synthetic set of Archer et al. 2024 (Sec. 5):
layers of ``--width`` nodes, every node feeding 1-3 nodes in the next 1-3 layers and every node
after the first layer fed by the layer before; node times U(1, 10) on an accelerator (5x on a CPU),
transfer times U(0.1, 2). ``--k`` accelerators with unlimited memory, plus one CPU with ``--cpu``.
Prints one markdown row per (size, method): nodes, edges, objective, lower bound, seconds.
"""
from __future__ import annotations

import argparse
import platform
import random
import time
from collections.abc import Callable
from datetime import date

import psutil

from torchplace.devices import Cluster, Device
from torchplace.errors import TooManyIdealsError
from torchplace.graph import NodeRecord, OpGraph
from torchplace.plan import Plan
from torchplace.problem import Problem
from torchplace.solvers import SOLVERS, brkga, slicegraph

DPL_MAX_NODES = 5000  # DPL's pair matrices grow as n^2 (3.2 GB of floats at 20k nodes)


def layered_dag(n: int, width: int, seed: int) -> OpGraph:
    """A layered branching DAG with ``n`` nodes (see the module docstring)."""
    rnd = random.Random(seed)
    layers = [list(range(i, min(i + width, n))) for i in range(0, n, width)]
    g = OpGraph()
    for v in range(n):
        t = rnd.uniform(1, 10)
        g.add_node(str(v), NodeRecord(str(v), times={"accel": t, "cpu": 5 * t}, transfer_time=rnd.uniform(0.1, 2)))
    for li, layer in enumerate(layers[:-1]):
        for v in layer:
            for _ in range(rnd.randint(1, 3)):
                target = layers[min(li + rnd.randint(1, 3), len(layers) - 1)]
                g.add_edge(str(v), str(rnd.choice(target)))
        for w in layers[li + 1]:
            if not any(True for _ in g.predecessors(str(w))):
                g.add_edge(str(rnd.choice(layer)), str(w))
    return g


def cluster(k: int, cpu: bool) -> Cluster:
    devices = [Device(f"acc{i}", "meta", "accel") for i in range(k)]
    return Cluster(tuple(devices + ([Device("cpu0", "cpu", "cpu")] if cpu else [])))


def methods(args: argparse.Namespace) -> dict[str, Callable[[Problem], Plan]]:
    return {
        "slicegraph (1 order)": lambda p: slicegraph.solve(p, random_orders=1, seed=args.seed),
        f"brkga ({args.population}x{args.generations}, <= {args.brkga_seconds:g} s)": lambda p: brkga.solve(
            p, seed=args.seed, population=args.population, generations=args.generations,
            time_limit=args.brkga_seconds),
        "dpl": SOLVERS["dpl"],
        "dp (ideal_limit=1000)": lambda p: SOLVERS["dp"](p, ideal_limit=1000),
    }


def run(name: str, fn: Callable[[Problem], Plan], problem: Problem) -> tuple[str, str, str]:
    if name == "dpl" and len(problem.graph) > DPL_MAX_NODES:
        return "skipped", "", f"n > {DPL_MAX_NODES}: its n^2 pair arrays do not fit"
    t0 = time.perf_counter()
    try:
        plan = fn(problem)
    except TooManyIdealsError as e:
        return "—", "", f"too many ideals (> {e.limit}) after {time.perf_counter() - t0:.2f} s"
    return f"{plan.objective:.6g}", f"{plan.lower_bound:.6g}", f"{time.perf_counter() - t0:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 5000, 20000])
    ap.add_argument("--k", type=int, default=8, help="accelerators")
    ap.add_argument("--cpu", action="store_true", help="add one CPU (no transfer costs, 5x slower)")
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--population", type=int, default=10)
    ap.add_argument("--generations", type=int, default=3)
    ap.add_argument("--brkga-seconds", type=float, default=60.0)
    args = ap.parse_args()
    print(f"# Solvers on layered DAGs — {date.today()}, {platform.processor() or platform.machine()}, "
          f"{psutil.cpu_count()} cores; k={args.k}{' + 1 CPU' if args.cpu else ''}, width {args.width}, "
          f"seed {args.seed}\n")
    print("| nodes | edges | method | objective | lower bound | seconds |")
    print("|---|---|---|---|---|---|")
    for n in args.sizes:
        g = layered_dag(n, args.width, args.seed)
        problem = Problem(g, cluster(args.k, args.cpu))
        edges = sum(1 for _ in g.edges)
        for name, fn in methods(args).items():
            obj, lb, secs = run(name, fn, problem)
            print(f"| {n} | {edges} | {name} | {obj} | {lb} | {secs} |", flush=True)


if __name__ == "__main__":
    main()
