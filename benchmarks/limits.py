"""Do time limits and memory hold? Every method on every shared workload, each solve in its own process.

Run:  python benchmarks/limits.py [--time-limit 5] [--only bert_l-12] [--methods moirai ip] [--json out.json]

For each workload (the dnn-partitioning JSONs and the MOIRAI CSV) the throughput methods solve its
throughput form and the latency methods its latency form (non-contiguous, as ``torchplace solve
--objective latency`` does); ``auto`` solves both. Each solve runs in a fresh Python process
(``--child``), which reports the wall time of the ``solve`` call and its own peak RSS
(``getrusage(RUSAGE_SELF).ru_maxrss``), so solves do not pollute each other. The bound checked is
issue 9's: wall <= limit x 1.1 + 3 s and peak RSS <= 4 GB. Prints one markdown row per solve:
method, workload, objective, limit, wall, process wall, peak RSS, outcome; exits 1 if any row
breaks the bound.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import subprocess
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

WORKLOADS_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "workloads"
WORKLOADS = [
    *(f"dnn-partitioning/throughput/OperatorGraphs/{n}.json" for n in (
        "bert_l-3_inference", "bert_l-6_inference", "bert_l-12_inference", "resnet50_inference",
        "bert_l-3_training", "bert_l-6_training", "bert_L-12_training", "resnet50_training")),
    *(f"dnn-partitioning/throughput/LayerGraphs/{n}.json" for n in (
        "bert24_inference", "bert24_training", "resnet50_inference", "resnet50_training")),
    "moirai/example-1__instances.csv",
]
PEAK_BYTES = 4 * 10**9
"""Issue 9's memory bound for one solve (4 GB)."""


def wall_bound(limit: float) -> float:
    """Issue 9's time bound for one solve: ``limit x 1.1 + 3`` seconds."""
    return limit * 1.1 + 3.0


def read_problem(path: Path, objective: str) -> Any:
    """The workload as a Problem with ``objective`` (latency: non-contiguous), as the CLI reads it."""
    from torchplace.workloads import read_dnn_partitioning, read_moirai_csv

    problem = read_moirai_csv(path) if path.suffix == ".csv" else read_dnn_partitioning(path)
    return dataclasses.replace(problem, objective=objective, contiguous=objective == "throughput")


def child(method: str, path: Path, objective: str, limit: float) -> dict[str, Any]:
    """Solve once in this process; the outcome, the solve's wall time and this process's peak RSS."""
    from torchplace.errors import TorchplaceError
    from torchplace.solvers import solve

    problem = read_problem(path, objective)
    t0 = time.perf_counter()
    try:
        plan = solve(problem, method=method, time_limit=limit)
        outcome = f"{plan.status} {plan.objective:.6g}"
    except (TorchplaceError, ValueError) as e:
        outcome = f"{type(e).__name__}: {str(e)[:90]}"
    wall = time.perf_counter() - t0
    return {"wall": wall, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "outcome": outcome}


def run_one(method: str, workload: str, objective: str, limit: float) -> dict[str, Any]:
    """Run :func:`child` in a fresh process; adds ``process_wall`` and whether the bound held."""
    cmd = [sys.executable, __file__, "--child", method, str(WORKLOADS_DIR / workload), objective, str(limit)]
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=wall_bound(limit) + 60)
        row = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {
            "wall": float("nan"), "peak": 0, "outcome": f"exit {done.returncode}: {done.stderr.strip()[-90:]}"}
    except subprocess.TimeoutExpired:
        row = {"wall": float("inf"), "peak": 0, "outcome": "killed: ran past the bound + 60 s"}
    row.update(method=method, workload=workload, objective=objective, limit=limit,
               process_wall=time.perf_counter() - t0)
    row["ok"] = row["wall"] <= wall_bound(limit) and 0 < row["peak"] <= PEAK_BYTES
    return row


def _methods(objective: str, only: list[str] | None) -> list[str]:
    from torchplace.solvers import METHODS

    names = ["auto", *(m for m, spec in METHODS.items() if spec.objective == objective)]
    return [m for m in names if only is None or m in only]


def _row(r: dict[str, Any]) -> str:
    name = Path(r["workload"]).stem
    mark = "" if r["ok"] else " **over**"
    return (f"| {r['method']} | {name} | {r['objective']} | {r['limit']:g} | {r['wall']:.2f} | "
            f"{r['process_wall']:.2f} | {r['peak'] / 2**20:.0f} | {r['outcome'].replace('|', '/')}{mark} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=5.0)
    ap.add_argument("--only", default=None, help="only workloads whose path contains this")
    ap.add_argument("--methods", nargs="+", default=None, help="only these methods")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--child", nargs=4, metavar=("METHOD", "WORKLOAD", "OBJECTIVE", "LIMIT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        method, path, objective, limit = args.child
        print(json.dumps(child(method, Path(path), objective, float(limit))))
        return 0
    print(f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, {date.today()}; "
          "bound: wall <= limit x 1.1 + 3 s, peak RSS <= 4 GB\n")
    print("| method | workload | objective | limit s | wall s | process s | peak RSS MiB | outcome |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for workload in (w for w in WORKLOADS if args.only is None or args.only in w):
        for objective in ("throughput", "latency"):
            for method in _methods(objective, args.methods):
                rows.append(run_one(method, workload, objective, args.time_limit))
                print(_row(rows[-1]), flush=True)
    over = [r for r in rows if not r["ok"]]
    print(f"\n{len(rows) - len(over)} of {len(rows)} solves within the bound; "
          f"slowest {max(r['wall'] for r in rows):.2f} s, largest {max(r['peak'] for r in rows) / 2**20:.0f} MiB")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
