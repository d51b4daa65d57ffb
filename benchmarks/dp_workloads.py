"""Ideals DP on the 12 published dnn-partitioning workloads, beside the authors' C++ times.

Run:  python benchmarks/dp_workloads.py [--repeats 3] [--synthetic]

With ``--synthetic`` it also solves Inception-like layer graphs (torchplace/workloads/synthetic.py):
one with free leaves on every layer (what the safe contractions remove) and one with the size of
the published InceptionV3 layer graph (36,962 ideals, 6.3e8 pairs; the streamed DP), printing
seconds and the process's peak memory.

Prints one markdown row per workload: nodes, supernodes and forward ideals of the contraction
before and after the safe rules of torchplace/solvers/reduce.py, ideal pairs, the optimum found, the published optimum, our seconds (best of --repeats, reading the file included)
and the authors' single-threaded C++ DP's seconds on this machine kind (shared/workloads/README.md).
"""
from __future__ import annotations

import argparse
import platform
import time
from datetime import date
from pathlib import Path

import psutil
import resource

from torchplace.solvers import dp
from torchplace.solvers.contract import contractions
from torchplace.solvers.ideals import enumerate_ideals
from torchplace.errors import TooManyIdealsError
from torchplace.workloads import read_dnn_partitioning
from torchplace.workloads.synthetic import inception_like

ROOT = Path(__file__).resolve().parents[1].parent / "shared" / "workloads" / "dnn-partitioning" / "throughput"

# (published optimum, authors' C++ DP seconds on this 2-core machine kind; None = "under 1 s")
WORKLOADS = {
    "OperatorGraphs/bert_l-3_inference.json": (27.9186, 3.0),
    "OperatorGraphs/bert_l-6_inference.json": (29.5795, 3.6),
    "OperatorGraphs/bert_l-12_inference.json": (147.478, 15.0),
    "OperatorGraphs/resnet50_inference.json": (124.349, 0.5),
    "OperatorGraphs/bert_l-3_training.json": (65.3031, 7.8),
    "OperatorGraphs/bert_l-6_training.json": (72.865, 19.0),
    "OperatorGraphs/bert_L-12_training.json": (437.998, 34.0),
    "OperatorGraphs/resnet50_training.json": (255.194, 0.3),
    "LayerGraphs/bert24_inference.json": (17.7899, None),
    "LayerGraphs/bert24_training.json": (41.7458, None),
    "LayerGraphs/resnet50_inference.json": (33.7747, None),
    "LayerGraphs/resnet50_training.json": (78.6318, None),
}


def run(name: str, repeats: int) -> tuple[int, dict, float, float]:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        problem = read_dnn_partitioning(ROOT / name)
        plan = dp.solve(problem)
        best = min(best, time.perf_counter() - t0)
    return len(problem.graph), plan.meta, plan.objective, best


def ideals_before(name: str, meta: dict) -> int:
    """Ideals of the winning contraction without the safe rules."""
    con = contractions(read_dnn_partitioning(ROOT / name).graph)[meta["backward_order"]]
    return len(enumerate_ideals(len(con.nodes), con.edges, limit=10**7))


def synthetic() -> None:
    """Inception-like layer graphs: free leaves removed by the safe contractions; the streamed DP."""
    print("\n| synthetic graph | nodes | supernodes before → after | ideals before → after | ideal pairs | optimum "
          "| streamed | seconds | peak RSS GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    cases = {"inception_like(3, [2, 3, 3], free_leaves=True)": inception_like(3, [2, 3, 3], free_leaves=True),
             "inception_like(11, [5, 6, 7, 9])": inception_like(11, [5, 6, 7, 9])}
    for name, problem in cases.items():
        con = contractions(problem.graph)["reverse"]
        try:
            before = str(len(enumerate_ideals(len(con.nodes), con.edges, limit=2 * 10**6)))
        except TooManyIdealsError:
            before = "> 2,000,000"
        t0 = time.perf_counter()
        plan = dp.solve(problem, ideal_limit=50_000)
        secs = time.perf_counter() - t0
        meta = plan.meta
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(f"| {name} | {len(problem.graph)} | {meta['supernodes_before']} → {meta['supernodes']} | {before} → "
              f"{meta['ideals']} | {meta['ideal_pairs']:,} | {plan.objective:.6g} | {meta['streamed']} | {secs:.1f} "
              f"| {peak:.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--synthetic", action="store_true", help="also the Inception-like graphs (minutes)")
    args = ap.parse_args()
    print(f"# DP on dnn-partitioning workloads — {date.today()}, {platform.processor() or platform.machine()}, "
          f"{psutil.cpu_count()} cores, Python {platform.python_version()}\n")
    print("| workload | nodes | supernodes before → after | ideals before → after | ideal pairs | optimum | published "
          "| match | seconds | C++ seconds | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, (published, cpp) in WORKLOADS.items():
        nodes, meta, obj, secs = run(name, args.repeats)
        match = "yes" if abs(obj - published) <= 1e-4 * published else "NO"
        cpp_s = f"{cpp:.1f}" if cpp is not None else "< 1"
        speed = f"{cpp / secs:.1f}x" if cpp is not None else "-"
        shrink = f"{meta['supernodes_before']} → {meta['supernodes']}"
        ideals = f"{ideals_before(name, meta)} → {meta['ideals']}"
        print(f"| {name} | {nodes} | {shrink} | {ideals} | {meta['ideal_pairs']} | {obj:.6g} | {published} | {match} "
              f"| {secs:.3f} | {cpp_s} | {speed} |", flush=True)
    if args.synthetic:
        synthetic()


if __name__ == "__main__":
    main()
