"""Reproduce Piper's evaluation (Tarnawski, Narayanan, Phanishayee, NeurIPS 2021, Sec. 5) on
BERT-32 (../shared/workloads/piper/bert32a100.json, from msr-fiddle/piper, MIT licence).

    python benchmarks/piper.py fig1 [--memory 1 2 8 80] [--devices 8 32 ... 2048]
    python benchmarks/piper.py time            # K=2048, N=512, 8 GiB: the paper's 13-minute case
    python benchmarks/piper.py fig2 [--microbatches 512]   # TPS vs k from one run per method
    python benchmarks/piper.py knapsack        # App. C: heuristic vs HiGHS on sampled subproblems

fig1 prints, for every memory size and device count (N = 1920 micro-batches, 25 GiB/s, as in the
authors' plots), Piper's time per sample and the throughput of each baseline normalised to
Piper's (1.000 = as good; 0.000 = no configuration fits, "OOM"), with the seconds each took; a DP
run is cut off after LIMIT seconds ("t/o").
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torchplace.errors import InfeasibleError, SolverLimitError  # noqa: E402
from torchplace.solvers import piper, piper_equi, piper_knapsack  # noqa: E402
from torchplace.workloads import read_piper  # noqa: E402

BERT = ROOT.parent / "shared" / "workloads" / "piper" / "bert32a100.json"
GIB = 2**30
LIMIT = 240.0  # seconds per DP run in fig1; a run cut off shows "t/o"
BASELINES = {  # (problem, seconds) -> plan
    "no DP": lambda p, limit: piper.solve(p, data_parallel=False, time_limit=limit),
    "no TP": lambda p, limit: piper.solve(p, tensor_parallel=False, time_limit=limit),
    "no AR": lambda p, limit: piper.solve(p, recompute=False, time_limit=limit),
    "equi": lambda p, limit: piper_equi.solve(p),
    "equi-no TP": lambda p, limit: piper_equi.solve(p, tensor_parallel=False),
}


def problem(devices: int, memory_gib: float, microbatches: int = 1920):
    return read_piper(BERT, devices=devices, memory_bytes=memory_gib * GIB, microbatches=microbatches,
                      bandwidth=25 * GIB)


def _timed(fn, p):
    start = time.perf_counter()
    try:
        return fn(p).objective, time.perf_counter() - start
    except InfeasibleError:
        return math.inf, time.perf_counter() - start
    except SolverLimitError:
        return math.nan, time.perf_counter() - start


def _ratio(ours: float, tps: float) -> str:
    if math.isnan(ours) or math.isnan(tps):
        return "t/o"
    if math.isinf(ours) and math.isinf(tps):
        return "OOM"
    return "0.000" if math.isinf(tps) else f"{ours / tps:.3f}"


def fig1(memories: list[float], devices: list[int], limit: float = LIMIT) -> None:
    print("| memory | K | Piper TPS (s) | Piper s | " + " | ".join(f"{b}" for b in BASELINES) + " | baselines s |")
    print("|---|---|---|---|" + "---|" * len(BASELINES) + "---|")
    for mem in memories:
        for k in devices:
            p = problem(k, mem)
            ours, secs = _timed(lambda q: piper.solve(q, time_limit=limit), p)
            cells, base_secs = [], 0.0
            for fn in BASELINES.values():
                tps, s = _timed(lambda q, fn=fn: fn(q, limit), p)
                base_secs += s
                cells.append(_ratio(ours, tps))
            shown = "t/o" if math.isnan(ours) else "OOM" if math.isinf(ours) else f"{ours:.6g}"
            print(f"| {mem:g} GiB | {k} | {shown} | {secs:.1f} | " + " | ".join(cells) + f" | {base_secs:.1f} |",
                  flush=True)


def fig2(microbatches: int, memory: float, devices: list[int]) -> None:
    """Fig. 2: one unpruned run per method at K = max(devices) gives the best TPS for every k."""
    p = problem(max(devices), memory, microbatches)
    order = p.graph.topological_order()
    rows = {}
    for name, opts in (("Piper", {}), ("no TP", {"tensor_parallel": False}), ("no DP", {"data_parallel": False}),
                       ("no AR", {"recompute": False})):
        start = time.perf_counter()
        st = piper._Stages(p, order, data_parallel=opts.get("data_parallel", True),
                           tensor_parallel=opts.get("tensor_parallel", True), recompute=opts.get("recompute", True),
                           knapsack=piper_knapsack.heuristic)
        table = piper.run_dp(p, st, order).dp[-1]
        rows[name] = [table[k, min(k, st.smax)] for k in devices]
        print(f"({name}: {time.perf_counter() - start:.1f} s)", flush=True)
    print(f"N={microbatches}, {memory:g} GiB: best TPS (s) by number of devices k")
    print("| k | " + " | ".join(rows) + " |")
    print("|---|" + "---|" * len(rows))
    for i, k in enumerate(devices):
        print(f"| {k} | " + " | ".join("OOM" if math.isinf(v[i]) else f"{v[i]:.6g}" for v in rows.values()) + " |")


def timing(devices: int, microbatches: int, memory: float, repeats: int) -> None:
    p = problem(devices, memory, microbatches)
    for _ in range(repeats):
        start = time.perf_counter()
        plan = piper.solve(p)
        total = time.perf_counter() - start
        unpruned_start = time.perf_counter()
        plain = piper.solve(p, prune=False) if devices <= 512 else None
        print(f"K={devices} N={microbatches} {memory:g} GiB: TPS {plan.objective:.6g}, {total:.1f} s "
              f"(DP {plan.meta['dp_seconds']:.1f} s, {plan.meta['downsets']} downsets, {plan.meta['pairs']} pairs)"
              + (f"; without pruning {time.perf_counter() - unpruned_start:.1f} s, TPS {plain.objective:.6g}"
                 if plain else ""), flush=True)


def knapsack(samples: int, seed: int) -> None:
    """App. C: random non-trivial knapsack subproblems of K=512, N=512, 8 GiB; heuristic vs exact."""
    p = problem(512, 8, 512)
    order = p.graph.topological_order()
    stages = piper._Stages(p, order, data_parallel=True, tensor_parallel=True, recompute=True,
                           knapsack=piper_knapsack.heuristic)
    downsets = piper._downsets(p, order, 20_000)
    rng = np.random.default_rng(seed)
    pairs = [(i, j) for i in range(1, len(downsets))
             for j in downsets.sub_index[downsets.sub_indptr[i]:downsets.sub_indptr[i + 1] - 1]]
    tried = worse = 0
    loss = 0.0
    start = time.perf_counter()
    while tried < samples:
        i, j = pairs[rng.integers(len(pairs))]
        members = downsets.membership[i] & ~downsets.membership[j]
        idx = np.flatnonzero(members)
        t, d = stages.options[rng.integers(len(stages.options))]
        arr = stages.arrays[t]
        if not arr.has[idx].all():
            continue
        y = float(rng.integers(1, -(-stages.smax // d) + 1))
        cost = stages._costs(arr, idx, (~members).astype(float), np.array([float(d)]))
        fast = (arr.a[idx][np.arange(idx.size), cost[:, :, 0].argmin(1)] * y
                + arr.b[idx][np.arange(idx.size), cost[:, :, 0].argmin(1)]).sum()
        if fast <= p.parallel.memory_bytes:  # trivial: the fastest TMPCs fit
            continue
        h, _ = piper_knapsack.heuristic(cost, arr.a[idx], arr.b[idx], p.parallel.memory_bytes, np.array([y]))
        e, _ = piper_knapsack.exact(cost, arr.a[idx], arr.b[idx], p.parallel.memory_bytes, np.array([y]))
        tried += 1
        if np.isfinite(e[0]) and h[0] > e[0] * (1 + 1e-9):
            worse += 1
            loss = max(loss, h[0] / e[0] - 1)
        elif np.isinf(e[0]) != np.isinf(h[0]):
            worse += 1
    print(f"{tried} non-trivial knapsack subproblems (K=512, N=512, 8 GiB): heuristic worse than HiGHS on "
          f"{worse}, largest loss {100 * loss:.3f}% ({time.perf_counter() - start:.1f} s)")
    for k, mem in ((8, 8),):  # the whole DP with each knapsack (HiGHS per column: minutes beyond this)
        q = problem(k, mem, 1920)
        h_start = time.perf_counter()
        h = piper.solve(q)
        h_secs, e_start = time.perf_counter() - h_start, time.perf_counter()
        e = piper.solve(q, knapsack="exact")
        print(f"DP, K={k}, N=1920, {mem} GiB: heuristic TPS {h.objective:.9g} ({h_secs:.1f} s), exact (HiGHS) "
              f"{e.objective:.9g} ({time.perf_counter() - e_start:.1f} s), loss {100 * (h.objective / e.objective - 1):.4f}%",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    f = sub.add_parser("fig1")
    f.add_argument("--memory", type=float, nargs="+", default=[1, 2, 8, 80])
    f.add_argument("--devices", type=int, nargs="+", default=[8, 32, 64, 128, 512, 1024, 2048])
    f.add_argument("--limit", type=float, default=LIMIT, help="seconds per DP run before it shows t/o")
    t = sub.add_parser("time")
    t.add_argument("--devices", type=int, default=2048)
    t.add_argument("--microbatches", type=int, default=512)
    t.add_argument("--memory", type=float, default=8)
    t.add_argument("--repeats", type=int, default=1)
    f2 = sub.add_parser("fig2")
    f2.add_argument("--microbatches", type=int, default=512)
    f2.add_argument("--memory", type=float, default=8)
    f2.add_argument("--devices", type=int, nargs="+", default=[8, 16, 22, 32, 64, 128, 256, 512, 1024, 2048])
    k = sub.add_parser("knapsack")
    k.add_argument("--samples", type=int, default=2000)
    k.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.what == "fig1":
        fig1(args.memory, args.devices, args.limit)
    elif args.what == "fig2":
        fig2(args.microbatches, args.memory, args.devices)
    elif args.what == "time":
        timing(args.devices, args.microbatches, args.memory, args.repeats)
    else:
        knapsack(args.samples, args.seed)


if __name__ == "__main__":
    main()
