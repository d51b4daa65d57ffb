"""Every throughput method and every lower bound on the published workloads, in the layout of
Tarnawski et al. 2020 Table 1 (max-load and runtime per method) and Archer et al. 2024 Table 1
(lower bounds as a fraction of the best plan found).

Run:  python benchmarks/solvers_table.py [--time-limit 60] [--bound-time-limit 30] [--only bert24]
      python benchmarks/solvers_table.py --certificates [--k 2 4 8 16] [--instance-limit 60]

``--certificates`` (issue 16, items 5-6): every workload at k = 2, 4, 8, 16 accelerators (the
file's CPUs), solved as a user gets it, ``auto`` with ``bounds="mip"`` within ``--instance-limit``
seconds in all: the DP's contiguous optimum (its certificate within contiguous splits), and the
bound over any split (the simple bound, the cut bound, guess-the-bottleneck, the non-contiguous
max-load MILP started from the DP's plan). "best" is the best plan over any split: the DP's, the
DP's polished by local search (:mod:`torchplace.solvers.polish`) or the MILP's
incumbent. Prints bound / best per
instance, the wall time against the limit, and the geo-mean.

Methods: the ideals DP, DPL, the max-load IP restricted to contiguous splits and unrestricted
(Tarnawski App. C), SliceGraph over random orders and BRKGA (Archer Sec. 4, App. C.1), and the
human expert split where the workload has one. Bounds: simple (Archer Lemma 3.3), cut
(:mod:`torchplace.solvers.cut_bound`: transfers priced by minimum cuts, and the pigeonhole count
of groups per device), three-superblock
(3.2), guess-the-bottleneck (3.3) and the non-contiguous IP's proven bound ("exact" when it closed
the gap). A MILP stopped by its limit is reported with its incumbent and a "*".
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path

from torchplace.errors import SolverLimitError, TooManyIdealsError
from torchplace.plan import Plan
from torchplace.problem import Problem
from torchplace.solvers import brkga, dp, slicegraph
from torchplace.solvers.bounds import simple_lower_bound
from torchplace.solvers.cut_bound import cut_lower_bound
from torchplace.solvers.milp import bounds as mip_bounds
from torchplace.solvers.milp import maxload
from torchplace.workloads import read_dnn_partitioning, read_expert_split

ROOT = Path(__file__).resolve().parents[1].parent / "shared" / "workloads" / "dnn-partitioning"
WORKLOADS = [
    "OperatorGraphs/bert_l-3_inference.json",
    "OperatorGraphs/bert_l-6_inference.json",
    "OperatorGraphs/bert_l-12_inference.json",
    "OperatorGraphs/resnet50_inference.json",
    "OperatorGraphs/bert_l-3_training.json",
    "OperatorGraphs/bert_l-6_training.json",
    "OperatorGraphs/bert_L-12_training.json",
    "OperatorGraphs/resnet50_training.json",
    "LayerGraphs/bert24_inference.json",
    "LayerGraphs/bert24_training.json",
    "LayerGraphs/resnet50_inference.json",
    "LayerGraphs/resnet50_training.json",
]
EXPERT = {"LayerGraphs/bert24_inference.json": "bert24_inference_expert.json"}
# The paper's non-contiguous IP values (Table 1) that ours should meet or beat.
PAPER_NONCONTIGUOUS = {
    "OperatorGraphs/bert_l-3_inference.json": 21.91,
    "OperatorGraphs/bert_l-3_training.json": 54.21,
    "OperatorGraphs/bert_l-6_inference.json": 28.33,
    "LayerGraphs/resnet50_inference.json": 33.31,
}


def _expert_plan(problem: Problem, path: Path) -> Plan:
    """The human expert split as a plan (it need not be contiguous)."""
    stages = maxload.stages_from_assignment(problem, read_expert_split(path, problem))
    return Plan.build(problem, stages, solver="expert", seconds=0.0, lower_bound=0.0, status="feasible")


def _timed(fn: Callable[[], Plan]) -> tuple[Plan | None, float, str]:
    t0 = time.perf_counter()
    try:
        plan = fn()
    except TooManyIdealsError as e:
        return None, time.perf_counter() - t0, f"> {e.limit} ideals"
    except SolverLimitError:
        return None, time.perf_counter() - t0, "no incumbent"
    return plan, time.perf_counter() - t0, ""


def _cell(plan: Plan | None, note: str) -> str:
    if plan is None:
        return note
    star = "*" if plan.status == "time_limit" else ""
    return f"{plan.objective:.4f}{star}"


def run(name: str, args: argparse.Namespace) -> tuple[list[str], list[str]]:
    problem = read_dnn_partitioning(ROOT / "throughput" / name)
    loose = dataclasses.replace(problem, contiguous=False)
    tl = args.time_limit
    methods: dict[str, Callable[[], Plan]] = {
        "DP": lambda: dp.solve(problem),
        "DPL": lambda: dp.solve_linearized(problem),
        "IP contiguous": lambda: maxload.solve(problem, time_limit=tl),
        "IP non-contiguous": lambda: maxload.solve(loose, time_limit=tl),
        "SliceGraph (16 orders)": lambda: slicegraph.solve(problem, random_orders=16, seed=0, time_limit=tl),
        "BRKGA": lambda: brkga.solve(problem, seed=0, time_limit=tl),
    }
    if name in EXPERT:
        expert = ROOT / EXPERT[name]
        methods["expert"] = lambda: _expert_plan(loose, expert)
    plans: dict[str, Plan | None] = {}
    cells = [name.split("/")[1].removesuffix(".json"), str(len(problem.graph))]
    for label, fn in methods.items():
        plan, seconds, note = _timed(fn)
        plans[label] = plan
        cells.append(f"{_cell(plan, note)} ({seconds:.1f} s)")
    best = min(p.objective for p in plans.values() if p is not None)
    exact = plans["IP non-contiguous"]
    lb = {
        "simple": simple_lower_bound(problem),
        "cut": cut_lower_bound(problem, time_limit=args.bound_time_limit),
        "three-superblock": mip_bounds.three_superblock_bound(problem, time_limit=args.bound_time_limit),
        "guess-the-bottleneck": mip_bounds.guess_the_bottleneck_bound(problem, time_limit=args.bound_time_limit),
        "exact": exact.lower_bound if exact is not None else 0.0,
    }
    bound_cells = [cells[0], f"{best:.4f}"] + [f"{v / best:.3f}" for v in lb.values()]
    paper = PAPER_NONCONTIGUOUS.get(name)
    bound_cells.append("-" if paper is None else f"{paper} ({'met' if exact and exact.objective <= paper + 5e-3 else 'not met'})")
    return cells, bound_cells


def certificates(args: argparse.Namespace) -> None:
    """The ``--certificates`` table (module docstring)."""
    from torchplace.solvers.auto import solve_auto

    print(f"Run {date.today()}, {platform.machine()}, {platform.python_version()}, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}; auto bounds='mip' within {args.instance_limit:g} s per instance\n")
    print("| workload | k | nodes | best max-load | contiguous optimal | bound over any split | bound / best | "
          "bound from | wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    ratios = []
    for name in WORKLOADS:
        if args.only not in name:
            continue
        for k in args.k:
            problem = read_dnn_partitioning(ROOT / "throughput" / name, accelerators=k)
            t0 = time.perf_counter()
            plan = solve_auto(problem, time_limit=args.instance_limit, bounds="mip", milp_nodes=0)
            wall = time.perf_counter() - t0
            tried = plan.meta["auto"]
            found = [tried.get(key) for key in ("ip", "polish")]  # non-contiguous plans, not returned
            best = min([plan.objective] + [v for v in found if isinstance(v, float)])
            ratio = plan.lower_bound / best
            ratios.append(ratio)
            named = {"cut bound": tried.get("cut_bound"), "guess-the-bottleneck": tried.get("guess_the_bottleneck_bound")}
            source = next((n for n, v in named.items()
                           if isinstance(v, float) and abs(plan.lower_bound - min(v, best)) <= 1e-9 * max(1.0, v)),
                          "IP / simple")
            if ratio >= 1 - 1e-9:
                source = f"proof (bound = plan: {source})"
            print(f"| {name.split('/')[1].removesuffix('.json')} ({name.split('/')[0][:5]}) | {k} | {len(problem.graph)} "
                  f"| {best:.4f} | {'yes' if isinstance(tried.get('dp'), float) else 'no'} "
                  f"| {plan.lower_bound:.4f} | {ratio:.3f} | {source} | {wall:.1f} |", flush=True)
    geo = math.exp(statistics.fmean(math.log(max(r, 1e-12)) for r in ratios)) if ratios else math.nan
    print(f"\ngeo-mean bound / best over {len(ratios)} instances: {geo:.3f} (goal >= 0.97)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--time-limit", type=float, default=60.0, help="seconds per MILP and per search")
    ap.add_argument("--bound-time-limit", type=float, default=30.0, help="seconds per bound MIP")
    ap.add_argument("--only", default="", help="run only workloads whose path contains this")
    ap.add_argument("--certificates", action="store_true", help="bound / best at each k (see the docstring)")
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4, 8, 16], help="accelerator counts for --certificates")
    ap.add_argument("--instance-limit", type=float, default=60.0, help="seconds per instance for --certificates")
    args = ap.parse_args()
    if args.certificates:
        certificates(args)
        return
    rows, bound_rows = [], []
    for name in WORKLOADS:
        if args.only in name:
            r, b = run(name, args)
            rows.append(r)
            bound_rows.append(b)
            print(" | ".join(r), flush=True)
    print(f"\nRun {date.today()}, {platform.machine()}, {platform.python_version()}; "
          f"--time-limit {args.time_limit:g} --bound-time-limit {args.bound_time_limit:g}\n")
    head = ["workload", "nodes", "DP", "DPL", "IP contiguous", "IP non-contiguous", "SliceGraph (16 orders)", "BRKGA",
            "expert"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(r + ["-"] * (len(head) - len(r))) + " |")
    head = ["workload", "best max-load", "simple", "cut", "three-superblock", "guess-the-bottleneck", "exact (IP bound)",
            "paper non-contiguous"]
    print("\nLower bounds as a fraction of the best plan found:\n")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for b in bound_rows:
        print("| " + " | ".join(b) + " |")


if __name__ == "__main__":
    main()
